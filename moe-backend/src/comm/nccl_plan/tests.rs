//! The plans against the threads transport: a model of NCCL's semantics (collectives matched
//! in issue order on every member with the same root and size, grouped sends matched with
//! the peer's receives in order) executes every member's plan on host bytes, and the outputs
//! must equal the in-process world's results bit for bit (the model reduces in member order,
//! as the world does; NCCL's own order is a GPU matter, `nccl::device`'s GPU test).

use burn::tensor::{DType, TensorData};

use super::*;
use crate::comm::data::reduce_blocks;
use crate::comm::{Communicator, World};

/// The bytes every member's output holds before the plan runs: a byte the plan forgets to
/// write shows up as a mismatch.
const POISON: u8 = 0xab;

/// One member's part: its input bytes, its plan, the dtype and reduction of the collective.
struct Part {
    input: Vec<u8>,
    plan: Plan,
}

fn collective(call: &Call) -> bool {
    !matches!(
        call,
        Call::Send { .. } | Call::Recv { .. } | Call::Copy { .. }
    )
}

/// Runs every member's plan under NCCL's matching rules; returns each member's output.
fn execute(parts: &[Part], elem: usize, reduce: Option<ReduceOp>, dtype: DType) -> Vec<Vec<u8>> {
    let n = parts.len();
    let colls: Vec<Vec<&Call>> = parts
        .iter()
        .map(|p| p.plan.calls.iter().filter(|c| collective(c)).collect())
        .collect();
    for (j, c) in colls.iter().enumerate() {
        assert_eq!(
            c.len(),
            colls[0].len(),
            "member {j} issues another number of collectives"
        );
    }
    let red = |op: &'static str, blocks: Vec<&[u8]>| -> Vec<u8> {
        reduce_blocks(op, "sim", &blocks, dtype, reduce.expect("a reduction")).unwrap()
    };
    (0..n)
        .map(|me| {
            let out_len = parts[me].plan.out_shape.iter().product::<usize>() * elem;
            let mut out = vec![POISON; out_len];
            for (k, call) in colls[me].iter().enumerate() {
                let others: Vec<&Call> = colls.iter().map(|c| c[k]).collect();
                match **call {
                    Call::AllReduce { bytes } => {
                        for o in &others {
                            assert_eq!(**o, Call::AllReduce { bytes });
                        }
                        let blocks = parts.iter().map(|p| &p.input[..bytes]).collect();
                        out[..bytes].copy_from_slice(&red("all_reduce", blocks));
                    }
                    Call::ReduceScatter { bytes } => {
                        for o in &others {
                            assert_eq!(**o, Call::ReduceScatter { bytes });
                        }
                        let at = me * bytes;
                        let blocks = parts.iter().map(|p| &p.input[at..at + bytes]).collect();
                        out[..bytes].copy_from_slice(&red("reduce_scatter", blocks));
                    }
                    Call::Reduce {
                        root, dst, bytes, ..
                    } => {
                        let mut blocks = Vec::new();
                        for (j, o) in others.iter().enumerate() {
                            let Call::Reduce {
                                root: r,
                                src,
                                bytes: b,
                                ..
                            } = **o
                            else {
                                panic!("member {j} issued {o:?} where member {me} reduces");
                            };
                            assert_eq!((r, b), (root, bytes), "member {j}'s reduce");
                            blocks.push(&parts[j].input[src..src + bytes]);
                        }
                        if let Some(dst) = dst {
                            out[dst..dst + bytes].copy_from_slice(&red("reduce", blocks));
                        }
                    }
                    Call::AllGather { bytes } => {
                        for (j, o) in others.iter().enumerate() {
                            assert_eq!(**o, Call::AllGather { bytes });
                            out[j * bytes..(j + 1) * bytes]
                                .copy_from_slice(&parts[j].input[..bytes]);
                        }
                    }
                    Call::Broadcast {
                        root, dst, bytes, ..
                    } => {
                        for (j, o) in others.iter().enumerate() {
                            let Call::Broadcast {
                                root: r, bytes: b, ..
                            } = **o
                            else {
                                panic!("member {j} issued {o:?} where member {me} broadcasts");
                            };
                            assert_eq!((r, b), (root, bytes), "member {j}'s broadcast");
                        }
                        let Call::Broadcast { src, .. } = *others[root] else {
                            unreachable!()
                        };
                        out[dst..dst + bytes].copy_from_slice(&parts[root].input[src..src + bytes]);
                    }
                    _ => unreachable!(),
                }
            }
            // Point-to-point: the k-th receive from p matches p's k-th send to this member.
            let mut taken = vec![0usize; n];
            for call in &parts[me].plan.calls {
                match *call {
                    Call::Recv { peer, dst, bytes } => {
                        let sends: Vec<(usize, usize)> = parts[peer]
                            .plan
                            .calls
                            .iter()
                            .filter_map(|c| match *c {
                                Call::Send {
                                    peer: to,
                                    src,
                                    bytes,
                                } if to == me => Some((src, bytes)),
                                _ => None,
                            })
                            .collect();
                        let (src, sent) = sends[taken[peer]];
                        taken[peer] += 1;
                        assert_eq!(
                            sent, bytes,
                            "member {peer} sends {sent}, {me} receives {bytes}"
                        );
                        out[dst..dst + bytes].copy_from_slice(&parts[peer].input[src..src + bytes]);
                    }
                    Call::Copy { src, dst, bytes } => {
                        out[dst..dst + bytes].copy_from_slice(&parts[me].input[src..src + bytes]);
                    }
                    _ => {}
                }
            }
            // Every send of every peer to this member was received.
            for (peer, part) in parts.iter().enumerate() {
                let sent = part
                    .plan
                    .calls
                    .iter()
                    .filter(|c| matches!(c, Call::Send { peer: to, .. } if *to == me))
                    .count();
                assert_eq!(sent, taken[peer], "unmatched sends from {peer} to {me}");
            }
            out
        })
        .collect()
}

