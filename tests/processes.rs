//! `moe train` with one process per rank against the same job on threads and on one rank:
//! equal losses, gradient norms and saved parameters; saving under 4 processes and resuming
//! under 2 with another layout; `kill -9` of one process mid-step and mid-save.
//!
//! - TCP processes, started as torchrun starts them (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `MASTER_ADDR`, `MASTER_PORT`), always run.
//! - MPI processes (`mpirun -np N moe train …`) need OpenMPI (installed by `.ci/run`) and a
//!   build with `--features mpi`: `cargo test --features mpi --test processes`.

mod common;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use std::collections::BTreeMap;

use burn_moe::backend::parallel::ParallelLayout;
use burn_moe::bridge::dist::DistCheckpoint;
use burn_moe::models::hf::ModelConfig;
use common::*;

/// How the processes of a job are started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Launcher {
    /// As torchrun starts them: one `moe` per rank with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    /// `MASTER_ADDR`, `MASTER_PORT` (TCP transport).
    Torchrun,
    /// `mpirun -np N moe …` (MPI transport).
    #[cfg(feature = "mpi")]
    Mpirun,
}

/// A running multi-process job: its processes (one `mpirun` for MPI).
struct Job {
    children: Vec<Child>,
    what: String,
}

/// A fresh directory for one `mpirun`'s OpenMPI session files (`orte_tmpdir_base`).
#[cfg(feature = "mpi")]
fn ompi_session_dir(tag: &str) -> std::path::PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("moe-ompi-{tag}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("OpenMPI session dir");
    dir
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

fn spawn(launcher: Launcher, n: usize, args: &[String], tag: &str) -> Job {
    let what = format!("{launcher:?} -np {n} moe {}", args.join(" "));
    let children = match launcher {
        Launcher::Torchrun => {
            let port = free_port().to_string();
            (0..n)
                .map(|rank| {
                    Command::new(MOE)
                        .args(args)
                        .env("RANK", rank.to_string())
                        .env("WORLD_SIZE", n.to_string())
                        .env("LOCAL_RANK", rank.to_string())
                        .env("MASTER_ADDR", "127.0.0.1")
                        .env("MASTER_PORT", &port)
                        .env("MOE_TEST_TAG", tag)
                        .stdout(Stdio::piped())
                        .stderr(Stdio::piped())
                        .spawn()
                        .expect("moe")
                })
                .collect()
        }
        #[cfg(feature = "mpi")]
        Launcher::Mpirun => vec![
            Command::new("mpirun")
                .args(["--allow-run-as-root", "--oversubscribe", "-np"])
                .arg(n.to_string())
                .arg(MOE)
                .args(args)
                .env("MOE_TEST_TAG", tag)
                // A session directory of its own: `mpirun`s started at the same moment race
                // creating OpenMPI's shared `/tmp/ompi.<host>.<uid>` and one aborts.
                .env("OMPI_MCA_orte_tmpdir_base", ompi_session_dir(tag))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("mpirun (openmpi-bin)"),
        ],
    };
    Job { children, what }
}

impl Job {
    /// Waits for every process (killing all after `limit`); their outputs, stdout and stderr
    /// joined.
    fn wait(self, limit: Duration) -> Vec<(bool, String)> {
        let start = Instant::now();
        let mut children = self.children;
        while children
            .iter_mut()
            .any(|c| c.try_wait().ok().flatten().is_none())
        {
            if start.elapsed() > limit {
                for c in &mut children {
                    let _ = c.kill();
                }
                let text: Vec<String> = children
                    .into_iter()
                    .filter_map(|c| c.wait_with_output().ok())
                    .map(|o| text(&o))
                    .collect();
                panic!(
                    "{} still running after {limit:?}:\n{}",
                    self.what,
                    text.join("\n")
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        children
            .into_iter()
            .map(|c| {
                let out = c.wait_with_output().expect("output");
                (out.status.success(), text(&out))
            })
            .collect()
    }

    /// Waits and checks that every process succeeded.
    fn succeed(self) {
        let what = self.what.clone();
        for (ok, text) in self.wait(Duration::from_secs(300)) {
            assert!(ok, "{what} failed:\n{text}");
        }
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn processes(launcher: Launcher, n: usize, args: &[String]) {
    spawn(launcher, n, args, "run").succeed();
}

/// The same job as `n` processes, as threads and as one rank, with the training defaults
/// (router load-balancing loss and z-loss on). The global batch of 4 sequences is split over
/// the data-parallel replicas; the one-rank reference runs the same micro-batches one after
/// the other (`--mbs 4/dp`), so its objective is the same.
fn equal_threads_and_one_rank(launcher: Launcher, cases: &[(&str, &str)]) {
    let losses = ["--z-loss-coeff", "1e-3", "--adam-eps", ADAM_EPS];
    let mut references = BTreeMap::new();
    for (layout, dispatcher) in cases {
        let dp = ParallelLayout::parse_spec(layout).expect("layout").dp;
        let mbs = (4 / dp).to_string();
        let (one_metrics, one_params) = references.entry(dp).or_insert_with(|| {
            let one = scratch("one");
            let mut extra = losses.to_vec();
            extra.extend(["--mbs", &mbs]);
            threads(&train_args(&one, "", STEPS, &extra));
            let reference = (metrics(&one), params(&one));
            let _ = std::fs::remove_dir_all(one);
            reference
        });
        assert_eq!(one_metrics.len(), STEPS);
        let what = format!("{launcher:?} {layout} {dispatcher}");
        let mut extra = losses.to_vec();
        extra.extend(["--dispatcher", dispatcher]);
        let (t, p) = (scratch("threads"), scratch("procs"));
        threads(&train_args(&t, layout, STEPS, &extra));
        processes(launcher, 4, &train_args(&p, layout, STEPS, &extra));
        // Processes and threads: bit for bit.
        assert_metrics_equal(&metrics(&p), &metrics(&t), &format!("{what}: vs threads"));
        let (tp, pp) = (params(&t), params(&p));
        assert_eq!(pp, tp, "{what}: parameters after {STEPS} steps vs threads");
        // Both against one rank, within the parallel-equivalence tolerance.
        assert_metrics_close(&metrics(&p), one_metrics, &format!("{what}: vs world=1"));
        assert_params_close(&pp, one_params, &format!("{what}: vs world=1"));
        for d in [t, p] {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    // With Adam's default ε, processes still equal threads exactly.
    let (t, p) = (scratch("eps-threads"), scratch("eps-procs"));
    threads(&train_args(&t, "tp=2,ep=4", 3, &[]));
    processes(launcher, 4, &train_args(&p, "tp=2,ep=4", 3, &[]));
    assert_metrics_equal(&metrics(&p), &metrics(&t), "default eps: vs threads");
    assert_eq!(params(&p), params(&t), "default eps: vs threads");
    for d in [t, p] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn tcp_processes_equal_threads_and_one_rank() {
    equal_threads_and_one_rank(
        Launcher::Torchrun,
        &[
            ("tp=2,ep=4", "all-to-all"),
            ("tp=2,ep=2,etp=2", "flex"),
            // Two pipeline stages (1 + 2 layers) × two replicas.
            ("world=4,pp=2,ep=2,pp_layout=Et|ttL", "all-to-all"),
        ],
    );
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_processes_equal_threads_and_one_rank() {
    equal_threads_and_one_rank(
        Launcher::Mpirun,
        &[
            ("tp=2,ep=4", "all-to-all"),
            ("world=4,ep=2,etp=2", "all-to-all"),
            ("tp=2,ep=2,etp=2", "all-gather"),
            ("tp=2,ep=2,etp=2", "flex"),
            ("world=4,pp=2,ep=2,pp_layout=Et|ttL", "all-to-all"),
        ],
    );
}

/// 16 oversubscribed processes (attention TP2 × DP8, experts EP8 × ETP2) equal 16 threads bit
/// for bit.
fn sixteen_processes(launcher: Launcher) {
    let layout = "world=16,tp=2,ep=8,etp=2";
    let extra = ["--gbs", "8"];
    let (t, p) = (scratch("16-threads"), scratch("16-procs"));
    threads(&train_args(&t, layout, 3, &extra));
    processes(launcher, 16, &train_args(&p, layout, 3, &extra));
    assert_metrics_equal(&metrics(&p), &metrics(&t), "16 processes vs threads");
    assert_eq!(params(&p), params(&t), "16 processes vs threads");
    for d in [t, p] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn tcp_sixteen_processes_equal_threads() {
    sixteen_processes(Launcher::Torchrun);
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_sixteen_processes_equal_threads() {
    sixteen_processes(Launcher::Mpirun);
}

/// 3 steps as 4 processes (attention TP2 × DP2, experts EP4), then steps 4-6 as 2 processes
/// (EP2 × DP2) from that checkpoint, against 6 uninterrupted steps under the second layout.
fn resume_under_two(launcher: Launcher) {
    // Both layouts have two data-parallel replicas: the same micro-batches, the same router
    // losses.
    let extra = ["--adam-eps", ADAM_EPS];
    let run = scratch("resume");
    processes(launcher, 4, &train_args(&run, "tp=2,ep=4", 3, &extra));
    let mut resumed = train_args(&run, "ep=2", 6, &extra);
    resumed.push("--resume".into());
    processes(launcher, 2, &resumed);
    let straight = scratch("straight");
    threads(&train_args(&straight, "ep=2", 6, &extra));
    let (got, want) = (metrics(&run), metrics(&straight));
    assert_eq!(got.len(), 6, "3 + 3 steps of metrics");
    assert_metrics_close(&got[3..], &want[3..], "resumed steps 4-6");
    assert_params_close(&params(&run), &params(&straight), "after 6 steps");
    for d in [run, straight] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn tcp_save_under_four_processes_resume_under_two_with_another_layout() {
    resume_under_two(Launcher::Torchrun);
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_save_under_four_processes_resume_under_two_with_another_layout() {
    resume_under_two(Launcher::Mpirun);
}

/// The pid of rank `rank` of the job tagged `tag` (from the processes' environments).
fn rank_pid(launcher: Launcher, tag: &str, rank: usize) -> Option<i32> {
    let want_tag = format!("MOE_TEST_TAG={tag}");
    let want_rank = match launcher {
        Launcher::Torchrun => format!("RANK={rank}"),
        #[cfg(feature = "mpi")]
        Launcher::Mpirun => format!("OMPI_COMM_WORLD_RANK={rank}"),
    };
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let vars: Vec<&[u8]> = env.split(|&b| b == 0).collect();
        let has = |s: &str| vars.contains(&s.as_bytes());
        if has(&want_tag) && has(&want_rank) {
            return Some(pid);
        }
    }
    None
}

fn kill_9(pid: i32) {
    let status = Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

fn wait_until(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < limit {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

/// Kills rank 2 with SIGKILL once training is under way: the job ends within 30 s (far
/// below the 300 s collective timeout) with an error naming rank 2. With TCP every
/// surviving process exits with that error itself; with MPI the launcher ends the job.
fn kill_mid_step(launcher: Launcher) {
    let dir = scratch("kill-step");
    let tag = format!("step-{launcher:?}-{}", std::process::id());
    let job = spawn(
        launcher,
        4,
        &train_args(&dir, "tp=2,ep=4", 100_000, &[]),
        &tag,
    );
    let started = wait_until(Duration::from_secs(120), || {
        std::fs::read_to_string(dir.join("metrics.jsonl")).is_ok_and(|m| m.lines().count() >= 2)
    });
    assert!(started, "training did not start");
    let pid = rank_pid(launcher, &tag, 2).expect("rank 2's pid");
    let killed = Instant::now();
    kill_9(pid);
    let outputs = job.wait(Duration::from_secs(60));
    let took = killed.elapsed();
    assert!(took < Duration::from_secs(30), "took {took:?}");
    let all: String = outputs.iter().map(|(_, t)| t.as_str()).collect();
    assert!(
        outputs.iter().all(|(ok, _)| !ok),
        "the job must fail:\n{all}"
    );
    match launcher {
        Launcher::Torchrun => {
            for (rank, (_, text)) in outputs.iter().enumerate().filter(|(r, _)| *r != 2) {
                assert!(
                    text.contains("rank 2"),
                    "surviving rank {rank} names the lost rank 2:\n{text}"
                );
            }
        }
        #[cfg(feature = "mpi")]
        Launcher::Mpirun => assert!(all.contains("rank 2"), "the lost rank is named:\n{all}"),
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tcp_kill_9_mid_step_fails_every_other_process_naming_the_rank() {
    kill_mid_step(Launcher::Torchrun);
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_kill_9_mid_step_ends_the_job_naming_the_rank() {
    kill_mid_step(Launcher::Mpirun);
}

/// Kills rank 2 while a checkpoint is being saved (its temporary directory exists): the
/// latest checkpoint is still the previous, complete one, and it loads and validates.
fn kill_mid_save(launcher: Launcher) {
    let dir = scratch("kill-save");
    let root = dir.join("ckpt");
    let tag = format!("save-{launcher:?}-{}", std::process::id());
    let mut args = train_args(&dir, "tp=2,ep=4", 100_000, &[]);
    args.extend(["--save-every".into(), "1".into()]);
    let job = spawn(launcher, 4, &args, &tag);
    let committed = wait_until(Duration::from_secs(120), || root.join("latest").is_file());
    assert!(committed, "no checkpoint was committed");
    let pid = rank_pid(launcher, &tag, 2).expect("rank 2's pid");
    // The next save: its temporary directory exists from rank 0's creation until the commit
    // renames it.
    let mid_save = wait_until(Duration::from_secs(60), || {
        std::fs::read_dir(&root).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        })
    });
    assert!(mid_save, "no save in progress was seen");
    kill_9(pid);
    let outputs = job.wait(Duration::from_secs(60));
    assert!(outputs.iter().all(|(ok, _)| !ok), "the job must fail");
    let ckpt = DistCheckpoint::open::<ModelConfig>(&root).expect("the previous checkpoint opens");
    ckpt.validate::<ModelConfig>().expect("and validates");
    assert!(ckpt.dir().join(".complete").is_file());
    let status = Command::new(MOE)
        .args(["validate", &root.display().to_string()])
        .output()
        .expect("moe validate");
    check(status, "moe validate");
    // A new run resuming there removes the killed save's temporary directory.
    let step = DistCheckpoint::open::<ModelConfig>(&root)
        .expect("checkpoint")
        .index()
        .step as usize;
    let mut resume = train_args(&dir, "tp=2,ep=4", step + 1, &[]);
    resume.push("--resume".into());
    threads(&resume);
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .expect("root")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .map(|e| e.path())
        .collect();
    assert!(leftovers.is_empty(), "left behind: {leftovers:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn tcp_kill_9_mid_save_keeps_the_previous_checkpoint() {
    kill_mid_save(Launcher::Torchrun);
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_kill_9_mid_save_keeps_the_previous_checkpoint() {
    kill_mid_save(Launcher::Mpirun);
}

/// SIGTERM to rank 2 alone once training is under way (as a scheduler's preemption reaches
/// one task first): every process finishes the same step, the job saves a checkpoint at that
/// step and every process exits 0 with the message; `--resume` then continues to the end with
/// metrics equal to an uninterrupted run (bit for bit: the same transport's arithmetic).
fn sigterm_mid_run(launcher: Launcher) {
    let steps = 12;
    let dir = scratch("sigterm");
    let root = dir.join("ckpt");
    let tag = format!("sigterm-{launcher:?}-{}", std::process::id());
    let args = train_args(&dir, "tp=2,ep=4", steps, &[]);
    let job = spawn(launcher, 4, &args, &tag);
    let started = wait_until(Duration::from_secs(120), || {
        std::fs::read_to_string(dir.join("metrics.jsonl")).is_ok_and(|m| m.lines().count() >= 2)
    });
    assert!(started, "training did not start");
    let pid = rank_pid(launcher, &tag, 2).expect("rank 2's pid");
    let sent = Instant::now();
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let outputs = job.wait(Duration::from_secs(120));
    let all: String = outputs.iter().map(|(_, t)| t.as_str()).collect();
    assert!(
        outputs.iter().all(|(ok, _)| *ok),
        "every process exits 0:\n{all}"
    );
    assert!(!all.contains("panicked"), "{all}");
    assert!(all.contains("stopped after step"), "the message:\n{all}");
    let ckpt = DistCheckpoint::open::<ModelConfig>(&root).expect("the checkpoint opens");
    ckpt.validate::<ModelConfig>().expect("and validates");
    let reached = metrics(&dir).len();
    assert_eq!(
        ckpt.index().step as usize,
        reached,
        "saved at the step reached"
    );
    assert!(
        reached < steps,
        "stopped early ({reached} of {steps} steps)"
    );
    assert!(
        sent.elapsed() < Duration::from_secs(60),
        "within a step plus the save"
    );
    // Resume to the end and compare with the uninterrupted run.
    let mut resume = args.clone();
    resume.push("--resume".into());
    processes(launcher, 4, &resume);
    let straight = scratch("sigterm-straight");
    processes(launcher, 4, &train_args(&straight, "tp=2,ep=4", steps, &[]));
    assert_metrics_equal(
        &metrics(&dir),
        &metrics(&straight),
        "interrupted + resumed vs uninterrupted",
    );
    assert_eq!(params(&dir), params(&straight), "parameters at the end");
    for d in [dir, straight] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn tcp_sigterm_to_one_process_saves_and_exits_every_process_cleanly() {
    sigterm_mid_run(Launcher::Torchrun);
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_sigterm_to_one_process_saves_and_exits_every_process_cleanly() {
    sigterm_mid_run(Launcher::Mpirun);
}
