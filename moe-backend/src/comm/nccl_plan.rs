//! The NCCL calls of each device-buffer collective, planned on the host from the agreed
//! headers: pure logic (no CUDA, no NCCL), compiled and tested on every build; the NCCL
//! transport (`nccl::device`, features `cuda` and `nccl`) issues the planned calls on the
//! tensors' device pointers inside one `ncclGroupStart`/`ncclGroupEnd`.
//!
//! What each collective becomes follows PyTorch's `ProcessGroupNCCL` (what Megatron calls
//! through `torch.distributed`):
//! - `all_reduce` → `ncclAllReduce`; `broadcast` → `ncclBroadcast`;
//! - `all_gather_v` → `ncclAllGather` when every member has the same row count, else one
//!   `ncclBroadcast` per member with rows (root `j` sends its rows into block `j` of every
//!   member's output), grouped — PyTorch's uneven `allgather`;
//! - `reduce_scatter_v` → `ncclReduceScatter` when the splits are equal, else one `ncclReduce`
//!   per member with rows (root `j` receives the reduction of every member's block `j`),
//!   grouped — PyTorch's uneven `reduce_scatter`. No padding, no extra device buffers;
//! - `all_to_all_v` → one `ncclSend` / `ncclRecv` per peer with rows, grouped (PyTorch's
//!   `alltoall_base` with splits); the block a member keeps is a device-to-device copy;
//! - `send_recv` (the pipeline's batched point-to-point, Megatron's `batch_isend_irecv`) →
//!   one group with, per remote send, an `ncclSend` of its message header then one of its
//!   payload, and per remote receive an `ncclRecv` of the header then one of the payload
//!   ([`plan_send_recv`]); header and payload of a message are adjacent on both ends, so a
//!   pair's transfers match in issue order even when one rank's batch meets the peer's
//!   counterparts across several of its batches. Sends to the member itself are
//!   device-to-device copies into the matching receive of the same batch.
//!
//! Movements (gather, broadcast, all-to-all, send) travel as bytes (`ncclUint8`), so every
//! dtype moves; reductions need NCCL's own type ([`reduction`]): f32, bf16, f16, f64 and the
//! 8/32/64-bit integers. `Mean` is `ncclAvg` (NCCL ≥ 2.10) and, as on the host path, an error
//! for integers.
//!
//! Reduction order: NCCL reduces in its ring/tree order and in the tensor's dtype (bf16 and
//! f16 sums round at each step), where the host transports accumulate in f32 in member order
//! and round once. Results agree with the threads transport within that rounding: exactly
//! for integers, max and data movement; to about `(members − 1)` ulps of the dtype for float
//! sums.

use burn::tensor::DType;

use super::ReduceOp;

/// NCCL's data types (`ncclDataType_t`, the values of `nccl.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NcclType {
    /// `ncclInt8`.
    Int8 = 0,
    /// `ncclUint8`: also the type of every data movement.
    Uint8 = 1,
    /// `ncclInt32`.
    Int32 = 2,
    /// `ncclUint32`.
    Uint32 = 3,
    /// `ncclInt64`.
    Int64 = 4,
    /// `ncclUint64`.
    Uint64 = 5,
    /// `ncclFloat16`.
    Float16 = 6,
    /// `ncclFloat32`.
    Float32 = 7,
    /// `ncclFloat64`.
    Float64 = 8,
    /// `ncclBfloat16`.
    Bfloat16 = 9,
}

/// NCCL's reductions (`ncclRedOp_t`) the collectives use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NcclReduce {
    /// `ncclSum`.
    Sum = 0,
    /// `ncclMax`.
    Max = 2,
    /// `ncclAvg`.
    Avg = 4,
}

/// NCCL's type for reducing `dtype`, if it has one.
pub(crate) fn nccl_type(dtype: DType) -> Option<NcclType> {
    Some(match dtype {
        DType::F32 => NcclType::Float32,
        DType::BF16 => NcclType::Bfloat16,
        DType::F16 => NcclType::Float16,
        DType::F64 => NcclType::Float64,
        DType::I64 => NcclType::Int64,
        DType::I32 => NcclType::Int32,
        DType::I8 => NcclType::Int8,
        DType::U64 => NcclType::Uint64,
        DType::U32 => NcclType::Uint32,
        DType::U8 => NcclType::Uint8,
        _ => return None,
    })
}