/// Member `rank`'s input: `rows` rows of 3 values of `dtype`, different on every member.
fn input(rank: usize, rows: usize, dtype: DType) -> TensorData {
    let values: Vec<f32> = (0..rows * 3)
        .map(|i| ((rank * 37 + i * 11) % 23) as f32 - 11.0 + 0.25 * (i % 3) as f32)
        .collect();
    let data = TensorData::new(values, [rows, 3]);
    if matches!(dtype, DType::I64 | DType::I32) {
        data.convert_dtype(DType::I64).convert_dtype(dtype)
    } else {
        data.convert_dtype(dtype)
    }
}

/// The in-process world's result of `f` on every member.
fn world(n: usize, f: impl Fn(usize, &dyn Communicator) -> TensorData + Sync) -> Vec<Vec<u8>> {
    World::run(n, |ctx| {
        let comm = ctx.world()?;
        Ok(f(ctx.rank(), comm.communicator().as_ref())
            .into_bytes()
            .to_vec())
    })
    .into_iter()
    .map(|r| r.unwrap())
    .collect()
}

const DTYPES: [DType; 5] = [DType::F32, DType::BF16, DType::F16, DType::I64, DType::I32];

/// Row counts per member for worlds of 1–4: equal, ragged, with empty members.
fn row_sets(n: usize) -> Vec<Vec<usize>> {
    let mut sets = vec![vec![2; n], (0..n).map(|j| (j * 3 + 1) % 4).collect()];
    if n > 1 {
        sets.push((0..n).map(|j| if j == 1 { 0 } else { j + 2 }).collect());
        sets.push(vec![0; n]);
    }
    sets
}

fn site() -> crate::comm::CallSite {
    std::panic::Location::caller()
}

#[test]
fn all_gather_v_plans_equal_the_threads_transport() {
    for n in 1..=4 {
        for sizes in row_sets(n) {
            for dtype in DTYPES {
                let elem = dtype.size();
                let parts: Vec<Part> = (0..n)
                    .map(|j| Part {
                        input: input(j, sizes[j], dtype).into_bytes().to_vec(),
                        plan: plan_all_gather_v(&[sizes[j], 3], elem, &sizes),
                    })
                    .collect();
                let ragged = !sizes.windows(2).all(|w| w[0] == w[1]);
                for p in &parts {
                    let kinds_ok = p.plan.calls.iter().all(|c| match c {
                        Call::AllGather { .. } => !ragged,
                        Call::Broadcast { .. } => ragged,
                        _ => false,
                    });
                    assert!(kinds_ok, "{sizes:?}: {:?}", p.plan.calls);
                    assert_eq!(p.plan.out_shape, vec![sizes.iter().sum::<usize>(), 3]);
                }
                let got = execute(&parts, elem, None, dtype);
                let want = world(n, |r, c| {
                    c.all_gather_v(input(r, sizes[r], dtype), site()).unwrap().0
                });
                assert_eq!(got, want, "n={n} sizes={sizes:?} {dtype:?}");
            }
        }
    }
}

