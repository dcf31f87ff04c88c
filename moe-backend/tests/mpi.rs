//! The MPI transport with real processes: this test binary starts itself under
//! `mpirun -np N` (each process runs one test as a rank, recognised by OpenMPI's
//! `OMPI_COMM_WORLD_SIZE`), and the parent compares what every rank wrote with the same
//! collectives on the in-process world of threads.
//!
//! Needs OpenMPI (`mpirun`); `.ci/run` installs it. Run with
//! `cargo test -p moe-backend --features mpi --test mpi`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use moe_backend::comm::mpi::{MpiConfig, MpiWorld};
use moe_backend::comm::{Comm, RankCtx, ReduceOp, World};
use moe_backend::dispatch::{AllToAllDispatcher, TokenDispatcher};
use moe_backend::parallel::{GroupFamily, ParallelLayout};

const OUT_VAR: &str = "MOE_MPI_TEST_OUT";

fn under_mpirun() -> bool {
    std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some()
}

/// A session directory of its own for one `mpirun` (OpenMPI's `orte_tmpdir_base`): two
/// `mpirun`s started at the same moment race creating the shared `/tmp/ompi.<host>.<uid>`
/// ("mkdir … File exists") and one of them aborts.
fn ompi_session_dir(name: &str) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("moe-ompi-{name}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("OpenMPI session dir");
    dir
}

/// Starts this test binary as `n` MPI processes running test `name`; returns the output
/// directory, or panics with mpirun's output.
fn mpirun(n: usize, name: &str, extra_env: &[(&str, &str)], limit: Duration) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moe-mpi-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = Command::new("mpirun");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "-np"])
        .arg(n.to_string())
        .arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(OUT_VAR, &dir)
        .env("OMPI_MCA_orte_tmpdir_base", ompi_session_dir(name))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("mpirun (install OpenMPI: openmpi-bin)");
    let out = wait_with_limit(child, limit);
    assert!(
        out.status.success(),
        "mpirun -np {n} {name} failed ({:?}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    dir
}

fn wait_with_limit(mut child: std::process::Child, limit: Duration) -> std::process::Output {
    let start = Instant::now();
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "mpirun did not finish within {limit:?}:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn floats(t: Tensor<1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .unwrap()
}

/// Collectives over the world and over every group family of a folded layout; returns every
/// result as f32 values.
fn script(ctx: &RankCtx) -> moe_backend::Result<Vec<Vec<f32>>> {
    let device = Device::flex();
    let r = ctx.rank();
    let n = ctx.world_size();
    let world = ctx.world()?;
    let vals = |len: usize, salt: usize| -> Tensor<1> {
        let v: Vec<f32> = (0..len)
            .map(|i| ((i * 7 + r * 13 + salt) % 31) as f32 * 0.29 - 4.0 + 1e-7 * i as f32)
            .collect();
        Tensor::from_data(TensorData::new(v, [len]), &device)
    };
    let mut out = Vec::new();
    for len in [3usize, 50_000] {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            out.push(floats(world.all_reduce(vals(len, len), op)?));
        }
    }
    let (g, sizes) = world.all_gather_v(vals(r + 1, 1))?;
    assert_eq!(sizes, (1..=n).collect::<Vec<_>>());
    out.push(floats(g));
    let send: Vec<usize> = (0..n).map(|j| (r + 2 * j) % 3).collect();
    let recv: Vec<usize> = (0..n).map(|i| (i + 2 * r) % 3).collect();
    out.push(floats(world.all_to_all_v(
        vals(send.iter().sum(), 5),
        &send,
        &recv,
    )?));
    let ids = Tensor::<1, Int>::from_data(TensorData::new(vec![r as i64; 3], [3]), &device);
    let ids = world.all_reduce(ids, ReduceOp::Sum)?;
    out.push(
        ids.into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .unwrap_or_default(),
    );
    out.push(floats(world.broadcast(vals(4, 2), n - 1)?));
    let next = (r + 1) % n;
    world.send(vals(5, 9), next)?;
    let got: Tensor<1> = world.recv([5], DType::F32, (r + n - 1) % n, &device)?;
    out.push(floats(got));
    if n == 4 {
        let layout = ParallelLayout::parse(4, "tp=2,ep=4").expect("layout");
        let pg = ctx.process_groups(&layout)?;
        for family in GroupFamily::ALL {
            let comm: &Comm = pg.comm(family);
            out.push(floats(
                comm.all_reduce(vals(7, family as usize), ReduceOp::Sum)?,
            ));
            out.push(vec![comm.traffic().bytes_sent as f32]);
        }
        // One AlltoAll dispatch + combine of routed tokens: the rows every rank receives, the
        // combined output and the EP bytes each rank sent equal the threads'.
        let experts = 8;
        let d = AllToAllDispatcher::new(
            pg.comm(GroupFamily::Ep).clone(),
            pg.comm(GroupFamily::ExptTp).clone(),
            pg.comm(GroupFamily::TpEp).clone(),
            experts,
        )?;
        let tokens = 6 + r;
        let probs: Vec<f32> = (0..tokens * experts)
            .map(|i| {
                if (i * 5 + r).is_multiple_of(3) {
                    0.25
                } else {
                    0.0
                }
            })
            .collect();
        let p = Tensor::<2>::from_data(TensorData::new(probs, [tokens, experts]), &device);
        let map = p.clone().greater_elem(0.0);
        let x = vals(tokens * 4, 3).reshape([tokens, 4]);
        let before = pg.comm(GroupFamily::Ep).traffic().bytes_sent;
        let dispatched = d.dispatch(x, p, map)?;
        let sent = pg.comm(GroupFamily::Ep).traffic().bytes_sent - before;
        out.push(floats(dispatched.rows.clone().reshape([-1])));
        out.push(floats(
            d.combine(dispatched.rows, dispatched.state)?.reshape([-1]),
        ));
        out.push(vec![sent as f32]);
    }
    world.barrier()?;
    Ok(out)
}