/// NCCL's type and reduction for reducing `dtype` with `op`, or why NCCL cannot (the same
/// verdict on every member: the dtype and op were agreed first).
pub(crate) fn reduction(dtype: DType, op: ReduceOp) -> Result<(NcclType, NcclReduce), String> {
    let ty = nccl_type(dtype)
        .ok_or_else(|| format!("reductions are not supported for dtype {dtype:?} by NCCL"))?;
    let float = matches!(
        ty,
        NcclType::Float16 | NcclType::Float32 | NcclType::Float64 | NcclType::Bfloat16
    );
    let red = match op {
        ReduceOp::Sum => NcclReduce::Sum,
        ReduceOp::Max => NcclReduce::Max,
        ReduceOp::Mean if float => NcclReduce::Avg,
        ReduceOp::Mean => {
            return Err(format!("mean is not defined for integer dtype {dtype:?}"));
        }
    };
    Ok((ty, red))
}

/// One NCCL call of a plan. Offsets and lengths are in bytes from the start of this member's
/// input (`src`) or output (`dst`) buffer; typed calls divide them by the element size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    /// `ncclAllReduce` of the whole input into the whole output.
    AllReduce {
        /// Bytes of the tensor.
        bytes: usize,
    },
    /// `ncclReduceScatter`: block `me` (of `bytes` each) of the reduced input.
    ReduceScatter {
        /// Bytes per member.
        bytes: usize,
    },
    /// `ncclReduce` of `bytes` at `src` of every member onto member `root`, at `dst` of its
    /// output (`None` on the other members: NCCL does not touch their receive buffer).
    Reduce {
        /// The member receiving the result.
        root: usize,
        /// Offset in the input.
        src: usize,
        /// Offset in the root's output.
        dst: Option<usize>,
        /// Bytes reduced.
        bytes: usize,
    },
    /// `ncclAllGather`: every member's first `bytes` of input, in member order.
    AllGather {
        /// Bytes per member.
        bytes: usize,
    },
    /// `ncclBroadcast` of `bytes` at `src` of `root`'s input to `dst` of every output.
    Broadcast {
        /// The member sending.
        root: usize,
        /// Offset in the root's input.
        src: usize,
        /// Offset in every output.
        dst: usize,
        /// Bytes sent.
        bytes: usize,
    },
    /// `ncclSend` of `bytes` at `src` to member `peer`.
    Send {
        /// The receiving member.
        peer: usize,
        /// Offset in the input.
        src: usize,
        /// Bytes sent.
        bytes: usize,
    },
    /// `ncclRecv` of `bytes` from member `peer` to `dst`.
    Recv {
        /// The sending member.
        peer: usize,
        /// Offset in the output.
        dst: usize,
        /// Bytes received.
        bytes: usize,
    },
    /// A device-to-device copy (the block a member sends to itself).
    Copy {
        /// Offset in the input.
        src: usize,
        /// Offset in the output.
        dst: usize,
        /// Bytes copied.
        bytes: usize,
    },
}

/// The calls of one collective (issued in one NCCL group, in this order) and the shape of
/// its output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Shape of the output tensor (same dtype as the input).
    pub(crate) out_shape: Vec<usize>,
    /// The calls; empty when nothing moves (empty tensors).
    pub(crate) calls: Vec<Call>,
}

/// Rows and bytes per row of a tensor of `shape` and elements of `elem` bytes (a 0-d tensor
/// counts as one row).
pub(crate) fn rows_and_row_bytes(shape: &[usize], elem: usize) -> (usize, usize) {
    match shape.split_first() {
        Some((&rows, rest)) => (rows, rest.iter().product::<usize>() * elem),
        None => (1, elem),
    }
}

/// Byte offsets of consecutive blocks of `splits` rows of `row_bytes` each.
pub(crate) fn offsets(splits: &[usize], row_bytes: usize) -> Vec<usize> {
    splits
        .iter()
        .scan(0usize, |at, &rows| {
            let start = *at;
            *at += rows * row_bytes;
            Some(start)
        })
        .collect()
}