#[test]
fn reduce_scatter_v_plans_equal_the_threads_transport() {
    for n in 1..=4 {
        for splits in row_sets(n) {
            let rows: usize = splits.iter().sum();
            for dtype in DTYPES {
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
                    if reduction(dtype, op).is_err() {
                        continue;
                    }
                    let elem = dtype.size();
                    let parts: Vec<Part> = (0..n)
                        .map(|j| Part {
                            input: input(j, rows, dtype).into_bytes().to_vec(),
                            plan: plan_reduce_scatter_v(&[rows, 3], elem, &splits, j),
                        })
                        .collect();
                    for (j, p) in parts.iter().enumerate() {
                        assert_eq!(p.plan.out_shape, vec![splits[j], 3]);
                        check_bounds(&p.plan, n, j, rows * 3 * elem, splits[j] * 3 * elem).unwrap();
                    }
                    let got = execute(&parts, elem, Some(op), dtype);
                    let want = world(n, |r, c| {
                        c.reduce_scatter_v(input(r, rows, dtype), &splits, op, site())
                            .unwrap()
                    });
                    assert_eq!(got, want, "n={n} splits={splits:?} {dtype:?} {op:?}");
                }
            }
        }
    }
}

#[test]
fn all_to_all_v_plans_equal_the_threads_transport() {
    for n in 1..=4 {
        // send[i][j]: rows member i sends to member j, with zeros and a self block.
        let send: Vec<Vec<usize>> = (0..n)
            .map(|i| (0..n).map(|j| (i * 2 + j * 3 + 1) % 4).collect())
            .collect();
        for dtype in DTYPES {
            let elem = dtype.size();
            let recv = |me: usize| -> Vec<usize> { (0..n).map(|i| send[i][me]).collect() };
            let parts: Vec<Part> = (0..n)
                .map(|j| {
                    let rows = send[j].iter().sum();
                    let plan = plan_all_to_all_v(&[rows, 3], elem, &send[j], &recv(j), j);
                    let out_bytes = recv(j).iter().sum::<usize>() * 3 * elem;
                    check_bounds(&plan, n, j, rows * 3 * elem, out_bytes).unwrap();
                    assert!(
                        !plan.calls.iter().any(|c| matches!(
                            c,
                            Call::Send { bytes: 0, .. } | Call::Recv { bytes: 0, .. }
                        ) || matches!(c, Call::Send { peer, .. } | Call::Recv { peer, .. } if *peer == j)),
                        "no empty transfers, no NCCL transfer to itself: {:?}",
                        plan.calls
                    );
                    Part {
                        input: input(j, rows, dtype).into_bytes().to_vec(),
                        plan,
                    }
                })
                .collect();
            let got = execute(&parts, elem, None, dtype);
            let want = world(n, |r, c| {
                let rows = send[r].iter().sum();
                c.all_to_all_v(input(r, rows, dtype), &send[r], &recv(r), site())
                    .unwrap()
            });
            assert_eq!(got, want, "n={n} {dtype:?}");
        }
    }
}

#[test]
fn all_reduce_and_broadcast_plans_equal_the_threads_transport() {
    for n in 1..=4 {
        for dtype in DTYPES {
            let elem = dtype.size();
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Mean] {
                if reduction(dtype, op).is_err() {
                    continue;
                }
                let parts: Vec<Part> = (0..n)
                    .map(|j| Part {
                        input: input(j, 5, dtype).into_bytes().to_vec(),
                        plan: plan_all_reduce(&[5, 3], elem),
                    })
                    .collect();
                let got = execute(&parts, elem, Some(op), dtype);
                let want = world(n, |r, c| {
                    c.all_reduce(input(r, 5, dtype), op, site()).unwrap()
                });
                assert_eq!(got, want, "n={n} {dtype:?} {op:?}");
            }
            let root = n - 1;
            let parts: Vec<Part> = (0..n)
                .map(|j| Part {
                    input: input(j, 4, dtype).into_bytes().to_vec(),
                    plan: plan_broadcast(&[4, 3], elem, root),
                })
                .collect();
            let got = execute(&parts, elem, None, dtype);
            let want = world(n, |r, c| {
                c.broadcast(input(r, 4, dtype), root, site()).unwrap()
            });
            assert_eq!(got, want, "broadcast n={n} {dtype:?}");
        }
    }
}

