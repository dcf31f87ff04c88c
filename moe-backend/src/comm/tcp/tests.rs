//! TCP worlds on threads of this process over 127.0.0.1: collectives equal the in-process
//! world's bit for bit, and failures (a vanished rank, a failing rank, a silent rank, a bad
//! rendezvous) end the other ranks' waits promptly with errors naming the rank.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::panic::Location;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use burn::tensor::TensorData;

use super::{Hello, TcpConfig, TcpWorld, accept_higher, decode_ack, recv_message, send_message};
use crate::comm::launch::Launch;
use crate::comm::p2p::tests::script;
use crate::comm::{RankCtx, ReduceOp, World};
use crate::error::{BackendError, Result};
use crate::parallel::{GroupFamily, ParallelLayout};

fn launch(rank: usize, size: usize, port: u16) -> Launch {
    Launch {
        rank,
        world_size: size,
        local_rank: rank,
        local_world_size: None,
        master_addr: Some("127.0.0.1".into()),
        master_port: Some(port),
        launcher: "test",
    }
}

fn config(timeout: Duration, connect_timeout: Duration) -> TcpConfig {
    TcpConfig {
        timeout,
        connect_timeout,
    }
}

/// Runs `f(rank, world)` on one thread per rank; `sizes[r]` is the world size rank `r` is
/// started with. Rank 0 listens on a fresh loopback port, which the others are given.
fn spawn_ranks<T: Send>(
    sizes: &[usize],
    config: TcpConfig,
    f: impl Fn(usize, Result<TcpWorld>) -> T + Sync,
) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut master = Some(listener);
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(rank, &size)| {
                let master = if rank == 0 { master.take() } else { None };
                let config = config.clone();
                s.spawn(move || {
                    f(
                        rank,
                        TcpWorld::init_with(&launch(rank, size, port), config, master),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn all_reduce_world(ctx: &RankCtx) -> Result<TensorData> {
    let world = ctx.world()?;
    world.communicator().all_reduce(
        TensorData::new(vec![ctx.rank() as f32; 3], [3]),
        ReduceOp::Sum,
        Location::caller(),
    )
}

/// The script of the p2p tests on the world, then an all-reduce on every group family of a
/// layout of the world.
fn collectives(ctx: &RankCtx) -> Result<Vec<Vec<u8>>> {
    let mut out = script(ctx.world()?.communicator().as_ref());
    let spec = match ctx.world_size() {
        4 => "tp=2,ep=4",
        2 => "tp=2",
        _ => "tp=1",
    };
    let layout = ParallelLayout::parse(ctx.world_size(), spec)?;
    let groups = ctx.process_groups(&layout)?;
    for (k, family) in GroupFamily::ALL.into_iter().enumerate() {
        let d = TensorData::new(vec![ctx.rank() as f32 + 0.25, k as f32, 1.5], [3]);
        let r =
            groups
                .comm(family)
                .communicator()
                .all_reduce(d, ReduceOp::Sum, Location::caller())?;
        out.push(r.as_bytes().to_vec());
    }
    Ok(out)
}

#[test]
fn collectives_over_tcp_equal_the_in_process_world_bit_for_bit() {
    for n in [1usize, 2, 4] {
        let tcp = spawn_ranks(
            &vec![n; n],
            config(Duration::from_secs(30), Duration::from_secs(10)),
            |_, world| {
                let world = world.unwrap();
                // Twice on one world: a run leaves the connections usable.
                let first = world.run(collectives).unwrap();
                let second = world.run(collectives).unwrap();
                assert_eq!(first, second);
                first
            },
        );
        let local: Vec<Vec<Vec<u8>>> = World::run(n, collectives)
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert_eq!(tcp.len(), n);
        for (rank, (a, b)) in tcp.iter().zip(&local).enumerate() {
            assert_eq!(a.len(), b.len());
            for (k, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(x == y, "world {n} rank {rank} output {k} differs");
            }
        }
    }
}

#[test]
fn a_vanished_rank_fails_the_others_promptly() {
    let out = spawn_ranks(
        &[3, 3, 3],
        config(Duration::from_secs(30), Duration::from_secs(10)),
        |rank, world| {
            let world = world.unwrap();
            if rank == 2 {
                // Killed while the others wait for it: its sockets end without a bye.
                std::thread::sleep(Duration::from_millis(300));
                world.sever();
                return None;
            }
            let start = Instant::now();
            let result = world.run(|ctx| {
                // A collective without rank 2 works; the world one waits for rank 2.
                let pair = ctx.group("pair", &[0, 1])?;
                pair.communicator().all_reduce(
                    TensorData::new(vec![1.0f32], [1]),
                    ReduceOp::Sum,
                    Location::caller(),
                )?;
                all_reduce_world(ctx)
            });
            let after = world.run(|ctx| ctx.group("pair", &[0, 1])?.barrier());
            Some((result, after, start.elapsed()))
        },
    );
    for (rank, o) in out.into_iter().enumerate().take(2) {
        let (result, after, elapsed) = o.unwrap();
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains("rank 2 closed its connection (process gone?)"),
            "rank {rank}: {err}"
        );
        assert!(
            elapsed < Duration::from_millis(2300),
            "rank {rank}: {elapsed:?}"
        );
        // The world stays failed, also for groups without rank 2.
        let err = after.unwrap_err().to_string();
        assert!(
            err.contains("rank 2 closed its connection"),
            "rank {rank}: {err}"
        );
    }
}

#[test]
fn a_rank_that_leaves_early_is_named() {
    let out = spawn_ranks(
        &[3, 3, 3],
        config(Duration::from_secs(30), Duration::from_secs(10)),
        |rank, world| {
            let world = world.unwrap();
            if rank == 2 {
                // Returns without joining the collective: its world closes normally.
                drop(world);
                return None;
            }
            let start = Instant::now();
            let result = world.run(|ctx| {
                std::thread::sleep(Duration::from_millis(200));
                all_reduce_world(ctx)
            });
            Some((result, start.elapsed()))
        },
    );
    for (rank, o) in out.into_iter().enumerate().take(2) {
        let (result, elapsed) = o.unwrap();
        let err = result.unwrap_err().to_string();
        assert!(
            err.contains("rank 2 has left the job"),
            "rank {rank}: {err}"
        );
        assert!(
            elapsed < Duration::from_millis(2300),
            "rank {rank}: {elapsed:?}"
        );
    }
}

#[test]
fn a_failing_rank_sends_its_error_to_the_others() {
    for panics in [false, true] {
        let out = spawn_ranks(
            &[3, 3, 3],
            config(Duration::from_secs(30), Duration::from_secs(10)),
            |rank, world| {
                let world = world.unwrap();
                let start = Instant::now();
                let result = world.run(|ctx| {
                    if rank == 1 {
                        std::thread::sleep(Duration::from_millis(200));
                        if panics {
                            panic!("kaboom");
                        }
                        return Err(BackendError::Config {
                            field: "test",
                            detail: "boom".into(),
                        });
                    }
                    all_reduce_world(ctx)
                });
                (result, start.elapsed())
            },
        );
        for (rank, (result, elapsed)) in out.into_iter().enumerate() {
            let err = result.unwrap_err();
            let text = err.to_string();
            if rank == 1 {
                if panics {
                    assert!(
                        matches!(&err, BackendError::RankPanicked { rank: 1, message } if message == "kaboom"),
                        "{err:?}"
                    );
                } else {
                    assert!(matches!(err, BackendError::Config { .. }), "{err:?}");
                }
                continue;
            }
            let expected = if panics {
                "rank 1 failed: rank 1 panicked: kaboom"
            } else {
                "rank 1 failed: invalid config field `test`: boom"
            };
            assert!(text.contains(expected), "rank {rank}: {text}");
            assert!(
                elapsed < Duration::from_millis(2300),
                "rank {rank}: {elapsed:?}"
            );
        }
    }
}

#[test]
fn a_silent_rank_is_named_by_the_timeout() {
    let out = spawn_ranks(
        &[2, 2],
        config(Duration::from_millis(300), Duration::from_secs(10)),
        |rank, world| {
            let world = world.unwrap();
            if rank == 1 {
                std::thread::sleep(Duration::from_millis(600));
                return None;
            }
            Some(world.run(all_reduce_world))
        },
    );
    match &out[0] {
        Some(Err(BackendError::Timeout { waiting, .. })) => assert_eq!(waiting, &vec![1]),
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
}

#[test]
fn a_rank_started_for_another_world_size_is_refused() {
    let start = Instant::now();
    let out = spawn_ranks(
        &[2, 3],
        config(Duration::from_secs(5), Duration::from_secs(5)),
        |_, world| world.map(|_| ()).unwrap_err().to_string(),
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    assert!(
        out[0].contains("rank 1") && out[0].contains("world of 3"),
        "{}",
        out[0]
    );
    assert!(
        out[1].contains("rank 0 refused the rendezvous") && out[1].contains("world of 3"),
        "{}",
        out[1]
    );
}

#[test]
fn rendezvous_failures_are_errors_not_hangs() {
    let quick = config(Duration::from_secs(5), Duration::from_millis(300));
    // Rank 1 never comes: rank 0 names it.
    let start = Instant::now();
    let out = spawn_ranks(&[2], quick.clone(), |_, world| world.map(|_| ()));
    match &out[0] {
        Err(BackendError::Timeout { waiting, .. }) => assert_eq!(waiting, &vec![1]),
        other => panic!("expected a rendezvous timeout naming rank 1, got {other:?}"),
    }
    // Nobody listens at the master's address: rank 1 names it.
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = TcpWorld::init(&launch(1, 2, port), quick.clone())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("rank 1 could not reach the master (rank 0)")
            && err.contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
    // No rendezvous address.
    let mut no_master = launch(1, 2, port);
    no_master.master_addr = None;
    let err = TcpWorld::init(&no_master, quick).unwrap_err().to_string();
    assert!(err.contains("MASTER_ADDR"), "{err}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn strays_are_ignored_and_bad_hellos_refused() {
    // A stray connection to the master sends garbage before the ranks register.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut stray = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stray.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    let cfg = config(Duration::from_secs(5), Duration::from_secs(5));
    let mut master = Some(listener);
    let out: Vec<Result<TensorData>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let master = if rank == 0 { master.take() } else { None };
                let cfg = cfg.clone();
                s.spawn(move || {
                    TcpWorld::init_with(&launch(rank, 2, port), cfg, master)?.run(all_reduce_world)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in out {
        assert_eq!(r.unwrap().as_slice::<f32>().unwrap(), &[1.0; 3]);
    }
    drop(stray);

    // Mesh hellos: another job's token is refused and ignored; a peer of this job claiming
    // another world size is an error.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let token = 42;
    let hello = |token: u64, world: u64| {
        let mut s = TcpStream::connect(addr).unwrap();
        let h = Hello {
            token,
            world,
            from: 1,
            to: 0,
        };
        send_message(&mut s, &h.encode()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let ack = decode_ack(&recv_message(&mut s).unwrap()).unwrap();
        ack.2.unwrap_or_default()
    };
    let cancel = AtomicBool::new(false);
    let deadline = Instant::now() + Duration::from_secs(5);
    let (accepted, refusals) = std::thread::scope(|s| {
        let acceptor = s.spawn(|| accept_higher(&listener, 0, 2, token, (deadline, 5.0), &cancel));
        let refusals = [hello(7, 2), hello(token, 3)];
        (acceptor.join().unwrap(), refusals)
    });
    assert_eq!(refusals[0], "wrong job token");
    assert!(
        refusals[1].contains("claims rank 1 of a world of 3"),
        "{}",
        refusals[1]
    );
    let err = accepted.unwrap_err().to_string();
    assert!(err.contains("claims rank 1 of a world of 3"), "{err}");
}

/// One rank process of [`processes_finish_normally_and_survive_kill_9`] (does nothing when run
/// on its own).
#[test]
#[ignore = "a rank process started by processes_finish_normally_and_survive_kill_9"]
fn rank_process() {
    let Ok(mode) = std::env::var("MOE_TCP_TEST_MODE") else {
        return;
    };
    let launch = Launch::from_env().unwrap().unwrap();
    let world = TcpWorld::init(
        &launch,
        config(Duration::from_secs(30), Duration::from_secs(10)),
    )
    .unwrap();
    let rank = world.rank();
    let result = world.run(|ctx| {
        let first = all_reduce_world(ctx)?;
        if mode == "kill" && rank == 2 {
            println!("TCPCHILD READY");
            std::io::stdout().flush().unwrap();
            std::thread::sleep(Duration::from_secs(60));
        }
        let second = all_reduce_world(ctx)?;
        Ok((
            first.as_slice::<f32>().unwrap().to_vec(),
            second.as_slice::<f32>().unwrap().to_vec(),
        ))
    });
    match result {
        Ok(v) => println!("TCPCHILD OK {v:?}"),
        Err(e) => println!("TCPCHILD ERR {e}"),
    }
    std::io::stdout().flush().unwrap();
}

/// Three processes of this test binary, launched as torchrun would (`RANK`, `WORLD_SIZE`,
/// `MASTER_ADDR`, `MASTER_PORT`): they finish normally; then again, with rank 2 killed
/// (`SIGKILL`) while the others wait in a collective, which fail promptly naming it.
#[test]
fn processes_finish_normally_and_survive_kill_9() {
    use std::collections::HashMap;
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::sync::mpsc;

    let exe = std::env::current_exe().unwrap();
    for mode in ["normal", "kill"] {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut children: Vec<_> = (0..3)
            .map(|rank| {
                Command::new(&exe)
                    .args([
                        "comm::tcp::tests::rank_process",
                        "--exact",
                        "--ignored",
                        "--nocapture",
                        "--test-threads=1",
                    ])
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", "3")
                    .env("LOCAL_RANK", rank.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string())
                    .env("MOE_TCP_TEST_MODE", mode)
                    .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                    .stdout(Stdio::piped())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let (tx, rx) = mpsc::channel();
        for (rank, child) in children.iter_mut().enumerate() {
            let out = child.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(out).lines().map_while(std::io::Result::ok) {
                    // libtest prints the test name on the same line.
                    if let Some(at) = line.find("TCPCHILD ") {
                        let _ = tx.send((rank, line[at + 9..].to_string()));
                    }
                }
            });
        }
        drop(tx);
        let expected = if mode == "kill" { 2 } else { 3 };
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut results = HashMap::new();
        let mut killed_at = None;
        while results.len() < expected {
            let Ok((rank, line)) =
                rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            else {
                break;
            };
            if line == "READY" {
                children[rank].kill().unwrap();
                killed_at = Some(Instant::now());
            } else {
                results.insert(rank, (line, Instant::now()));
            }
        }
        for c in &mut children {
            let _ = c.kill();
            let _ = c.wait();
        }
        assert_eq!(results.len(), expected, "{mode}: {results:?}");
        for (rank, (line, at)) in &results {
            if mode == "normal" {
                assert!(line.starts_with("OK"), "rank {rank}: {line}");
                assert!(line.contains("[3.0, 3.0, 3.0]"), "rank {rank}: {line}");
            } else {
                assert!(
                    line.contains("rank 2 closed its connection (process gone?)"),
                    "rank {rank}: {line}"
                );
                let after = at.duration_since(killed_at.unwrap());
                assert!(after < Duration::from_secs(2), "rank {rank}: {after:?}");
            }
        }
    }
}

#[test]
fn device_buffer_collectives_over_tcp_equal_the_host_path() {
    for n in [2usize, 3, 4] {
        let checks = spawn_ranks(
            &vec![n; n],
            config(Duration::from_secs(30), Duration::from_secs(10)),
            |_, world| {
                world
                    .unwrap()
                    .run(|ctx| crate::comm::tests::device::compare_paths(ctx, 90 + n as u64))
                    .unwrap()
            },
        );
        assert!(
            checks.iter().all(|&c| c == checks[0] && c > 40),
            "{checks:?}"
        );
    }
}

#[test]
fn a_vanished_peer_fails_device_buffer_collectives_over_tcp() {
    use crate::comm::ReduceOp;
    use burn::tensor::{DType, Device};
    let out = spawn_ranks(
        &[3, 3, 3],
        config(Duration::from_secs(30), Duration::from_secs(10)),
        |rank, world| {
            let world = world.unwrap();
            if rank == 2 {
                std::thread::sleep(Duration::from_millis(300));
                world.sever();
                return None;
            }
            let start = Instant::now();
            let result = world.run(|ctx| {
                let comm = ctx.world()?;
                let x = crate::testing::tensor(vec![1.0; 6], [3, 2], &Device::flex(), DType::BF16);
                let y = comm.all_to_all_v(x, &[1, 1, 1], &[1, 1, 1])?;
                assert_eq!(comm.host_transfers(), 0);
                comm.all_reduce(y, ReduceOp::Sum).map(|_| ())
            });
            Some((result, start.elapsed()))
        },
    );
    for (rank, o) in out.into_iter().enumerate().take(2) {
        let (result, elapsed) = o.unwrap();
        let err = result.unwrap_err();
        assert!(
            matches!(
                err,
                BackendError::Collective { .. } | BackendError::Aborted { .. }
            ),
            "rank {rank}: {err:?}"
        );
        assert!(
            err.to_string().contains("rank 2 closed its connection"),
            "rank {rank}: {err}"
        );
        assert!(
            elapsed < Duration::from_millis(2300),
            "rank {rank}: {elapsed:?}"
        );
    }
}

/// The pipeline's batched exchange over TCP: a ring of `send_recv` batches on Flex tensors
/// (the device-buffer path) delivers each message as sent; when rank 2's stage fails
/// mid-way, ranks 0 and 1 get the transport's typed error naming it within a fraction of
/// the timeout, never a hang.
#[test]
fn batched_exchanges_over_tcp_deliver_and_fail_promptly_on_a_vanished_peer() {
    use burn::tensor::{DType, Device};
    let message = |src: usize, step: usize| {
        let values: Vec<f64> = (0..6).map(|i| (src * 100 + step * 10 + i) as f64).collect();
        crate::testing::tensor(values, [3, 2], &Device::flex(), DType::F32)
    };
    let out = spawn_ranks(
        &[3, 3, 3],
        config(Duration::from_secs(30), Duration::from_secs(10)),
        |_, world| {
            let world = world.unwrap();
            let start = Instant::now();
            let result = world.run(|ctx| {
                let comm = ctx.group("pp_p2p", &[0, 1, 2])?;
                let (next, prev) = ((ctx.rank() + 1) % 3, (ctx.rank() + 2) % 3);
                let mut delivered = 0;
                for step in 0..50 {
                    if ctx.rank() == 2 && step == 3 {
                        // The stage fails mid-schedule.
                        return Err(BackendError::Config {
                            field: "test",
                            detail: format!("stage died after {delivered} exchanges"),
                        });
                    }
                    let got = comm.send_recv(
                        vec![(message(ctx.rank(), step), next)],
                        &[([3, 2], DType::F32, prev)],
                        &Device::flex(),
                    )?;
                    let got = got.into_iter().next().expect("one message");
                    assert_eq!(got.into_data(), message(prev, step).into_data());
                    assert_eq!(comm.host_transfers(), 0);
                    delivered += 1;
                    if step == 2 {
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
                Ok(delivered)
            });
            (result, start.elapsed())
        },
    );
    let two = out[2].0.as_ref().expect_err("rank 2 failed").to_string();
    assert!(two.contains("stage died after 3 exchanges"), "{two}");
    for (rank, (result, elapsed)) in out.iter().enumerate().take(2) {
        let err = result.as_ref().expect_err("rank 2 is gone").to_string();
        assert!(
            err.contains("rank 2 failed: invalid config field `test`: stage died"),
            "rank {rank}: {err}"
        );
        assert!(
            *elapsed < Duration::from_secs(5),
            "rank {rank}: {elapsed:?}"
        );
    }
}