fn all_equal(v: &[usize]) -> bool {
    v.windows(2).all(|w| w[0] == w[1])
}

fn with_rows(shape: &[usize], rows: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    if let Some(first) = out.first_mut() {
        *first = rows;
    }
    out
}

/// `all_reduce` of a tensor of `shape` with `elem`-byte elements.
pub(crate) fn plan_all_reduce(shape: &[usize], elem: usize) -> Plan {
    let bytes = shape.iter().product::<usize>() * elem;
    Plan {
        out_shape: shape.to_vec(),
        calls: if bytes > 0 {
            vec![Call::AllReduce { bytes }]
        } else {
            Vec::new()
        },
    }
}

/// `broadcast` from member `root` of a tensor of `shape`.
pub(crate) fn plan_broadcast(shape: &[usize], elem: usize, root: usize) -> Plan {
    let bytes = shape.iter().product::<usize>() * elem;
    Plan {
        out_shape: shape.to_vec(),
        calls: if bytes > 0 {
            vec![Call::Broadcast {
                root,
                src: 0,
                dst: 0,
                bytes,
            }]
        } else {
            Vec::new()
        },
    }
}

/// `all_gather_v` of this member's tensor of `shape` (dim 0 at least 1 dim), every member
/// holding `sizes[j]` rows (agreed in the headers).
pub(crate) fn plan_all_gather_v(shape: &[usize], elem: usize, sizes: &[usize]) -> Plan {
    let (_, row_bytes) = rows_and_row_bytes(shape, elem);
    let out_shape = with_rows(shape, sizes.iter().sum());
    let calls = if row_bytes == 0 || sizes.iter().all(|&r| r == 0) {
        Vec::new()
    } else if all_equal(sizes) {
        vec![Call::AllGather {
            bytes: sizes[0] * row_bytes,
        }]
    } else {
        offsets(sizes, row_bytes)
            .into_iter()
            .zip(sizes)
            .enumerate()
            .filter(|(_, (_, rows))| **rows > 0)
            .map(|(root, (dst, &rows))| Call::Broadcast {
                root,
                src: 0,
                dst,
                bytes: rows * row_bytes,
            })
            .collect()
    };
    Plan { out_shape, calls }
}

/// `reduce_scatter_v` of a tensor of `shape` in blocks of `splits` rows (agreed); member
/// `me` keeps block `me`.
pub(crate) fn plan_reduce_scatter_v(
    shape: &[usize],
    elem: usize,
    splits: &[usize],
    me: usize,
) -> Plan {
    let (_, row_bytes) = rows_and_row_bytes(shape, elem);
    let out_shape = with_rows(shape, splits.get(me).copied().unwrap_or(0));
    let calls = if row_bytes == 0 || splits.iter().all(|&r| r == 0) {
        Vec::new()
    } else if all_equal(splits) {
        vec![Call::ReduceScatter {
            bytes: splits[0] * row_bytes,
        }]
    } else {
        offsets(splits, row_bytes)
            .into_iter()
            .zip(splits)
            .enumerate()
            .filter(|(_, (_, rows))| **rows > 0)
            .map(|(root, (src, &rows))| Call::Reduce {
                root,
                src,
                dst: (root == me).then_some(0),
                bytes: rows * row_bytes,
            })
            .collect()
    };
    Plan { out_shape, calls }
}

/// `all_to_all_v` of a tensor of `shape`: block `j` of `send_splits` to member `j`, blocks of
/// `recv_splits` from every member concatenated in member order (agreed: `recv_splits[i]` is
/// member `i`'s `send_splits[me]`).
pub(crate) fn plan_all_to_all_v(
    shape: &[usize],
    elem: usize,
    send_splits: &[usize],
    recv_splits: &[usize],
    me: usize,
) -> Plan {
    let (_, row_bytes) = rows_and_row_bytes(shape, elem);
    let out_shape = with_rows(shape, recv_splits.iter().sum());
    let send_at = offsets(send_splits, row_bytes);
    let recv_at = offsets(recv_splits, row_bytes);
    let mut calls = Vec::new();
    if row_bytes > 0 {
        for peer in 0..send_splits.len() {
            let (out, inc) = (send_splits[peer], recv_splits[peer]);
            if peer == me {
                if out > 0 {
                    calls.push(Call::Copy {
                        src: send_at[peer],
                        dst: recv_at[peer],
                        bytes: out * row_bytes,
                    });
                }
                continue;
            }
            if out > 0 {
                calls.push(Call::Send {
                    peer,
                    src: send_at[peer],
                    bytes: out * row_bytes,
                });
            }
            if inc > 0 {
                calls.push(Call::Recv {
                    peer,
                    dst: recv_at[peer],
                    bytes: inc * row_bytes,
                });
            }
        }
    }
    Plan { out_shape, calls }
}