#[test]
fn empty_tensors_plan_no_calls() {
    assert!(plan_all_reduce(&[0, 4], 4).calls.is_empty());
    assert!(plan_broadcast(&[3, 0], 2, 0).calls.is_empty());
    assert!(plan_all_gather_v(&[0, 4], 4, &[0, 0]).calls.is_empty());
    assert_eq!(plan_all_gather_v(&[0, 4], 4, &[0, 0]).out_shape, vec![0, 4]);
    assert!(
        plan_reduce_scatter_v(&[0, 2], 8, &[0, 0, 0], 1)
            .calls
            .is_empty()
    );
    assert!(
        plan_all_to_all_v(&[0, 2], 8, &[0, 0], &[0, 0], 0)
            .calls
            .is_empty()
    );
}

#[test]
fn dtypes_map_to_nccl_types_and_reductions() {
    // The codes of nccl.h's ncclDataType_t / ncclRedOp_t.
    let expect = [
        (DType::F32, 7),
        (DType::BF16, 9),
        (DType::F16, 6),
        (DType::F64, 8),
        (DType::I64, 4),
        (DType::I32, 2),
        (DType::I8, 0),
        (DType::U8, 1),
        (DType::U32, 3),
        (DType::U64, 5),
    ];
    for (dtype, code) in expect {
        assert_eq!(nccl_type(dtype).map(|t| t as i32), Some(code), "{dtype:?}");
    }
    assert_eq!(nccl_type(DType::I16), None);
    assert_eq!(
        reduction(DType::BF16, ReduceOp::Mean),
        Ok((NcclType::Bfloat16, NcclReduce::Avg))
    );
    assert_eq!(NcclReduce::Sum as i32, 0);
    assert_eq!(NcclReduce::Max as i32, 2);
    assert_eq!(NcclReduce::Avg as i32, 4);
    assert_eq!(
        reduction(DType::I64, ReduceOp::Max),
        Ok((NcclType::Int64, NcclReduce::Max))
    );
    let err = reduction(DType::I32, ReduceOp::Mean).unwrap_err();
    assert!(err.contains("mean is not defined for integer"), "{err}");
    assert!(reduction(DType::I16, ReduceOp::Sum).is_err());
}

#[test]
fn bounds_are_checked_before_any_pointer_is_used() {
    let plan = plan_all_to_all_v(&[4, 2], 4, &[1, 3], &[2, 2], 0);
    assert!(check_bounds(&plan, 2, 0, 32, 32).is_ok());
    // An output too small for the receives (a header that lied) is refused.
    let err = check_bounds(&plan, 2, 0, 32, 16).unwrap_err();
    assert!(err.contains("exceeds"), "{err}");
    let bad = Plan {
        out_shape: vec![1],
        calls: vec![Call::Reduce {
            root: 1,
            src: 0,
            dst: Some(0),
            bytes: 4,
        }],
    };
    assert!(check_bounds(&bad, 2, 0, 4, 4).is_err());
    let overflow = Plan {
        out_shape: vec![1],
        calls: vec![Call::Copy {
            src: usize::MAX,
            dst: 0,
            bytes: 2,
        }],
    };
    assert!(check_bounds(&overflow, 1, 0, 4, 4).is_err());
}

/// The model itself rejects plans NCCL would hang or fail on (so the tests above can fail).
#[test]
#[should_panic(expected = "sends")]
fn the_model_rejects_mismatched_point_to_point_sizes() {
    let a = Part {
        input: vec![1; 8],
        plan: Plan {
            out_shape: vec![0],
            calls: vec![Call::Send {
                peer: 1,
                src: 0,
                bytes: 8,
            }],
        },
    };
    let b = Part {
        input: Vec::new(),
        plan: Plan {
            out_shape: vec![4],
            calls: vec![Call::Recv {
                peer: 0,
                dst: 0,
                bytes: 4,
            }],
        },
    };
    execute(&[a, b], 1, None, DType::U8);
}