fn write_rank(dir: &Path, rank: usize, values: &[Vec<f32>]) {
    let text: Vec<String> = values
        .iter()
        .map(|v| {
            v.iter()
                .map(|x| format!("{:08x}", x.to_bits()))
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    std::fs::write(dir.join(format!("rank{rank}.txt")), text.join("\n")).expect("write");
}

fn read_rank(dir: &Path, rank: usize) -> String {
    std::fs::read_to_string(dir.join(format!("rank{rank}.txt")))
        .unwrap_or_else(|e| panic!("rank {rank} wrote nothing: {e}"))
}

#[test]
fn collectives_over_processes_equal_threads_bit_for_bit() {
    if under_mpirun() {
        let world = MpiWorld::init(MpiConfig::default()).expect("MPI");
        let dir = PathBuf::from(std::env::var(OUT_VAR).expect("output dir"));
        let values = world.run(script).expect("script");
        write_rank(&dir, world.rank(), &values);
        return;
    }
    for n in [1usize, 4] {
        let dir = mpirun(
            n,
            "collectives_over_processes_equal_threads_bit_for_bit",
            &[],
            Duration::from_secs(120),
        );
        let threads = World::run(n, script);
        for (rank, expected) in threads.into_iter().enumerate() {
            let expected = expected.expect("threads");
            let tmp = std::env::temp_dir().join(format!("moe-mpi-expected-{}", std::process::id()));
            std::fs::create_dir_all(&tmp).expect("dir");
            write_rank(&tmp, rank, &expected);
            assert_eq!(
                read_rank(&dir, rank),
                read_rank(&tmp, rank),
                "world {n} rank {rank}: MPI results differ from threads"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_failing_rank_ends_the_job_and_is_named() {
    if under_mpirun() {
        let world = MpiWorld::init(MpiConfig::default()).expect("MPI");
        let _ = world.run(|ctx| {
            let world = ctx.world()?;
            if ctx.rank() == 2 {
                return Err(moe_backend::BackendError::Config {
                    field: "test",
                    detail: "rank 2 gives up on purpose".into(),
                });
            }
            // The others wait in a collective rank 2 never joins.
            world.barrier()?;
            Ok(())
        });
        return;
    }
    let exe = std::env::current_exe().expect("exe");
    let start = Instant::now();
    let child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "4"])
        .arg(exe)
        .args([
            "--exact",
            "a_failing_rank_ends_the_job_and_is_named",
            "--nocapture",
        ])
        .env(
            "OMPI_MCA_orte_tmpdir_base",
            ompi_session_dir("a_failing_rank_ends_the_job_and_is_named"),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun");
    let out = wait_with_limit(child, Duration::from_secs(60));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "the job should fail:\n{text}");
    assert!(text.contains("rank 2 of 4 failed"), "{text}");
    assert!(text.contains("rank 2 gives up on purpose"), "{text}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "{:?}",
        start.elapsed()
    );
}