/// Bytes of input a plan reads and of output it writes, for the bounds check before any
/// pointer reaches NCCL: every call must stay inside both buffers.
pub(crate) fn check_bounds(
    plan: &Plan,
    members: usize,
    me: usize,
    in_bytes: usize,
    out_bytes: usize,
) -> Result<(), String> {
    let within = |what: &str, at: usize, len: usize, cap: usize| {
        if at.checked_add(len).is_some_and(|end| end <= cap) {
            Ok(())
        } else {
            Err(format!(
                "{what} range {at}..{} exceeds the buffer of {cap} bytes",
                at.saturating_add(len)
            ))
        }
    };
    for call in &plan.calls {
        match *call {
            Call::AllReduce { bytes } => {
                within("all_reduce input", 0, bytes, in_bytes)?;
                within("all_reduce output", 0, bytes, out_bytes)?;
            }
            Call::ReduceScatter { bytes } => {
                within("reduce_scatter input", 0, bytes * members, in_bytes)?;
                within("reduce_scatter output", 0, bytes, out_bytes)?;
            }
            Call::Reduce {
                root,
                src,
                dst,
                bytes,
            } => {
                within("reduce input", src, bytes, in_bytes)?;
                if let Some(dst) = dst {
                    within("reduce output", dst, bytes, out_bytes)?;
                }
                if root >= members || (dst.is_some() != (root == me)) {
                    return Err(format!("reduce root {root} for member {me} of {members}"));
                }
            }
            Call::AllGather { bytes } => {
                within("all_gather input", 0, bytes, in_bytes)?;
                within("all_gather output", 0, bytes * members, out_bytes)?;
            }
            Call::Broadcast {
                root,
                src,
                dst,
                bytes,
            } => {
                if root == me {
                    within("broadcast input", src, bytes, in_bytes)?;
                }
                within("broadcast output", dst, bytes, out_bytes)?;
            }
            Call::Send { src, bytes, .. } => within("send input", src, bytes, in_bytes)?,
            Call::Recv { dst, bytes, .. } => within("recv output", dst, bytes, out_bytes)?,
            Call::Copy { src, dst, bytes } => {
                within("copy input", src, bytes, in_bytes)?;
                within("copy output", dst, bytes, out_bytes)?;
            }
        }
    }
    Ok(())
}

/// One call of a batched point-to-point exchange ([`plan_send_recv`]). Buffers are indexed:
/// send `k` is the `k`-th send of the batch, receive `k` the `k`-th receive; headers sit at
/// `k · header` in one staging buffer per side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum P2pCall {
    /// `ncclSend` of send `send`'s header to `peer`.
    SendHeader {
        /// The receiving member.
        peer: usize,
        /// Index of the send.
        send: usize,
    },
    /// `ncclSend` of send `send`'s `bytes` to `peer`.
    Send {
        /// The receiving member.
        peer: usize,
        /// Index of the send.
        send: usize,
        /// Bytes sent.
        bytes: usize,
    },
    /// `ncclRecv` of receive `recv`'s header from `peer`.
    RecvHeader {
        /// The sending member.
        peer: usize,
        /// Index of the receive.
        recv: usize,
    },
    /// `ncclRecv` of `bytes` from `peer` into receive `recv`'s buffer.
    Recv {
        /// The sending member.
        peer: usize,
        /// Index of the receive.
        recv: usize,
        /// Bytes received.
        bytes: usize,
    },
    /// A device-to-device copy of send `send` into receive `recv` (a message to itself).
    Copy {
        /// Index of the send.
        send: usize,
        /// Index of the receive.
        recv: usize,
        /// Bytes copied.
        bytes: usize,
    },
}