/// A model of NCCL's point-to-point matching for batched exchanges: every member's calls of
/// all its batches, in issue order; the `k`-th send from `p` to `q` meets the `k`-th receive
/// of `q` from `p`, and both must be the same kind (header or payload) and size (NCCL's
/// requirement). Returns, per member and batch, the payload bytes each receive got.
/// One member's planned batch: its calls and the payload of each send.
type PlannedBatch = (Vec<P2pCall>, Vec<Vec<u8>>);

/// Per `(src, dst)`: whether each send is a header, and its bytes, in issue order.
type Wire = std::collections::HashMap<(usize, usize), Vec<(bool, Vec<u8>)>>;

fn execute_p2p(batches: &[Vec<PlannedBatch>], header: usize) -> Vec<Vec<Vec<Vec<u8>>>> {
    let n = batches.len();
    // Per (src, dst): the (is_header, bytes) of every send in issue order.
    let mut wire: Wire = Wire::new();
    for (src, member) in batches.iter().enumerate() {
        for (calls, payloads) in member {
            for call in calls {
                match *call {
                    P2pCall::SendHeader { peer, send } => wire
                        .entry((src, peer))
                        .or_default()
                        .push((true, vec![send as u8; header])),
                    P2pCall::Send { peer, send, bytes } => {
                        assert_eq!(payloads[send].len(), bytes);
                        wire.entry((src, peer))
                            .or_default()
                            .push((false, payloads[send].clone()));
                    }
                    _ => {}
                }
            }
        }
    }
    let mut taken: std::collections::HashMap<(usize, usize), usize> =
        std::collections::HashMap::new();
    let out = (0..n)
        .map(|me| {
            batches[me]
                .iter()
                .map(|(calls, payloads)| {
                    let recvs = calls
                        .iter()
                        .filter_map(|c| match *c {
                            P2pCall::RecvHeader { recv, .. }
                            | P2pCall::Recv { recv, .. }
                            | P2pCall::Copy { recv, .. } => Some(recv + 1),
                            _ => None,
                        })
                        .max()
                        .unwrap_or(0);
                    let mut got = vec![Vec::new(); recvs];
                    for call in calls {
                        match *call {
                            P2pCall::RecvHeader { peer, .. } => {
                                let k = taken.entry((peer, me)).or_default();
                                let (is_header, bytes) = &wire[&(peer, me)][*k];
                                *k += 1;
                                assert!(
                                    *is_header && bytes.len() == header,
                                    "header meets payload"
                                );
                            }
                            P2pCall::Recv { peer, recv, bytes } => {
                                let k = taken.entry((peer, me)).or_default();
                                let (is_header, sent) = &wire[&(peer, me)][*k];
                                *k += 1;
                                assert!(!is_header, "payload meets header");
                                assert_eq!(sent.len(), bytes, "sizes differ: NCCL would hang");
                                got[recv] = sent.clone();
                            }
                            P2pCall::Copy { send, recv, bytes } => {
                                assert_eq!(payloads[send].len(), bytes);
                                got[recv] = payloads[send].clone();
                            }
                            _ => {}
                        }
                    }
                    got
                })
                .collect()
        })
        .collect();
    for ((src, dst), sent) in &wire {
        assert_eq!(
            taken.get(&(*src, *dst)).copied().unwrap_or(0),
            sent.len(),
            "unmatched sends from {src} to {dst}"
        );
    }
    out
}

/// The batched exchanges of a pipeline-like program — rings in both directions, messages to
/// itself, empty messages, and one member's batch met by two of its peer's batches — planned
/// per member and run in the NCCL model deliver what the threads transport's `send_recv`
/// delivers, bit for bit, for worlds of 1–4 members and every dtype.
#[test]
fn send_recv_plans_equal_the_threads_transport() {
    let header = 64;
    for n in 1..=4usize {
        for dtype in DTYPES {
            let elem = dtype.size();
            // Member `me`'s batches: (sends (dst, rows, tag), recvs (src, rows, tag)).
            type Batch = (Vec<(usize, usize, usize)>, Vec<(usize, usize, usize)>);
            let program = |me: usize| -> Vec<Batch> {
                let next = (me + 1) % n;
                let prev = (me + n - 1) % n;
                let mut batches = vec![
                    // Send forward, receive from behind; an empty message; one to itself.
                    (
                        vec![(next, 2, 0), (next, 0, 1), (me, 1, 2)],
                        vec![(prev, 2, 0), (prev, 0, 1), (me, 1, 2)],
                    ),
                ];
                // Member 0 sends two messages backwards in one batch; the others receive
                // them in two batches (partial matching across batches).
                if n == 1 {
                    return batches;
                }
                if me == 0 {
                    batches.push((vec![(prev, 3, 3), (prev, 1, 4)], vec![]));
                    batches.push((vec![], vec![(next, 2, 5)]));
                } else if me == n - 1 {
                    batches.push((vec![], vec![(next, 3, 3)]));
                    batches.push((vec![(prev, 2, 5)], vec![(next, 1, 4)]));
                } else {
                    batches.push((vec![(prev, 2, 5)], vec![(next, 2, 5)]));
                }
                batches
            };
            let message = |src: usize, tag: usize, rows: usize| {
                input(src * 10 + tag, rows, dtype).into_bytes().to_vec()
            };
            let planned: Vec<Vec<PlannedBatch>> = (0..n)
                .map(|me| {
                    program(me)
                        .into_iter()
                        .map(|(sends, recvs)| {
                            let s: Vec<(usize, usize)> =
                                sends.iter().map(|&(d, r, _)| (d, r * 3 * elem)).collect();
                            let r: Vec<(usize, usize)> =
                                recvs.iter().map(|&(p, r, _)| (p, r * 3 * elem)).collect();
                            let calls = plan_send_recv(me, n, &s, &r).unwrap();
                            let payloads: Vec<Vec<u8>> =
                                sends.iter().map(|&(_, r, t)| message(me, t, r)).collect();
                            let send_bytes: Vec<usize> = s.iter().map(|x| x.1).collect();
                            let recv_bytes: Vec<usize> = r.iter().map(|x| x.1).collect();
                            let hb = (s.len() * header, r.len() * header);
                            check_p2p_bounds(&calls, &send_bytes, &recv_bytes, header, hb).unwrap();
                            (calls, payloads)
                        })
                        .collect()
                })
                .collect();
            let got = execute_p2p(&planned, header);
            let want: Vec<Vec<Vec<Vec<u8>>>> = World::run(n, |ctx| {
                let comm = ctx.world()?;
                let c = comm.communicator();
                let me = ctx.rank();
                program(me)
                    .into_iter()
                    .map(|(sends, recvs)| {
                        let sends = sends
                            .iter()
                            .map(|&(d, r, t)| {
                                let data =
                                    TensorData::from_bytes_vec(message(me, t, r), [r, 3], dtype);
                                (data, d)
                            })
                            .collect();
                        let specs: Vec<crate::comm::RecvSpec> = recvs
                            .iter()
                            .map(|&(p, r, _)| crate::comm::RecvSpec {
                                shape: vec![r, 3],
                                dtype,
                                src: p,
                            })
                            .collect();
                        Ok(c.send_recv(sends, &specs, site())?
                            .into_iter()
                            .map(|d| d.into_bytes().to_vec())
                            .collect())
                    })
                    .collect()
            })
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
            assert_eq!(got, want, "n={n} {dtype:?}");
        }
    }
}

#[test]
fn send_recv_plans_refuse_what_nccl_would_hang_on() {
    assert!(
        plan_send_recv(0, 2, &[(2, 4)], &[])
            .unwrap_err()
            .contains("destination 2")
    );
    assert!(
        plan_send_recv(0, 2, &[], &[(5, 4)])
            .unwrap_err()
            .contains("source 5")
    );
    let err = plan_send_recv(1, 2, &[(1, 4)], &[]).unwrap_err();
    assert!(err.contains("1 sends to itself but 0 receives"), "{err}");
    let err = plan_send_recv(1, 2, &[(1, 4)], &[(1, 8)]).unwrap_err();
    assert!(err.contains("4 bytes where 8"), "{err}");
    let calls = plan_send_recv(0, 2, &[(1, 8)], &[(1, 8)]).unwrap();
    assert!(check_p2p_bounds(&calls, &[4], &[8], 16, (16, 16)).is_err());
    assert!(check_p2p_bounds(&calls, &[8], &[8], 16, (8, 16)).is_err());
    assert!(check_p2p_bounds(&calls, &[8], &[8], 16, (16, 16)).is_ok());
}