/// The calls of one batched exchange of member `me` of `members`: `sends[k]` is
/// `(destination, payload bytes)`, `recvs[k]` `(source, expected payload bytes)`. Sends to
/// itself pair with its receives from itself in order (the `j`-th with the `j`-th, of the
/// same size); anything else about them is an error, as are peers out of range. Empty
/// payloads move only their header.
pub(crate) fn plan_send_recv(
    me: usize,
    members: usize,
    sends: &[(usize, usize)],
    recvs: &[(usize, usize)],
) -> Result<Vec<P2pCall>, String> {
    if let Some(&(dst, _)) = sends.iter().find(|(dst, _)| *dst >= members) {
        return Err(format!(
            "destination {dst} out of range for {members} members"
        ));
    }
    if let Some(&(src, _)) = recvs.iter().find(|(src, _)| *src >= members) {
        return Err(format!("source {src} out of range for {members} members"));
    }
    let own_sends: Vec<usize> = (0..sends.len()).filter(|&k| sends[k].0 == me).collect();
    let own_recvs: Vec<usize> = (0..recvs.len()).filter(|&k| recvs[k].0 == me).collect();
    if own_sends.len() != own_recvs.len() {
        return Err(format!(
            "{} sends to itself but {} receives from itself in one batch (NCCL would wait \
             for the missing one)",
            own_sends.len(),
            own_recvs.len()
        ));
    }
    let mut calls = Vec::new();
    for (&send, &recv) in own_sends.iter().zip(&own_recvs) {
        let (sent, wanted) = (sends[send].1, recvs[recv].1);
        if sent != wanted {
            return Err(format!(
                "a message to itself of {sent} bytes where {wanted} are expected"
            ));
        }
        if sent > 0 {
            calls.push(P2pCall::Copy {
                send,
                recv,
                bytes: sent,
            });
        }
    }
    for (send, &(peer, bytes)) in sends.iter().enumerate() {
        if peer == me {
            continue;
        }
        calls.push(P2pCall::SendHeader { peer, send });
        if bytes > 0 {
            calls.push(P2pCall::Send { peer, send, bytes });
        }
    }
    for (recv, &(peer, bytes)) in recvs.iter().enumerate() {
        if peer == me {
            continue;
        }
        calls.push(P2pCall::RecvHeader { peer, recv });
        if bytes > 0 {
            calls.push(P2pCall::Recv { peer, recv, bytes });
        }
    }
    Ok(calls)
}

/// Bounds of a batched exchange's calls against its buffers (bytes of each send and each
/// receive buffer; `headers` of each side's header staging buffer, `header` bytes per
/// message) before any pointer reaches NCCL.
pub(crate) fn check_p2p_bounds(
    calls: &[P2pCall],
    send_bytes: &[usize],
    recv_bytes: &[usize],
    header: usize,
    (send_headers, recv_headers): (usize, usize),
) -> Result<(), String> {
    let fits = |what: &str, k: usize, len: usize, caps: &[usize]| match caps.get(k) {
        Some(&cap) if len <= cap => Ok(()),
        Some(&cap) => Err(format!(
            "{what} {k}: {len} bytes exceed its buffer of {cap}"
        )),
        None => Err(format!(
            "{what} {k} does not exist ({} planned)",
            caps.len()
        )),
    };
    let header_fits = |what: &str, k: usize, cap: usize| {
        if k.checked_add(1)
            .and_then(|n| n.checked_mul(header))
            .is_some_and(|end| end <= cap)
        {
            Ok(())
        } else {
            Err(format!(
                "{what} header {k} exceeds the header buffer of {cap} bytes"
            ))
        }
    };
    for call in calls {
        match *call {
            P2pCall::SendHeader { send, .. } => header_fits("send", send, send_headers)?,
            P2pCall::RecvHeader { recv, .. } => header_fits("receive", recv, recv_headers)?,
            P2pCall::Send { send, bytes, .. } => fits("send", send, bytes, send_bytes)?,
            P2pCall::Recv { recv, bytes, .. } => fits("receive", recv, bytes, recv_bytes)?,
            P2pCall::Copy { send, recv, bytes } => {
                fits("send", send, bytes, send_bytes)?;
                fits("receive", recv, bytes, recv_bytes)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
