//! NCCL on device memory (features `cuda` and `nccl`): the [`DeviceCommunicator`] of the NCCL
//! transport runs every collective on the CUDA tensors' own buffers, as Megatron's
//! `torch.distributed` calls do.
//!
//! A collective on a CUDA tensor:
//! 1. the tensor is made contiguous (Burn's `into_contiguous`: a no-op for the usual case);
//! 2. the header round of the host path ([`P2pComm::agree`], a few hundred bytes staged through
//!    the same NCCL communicator) checks every member's arguments against the others' — dtype,
//!    shape, splits, root — so a disagreement is the same typed error as on every transport
//!    and no mismatched buffer ever reaches NCCL; it also yields every member's row count;
//! 3. the NCCL calls are planned on the host (`nccl_plan`: `ncclAllReduce`, `ncclReduceScatter`
//!    or grouped `ncclReduce` for ragged splits, `ncclAllGather` or grouped `ncclBroadcast` for
//!    ragged rows, grouped `ncclSend`/`ncclRecv` for all-to-all-v, `ncclBroadcast`) and
//!    bounds-checked against both buffers;
//! 4. the output is allocated by the tensor's CubeCL client (`client.empty`), and both device
//!    pointers come from CubeCL's storage (`crate::cuda_mem`: `client.get_resource::<CudaServer>` →
//!    `GpuResource::ptr`, held for the call so the allocations stay in place);
//! 5. **stream ordering:** CubeCL's pending work is finished before NCCL reads
//!    (`client.sync()`: CubeCL does not expose its stream for an event wait); the calls run in
//!    one NCCL group on the communicator's stream, and its completion is awaited by polling a
//!    CUDA event until the deadline, so the result is complete before CubeCL's next kernel
//!    reads it. Two host waits per collective; the transport's timeout promise needs the
//!    second anyway;
//! 6. **timeouts and dead peers:** past the deadline the communicator is aborted
//!    (`ncclCommAbort`, which ends the kernels still waiting), the call returns
//!    [`BackendError::Timeout`](crate::BackendError::Timeout) naming the members, and the
//!    group stays failed — exactly the host-staged path's behaviour and errors.
//!
//! The pipeline's batched point-to-point exchange (`send_recv`, Megatron's
//! `batch_isend_irecv`) on CUDA tensors runs on their buffers too: one NCCL group with, per
//! message to another member, an `ncclSend` of its header (shape, dtype, call site; staged
//! through a small device buffer) followed by an `ncclSend` of the payload from the tensor's
//! own memory, and per receive an `ncclRecv` of the header then of the payload into a fresh
//! CubeCL allocation of the expected size (`nccl_plan::plan_send_recv`, bounds-checked); a
//! message to itself is a device-to-device copy. Header and payload are adjacent on both
//! ends, so a pair's transfers match in issue order even when one rank's batch meets its
//! peer's counterparts across several batches (interleaved schedules with `m = pp` do). The
//! headers are checked after the group completed — a disagreement is the host path's typed
//! error naming both ranks and call sites; a disagreement in size never completes and ends
//! as the deadline's `ncclCommAbort` and [`BackendError::Timeout`](crate::BackendError::Timeout).
//! The batch has NCCL's rendezvous semantics, which the pipeline executor is checked and
//! tested against (`parallel::pipeline`).
//!
//! Still host-staged for CUDA tensors: a lone `send` / `recv` (not the pipeline's, which
//! batches): its callers may rely on a buffered send, so the tensor is read to the host and
//! moves through the queued-post protocol of the module above. Host (Flex) tensors take the
//! host-staged path as before. Nothing of a CUDA pipeline step is staged through the host.
//!
//! Reductions run in NCCL's order and in the tensor's dtype (see `nccl_plan`), so float sums
//! agree with the threads transport within `(members − 1)` roundings of the dtype; data
//! movement, integers and max are exact.

use std::sync::Arc;
use std::time::Instant;

use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, TensorData};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cudarc::driver::DevicePtr;
use cudarc::nccl::sys::{cudaStream_t, ncclDataType_t, ncclRedOp_t};

use super::super::buffer::{BufferKind, DeviceBuffer, DeviceCommunicator};
use super::super::nccl_plan::{
    self, Call, NcclReduce, NcclType, P2pCall, Plan, check_bounds, check_p2p_bounds,
    plan_all_gather_v, plan_all_reduce, plan_all_to_all_v, plan_broadcast, plan_reduce_scatter_v,
    plan_send_recv,
};
use super::super::p2p::{
    Args, LinkError, P2pComm, check_message_header, message_header, message_header_len,
};
use super::super::{CallSite, Communicator, RecvSpec, ReduceOp, Traffic};
use super::{GroupGuard, HostStagedNccl, NcclLinks, cuda, nccl};
use crate::cuda_mem;
use crate::error::{BackendError, Result};

/// NCCL's data type for a planned type.
fn nccl_data_type(ty: NcclType) -> ncclDataType_t {
    match ty {
        NcclType::Int8 => ncclDataType_t::ncclInt8,
        NcclType::Uint8 => ncclDataType_t::ncclUint8,
        NcclType::Int32 => ncclDataType_t::ncclInt32,
        NcclType::Uint32 => ncclDataType_t::ncclUint32,
        NcclType::Int64 => ncclDataType_t::ncclInt64,
        NcclType::Uint64 => ncclDataType_t::ncclUint64,
        NcclType::Float16 => ncclDataType_t::ncclFloat16,
        NcclType::Float32 => ncclDataType_t::ncclFloat32,
        NcclType::Float64 => ncclDataType_t::ncclFloat64,
        NcclType::Bfloat16 => ncclDataType_t::ncclBfloat16,
    }
}

/// NCCL's reduction for a planned one.
fn nccl_red_op(op: NcclReduce) -> ncclRedOp_t {
    match op {
        NcclReduce::Sum => ncclRedOp_t::ncclSum,
        NcclReduce::Max => ncclRedOp_t::ncclMax,
        NcclReduce::Avg => ncclRedOp_t::ncclAvg,
    }
}

/// The NCCL transport of one group: the host-staged collectives of [`P2pComm`] for host
/// tensors, NCCL on device buffers for CUDA tensors.
#[derive(Debug)]
pub(crate) struct NcclComm {
    p2p: P2pComm<NcclLinks<HostStagedNccl>>,
}

impl NcclComm {
    /// The transport over `p2p`'s links and communicator.
    pub(crate) fn new(p2p: P2pComm<NcclLinks<HostStagedNccl>>) -> Self {
        Self { p2p }
    }

    fn host(&self) -> &dyn DeviceCommunicator {
        &self.p2p
    }

    fn members(&self) -> usize {
        self.p2p.size()
    }

    fn me(&self) -> usize {
        Communicator::rank(&self.p2p)
    }

    /// Runs a planned collective on `input`: bounds check, output allocation, pointers,
    /// stream ordering, the NCCL group, and the wait with abort on timeout.
    fn run(
        &self,
        op: &'static str,
        input: CubeTensor,
        plan: Plan,
        reduce: Option<(NcclType, NcclReduce)>,
        site: CallSite,
    ) -> Result<CubeTensor> {
        let fail = |detail: String| self.p2p.group_error(op, format!("{detail} (at {site})"));
        let dtype = input.dtype;
        let elem = dtype.size();
        let in_bytes = input.meta.shape().num_elements() * elem;
        let out_bytes = plan.out_shape.iter().product::<usize>() * elem;
        check_bounds(&plan, self.members(), self.me(), in_bytes, out_bytes).map_err(&fail)?;
        let client = input.client.clone();
        let handle = client.empty(out_bytes);
        let output = CubeTensor::new_contiguous(
            client.clone(),
            input.device.clone(),
            plan.out_shape.clone().into(),
            handle,
            dtype,
        );
        if plan.calls.is_empty() {
            return Ok(output);
        }
        let resource = |t: &CubeTensor, what: &str| {
            cuda_mem::device_ptr(&client, &t.handle).map_err(|e| fail(format!("{e} (the {what})")))
        };
        let input_res = resource(&input, "input")?;
        let output_res = resource(&output, "output")?;
        let (src, dst) = (input_res.ptr, output_res.ptr);
        // CubeCL's kernels that write the input (or last used the output's memory) finish
        // before NCCL touches either buffer.
        cuda_mem::finish_pending(&client).map_err(&fail)?;
        let peers = plan_peers(&plan, self.members(), self.me());
        let deadline = Instant::now() + self.p2p.timeout();
        let issued = self.p2p.links().with_wire(deadline, |wire| {
            issue(wire, &plan, reduce, src, dst)?;
            wire.wait(peers, deadline)
        });
        // The allocations stay pinned until NCCL is done (or aborted).
        drop((input_res, output_res, input));
        issued.map_err(|e| self.p2p.link_failure(op, e, site))?;
        Ok(output)
    }
}

/// The members a plan waits for (named by a timeout).
fn plan_peers(plan: &Plan, members: usize, me: usize) -> Vec<usize> {
    let collective = plan
        .calls
        .iter()
        .any(|c| !matches!(c, Call::Send { .. } | Call::Recv { .. } | Call::Copy { .. }));
    if collective {
        return (0..members).filter(|&j| j != me).collect();
    }
    plan.calls
        .iter()
        .filter_map(|c| match *c {
            Call::Send { peer, .. } | Call::Recv { peer, .. } => Some(peer),
            _ => None,
        })
        .collect()
}

/// Issues `plan`'s calls in one NCCL group on the wire's communicator and stream; `src` and
/// `dst` are the input's and output's device pointers (bounds checked by the caller).
fn issue(
    wire: &mut HostStagedNccl,
    plan: &Plan,
    reduce: Option<(NcclType, NcclReduce)>,
    src: u64,
    dst: u64,
) -> std::result::Result<(), LinkError> {
    let comm = wire.comm()?;
    let (raw, stream) = (comm.raw(), Arc::clone(comm.stream()));
    stream
        .context()
        .bind_to_thread()
        .map_err(cuda("binding the GPU"))?;
    let cu = stream.cu_stream();
    let nccl_stream = cu as cudaStream_t;
    let bytes_type = ncclDataType_t::ncclUint8;
    let typed = |what: &'static str| {
        reduce.ok_or_else(|| {
            LinkError::Failed(format!("a {what} was planned without an NCCL reduction"))
        })
    };
    let elem_of = |ty: NcclType| match ty {
        NcclType::Int8 | NcclType::Uint8 => 1,
        NcclType::Float16 | NcclType::Bfloat16 => 2,
        NcclType::Int32 | NcclType::Uint32 | NcclType::Float32 => 4,
        NcclType::Int64 | NcclType::Uint64 | NcclType::Float64 => 8,
    };
    let at = |base: u64, offset: usize| base + offset as u64;
    let group = GroupGuard::start().map_err(nccl("ncclGroupStart"))?;
    for call in &plan.calls {
        // SAFETY (every call below): `src` and `dst` are live CubeCL allocations pinned by
        // the caller's `ManagedResource`s until the stream's work is done or the
        // communicator aborted; `check_bounds` proved every range inside them; `raw` is
        // this group's communicator, used under the group's lock only.
        match *call {
            Call::AllReduce { bytes } => {
                let (ty, op) = typed("all_reduce")?;
                unsafe {
                    cudarc::nccl::result::all_reduce(
                        src as *const _,
                        dst as *mut _,
                        bytes / elem_of(ty),
                        nccl_data_type(ty),
                        nccl_red_op(op),
                        raw,
                        nccl_stream,
                    )
                }
                .map_err(nccl("ncclAllReduce"))?;
            }
            Call::ReduceScatter { bytes } => {
                let (ty, op) = typed("reduce_scatter")?;
                unsafe {
                    cudarc::nccl::result::reduce_scatter(
                        src as *const _,
                        dst as *mut _,
                        bytes / elem_of(ty),
                        nccl_data_type(ty),
                        nccl_red_op(op),
                        raw,
                        nccl_stream,
                    )
                }
                .map_err(nccl("ncclReduceScatter"))?;
            }
            Call::Reduce {
                root,
                src: from,
                dst: to,
                bytes,
            } => {
                let (ty, op) = typed("reduce")?;
                let recv = to.map_or(std::ptr::null_mut(), |to| at(dst, to) as *mut _);
                unsafe {
                    cudarc::nccl::result::reduce(
                        at(src, from) as *const _,
                        recv,
                        bytes / elem_of(ty),
                        nccl_data_type(ty),
                        nccl_red_op(op),
                        root as i32,
                        raw,
                        nccl_stream,
                    )
                }
                .map_err(nccl("ncclReduce"))?;
            }
            Call::AllGather { bytes } => {
                unsafe {
                    cudarc::nccl::result::all_gather(
                        src as *const _,
                        dst as *mut _,
                        bytes,
                        bytes_type,
                        raw,
                        nccl_stream,
                    )
                }
                .map_err(nccl("ncclAllGather"))?;
            }
            Call::Broadcast {
                root,
                src: from,
                dst: to,
                bytes,
            } => {
                unsafe {
                    cudarc::nccl::result::broadcast(
                        at(src, from) as *const _,
                        at(dst, to) as *mut _,
                        bytes,
                        bytes_type,
                        root as i32,
                        raw,
                        nccl_stream,
                    )
                }
                .map_err(nccl("ncclBroadcast"))?;
            }
            Call::Send {
                peer,
                src: from,
                bytes,
            } => {
                unsafe {
                    cudarc::nccl::result::send(
                        at(src, from) as *const _,
                        bytes,
                        bytes_type,
                        peer as i32,
                        raw,
                        nccl_stream,
                    )
                }
                .map_err(nccl("ncclSend"))?;
            }
            Call::Recv {
                peer,
                dst: to,
                bytes,
            } => {
                unsafe {
                    cudarc::nccl::result::recv(
                        at(dst, to) as *mut _,
                        bytes,
                        bytes_type,
                        peer as i32,
                        raw,
                        nccl_stream,
                    )
                }
                .map_err(nccl("ncclRecv"))?;
            }
            Call::Copy {
                src: from,
                dst: to,
                bytes,
            } => {
                // Stream-ordered with the group's transfers on the same stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(at(dst, to), at(src, from), bytes, cu)
                }
                .map_err(cuda("a device-to-device copy"))?;
            }
        }
    }
    group.end().map_err(nccl("ncclGroupEnd"))?;
    Ok(())
}

/// The CUDA tensor of a buffer (callers checked the kind).
fn cuda_tensor(buf: DeviceBuffer, op: &'static str, group: &str) -> Result<CubeTensor> {
    match buf {
        DeviceBuffer::Cuda(t) => Ok(burn_cubecl::kernel::into_contiguous(t)),
        other => Err(BackendError::Collective {
            op,
            group: group.to_string(),
            detail: format!("expected a CUDA buffer, got {:?}", other.kind()),
        }),
    }
}

fn shape_of(t: &CubeTensor) -> Vec<usize> {
    t.meta.shape().iter().copied().collect()
}

impl NcclComm {
    fn group(&self) -> String {
        format!("{:?}", Communicator::ranks(&self.p2p))
    }

    /// The NCCL type and reduction of `op` on `dtype`, or the same typed error on every
    /// member (they agreed on both).
    fn reduction(
        &self,
        name: &'static str,
        dtype: DType,
        op: ReduceOp,
        site: CallSite,
    ) -> Result<(NcclType, NcclReduce)> {
        nccl_plan::reduction(dtype, op)
            .map_err(|detail| self.p2p.group_error(name, format!("{detail} (at {site})")))
    }
}

impl DeviceCommunicator for NcclComm {
    fn accepts(&self, kind: BufferKind) -> bool {
        matches!(kind, BufferKind::Host | BufferKind::Cuda)
    }

    fn all_reduce(&self, buf: DeviceBuffer, op: ReduceOp, site: CallSite) -> Result<DeviceBuffer> {
        const OP: &str = "all_reduce";
        if buf.kind() == BufferKind::Host {
            return self.host().all_reduce(buf, op, site);
        }
        let t = cuda_tensor(buf, OP, &self.group())?;
        let shape = shape_of(&t);
        let (_order, _) = self.p2p.agree(Args::AllReduce(op), &shape, t.dtype, site)?;
        let reduce = self.reduction(OP, t.dtype, op, site)?;
        let plan = plan_all_reduce(&shape, t.dtype.size());
        let n = self.members();
        let bytes = shape.iter().product::<usize>() * t.dtype.size();
        // Payload addressed to others, as the host transports count it.
        self.p2p.count_payload(&vec![2 * bytes / n.max(1); n]);
        self.run(OP, t, plan, Some(reduce), site)
            .map(DeviceBuffer::Cuda)
    }

    fn all_gather_v(
        &self,
        buf: DeviceBuffer,
        site: CallSite,
    ) -> Result<(DeviceBuffer, Vec<usize>)> {
        const OP: &str = "all_gather";
        if buf.kind() == BufferKind::Host {
            return self.host().all_gather_v(buf, site);
        }
        let t = cuda_tensor(buf, OP, &self.group())?;
        let shape = shape_of(&t);
        let (_order, sizes) = self.p2p.agree(Args::AllGather, &shape, t.dtype, site)?;
        let plan = plan_all_gather_v(&shape, t.dtype.size(), &sizes);
        let mine = shape.iter().product::<usize>() * t.dtype.size();
        self.p2p.count_payload(&vec![mine; self.members()]);
        let out = self.run(OP, t, plan, None, site)?;
        Ok((DeviceBuffer::Cuda(out), sizes))
    }

    fn reduce_scatter_v(
        &self,
        buf: DeviceBuffer,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<DeviceBuffer> {
        const OP: &str = "reduce_scatter";
        if buf.kind() == BufferKind::Host {
            return self.host().reduce_scatter_v(buf, splits, op, site);
        }
        let t = cuda_tensor(buf, OP, &self.group())?;
        let shape = shape_of(&t);
        let args = Args::ReduceScatter { splits, op };
        let (_order, _) = self.p2p.agree(args, &shape, t.dtype, site)?;
        let reduce = self.reduction(OP, t.dtype, op, site)?;
        let (_, row_bytes) = nccl_plan::rows_and_row_bytes(&shape, t.dtype.size());
        let plan = plan_reduce_scatter_v(&shape, t.dtype.size(), splits, self.me());
        let sent: Vec<usize> = splits.iter().map(|&r| r * row_bytes).collect();
        self.p2p.count_payload(&sent);
        self.run(OP, t, plan, Some(reduce), site)
            .map(DeviceBuffer::Cuda)
    }

    fn all_to_all_v(
        &self,
        buf: DeviceBuffer,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<DeviceBuffer> {
        const OP: &str = "all_to_all_v";
        if buf.kind() == BufferKind::Host {
            return self
                .host()
                .all_to_all_v(buf, send_splits, recv_splits, site);
        }
        let t = cuda_tensor(buf, OP, &self.group())?;
        let shape = shape_of(&t);
        let args = Args::AllToAll {
            send: send_splits,
            recv: recv_splits,
        };
        let (_order, _) = self.p2p.agree(args, &shape, t.dtype, site)?;
        let elem = t.dtype.size();
        let (_, row_bytes) = nccl_plan::rows_and_row_bytes(&shape, elem);
        let plan = plan_all_to_all_v(&shape, elem, send_splits, recv_splits, self.me());
        let sent: Vec<usize> = send_splits.iter().map(|&r| r * row_bytes).collect();
        self.p2p.count_payload(&sent);
        self.run(OP, t, plan, None, site).map(DeviceBuffer::Cuda)
    }

    fn broadcast(&self, buf: DeviceBuffer, root: usize, site: CallSite) -> Result<DeviceBuffer> {
        const OP: &str = "broadcast";
        if buf.kind() == BufferKind::Host {
            return self.host().broadcast(buf, root, site);
        }
        let t = cuda_tensor(buf, OP, &self.group())?;
        let shape = shape_of(&t);
        let (_order, _) = self
            .p2p
            .agree(Args::Broadcast { root }, &shape, t.dtype, site)?;
        let plan = plan_broadcast(&shape, t.dtype.size(), root);
        if self.me() == root {
            let bytes = shape.iter().product::<usize>() * t.dtype.size();
            self.p2p.count_payload(&vec![bytes; self.members()]);
        }
        self.run(OP, t, plan, None, site).map(DeviceBuffer::Cuda)
    }

    fn send(&self, buf: DeviceBuffer, dst: usize, site: CallSite) -> Result<()> {
        let DeviceBuffer::Cuda(t) = buf else {
            return self.host().send(buf, dst, site);
        };
        // Host-staged, buffered (see the module docs): a lone send keeps the queued-post
        // semantics its callers rely on; the pipeline batches through `send_recv`.
        let data = read(t, "send", &self.group())?;
        Communicator::send(&self.p2p, data, dst, site)
    }

    fn recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        like: &DeviceBuffer,
        site: CallSite,
    ) -> Result<DeviceBuffer> {
        let DeviceBuffer::Cuda(like) = like else {
            return self.host().recv(shape, dtype, src, like, site);
        };
        let data = Communicator::recv(&self.p2p, shape, dtype, src, site)?;
        Ok(DeviceBuffer::Cuda(CubeBackend::float_from_data(
            data,
            &like.device,
        )))
    }

    fn send_recv(
        &self,
        sends: Vec<(DeviceBuffer, usize)>,
        recvs: &[RecvSpec],
        like: &DeviceBuffer,
        site: CallSite,
    ) -> Result<Vec<DeviceBuffer>> {
        const OP: &str = "send_recv";
        let DeviceBuffer::Cuda(like) = like else {
            return self.host().send_recv(sends, recvs, like, site);
        };
        let group = self.group();
        let fail = |detail: String| self.p2p.group_error(OP, format!("{detail} (at {site})"));
        let tensors = sends
            .into_iter()
            .map(|(b, dst)| Ok((cuda_tensor(b, OP, &group)?, dst)))
            .collect::<Result<Vec<_>>>()?;
        let (me, n) = (self.me(), self.members());
        let bytes_of = |t: &CubeTensor| t.meta.shape().num_elements() * t.dtype.size();
        let send_plan: Vec<(usize, usize)> =
            tensors.iter().map(|(t, dst)| (*dst, bytes_of(t))).collect();
        let recv_plan: Vec<(usize, usize)> = recvs
            .iter()
            .map(|r| (r.src, r.shape.iter().product::<usize>() * r.dtype.size()))
            .collect();
        let calls = plan_send_recv(me, n, &send_plan, &recv_plan).map_err(&fail)?;
        // Headers: one per send, in send order; a message to itself is checked right here.
        let header = message_header_len();
        let mut send_headers = Vec::with_capacity(tensors.len() * header);
        for (t, _) in &tensors {
            send_headers.extend(message_header(&shape_of(t), t.dtype, site));
        }
        let ranks = Communicator::ranks(&self.p2p).to_vec();
        for call in &calls {
            if let P2pCall::Copy { send, recv, .. } = *call {
                let spec = &recvs[recv];
                let at = send * header;
                check_message_header(
                    &send_headers[at..at + header],
                    (&spec.shape, spec.dtype),
                    (ranks[me], ranks[me]),
                    site,
                )
                .map_err(|d| self.p2p.group_error(OP, d))?;
            }
        }
        let outputs: Vec<CubeTensor> = recvs
            .iter()
            .zip(&recv_plan)
            .map(|(spec, &(_, bytes))| {
                CubeTensor::new_contiguous(
                    like.client.clone(),
                    like.device.clone(),
                    spec.shape.clone().into(),
                    like.client.empty(bytes),
                    spec.dtype,
                )
            })
            .collect();
        let send_bytes: Vec<usize> = send_plan.iter().map(|s| s.1).collect();
        let recv_bytes: Vec<usize> = recv_plan.iter().map(|r| r.1).collect();
        let header_bytes = (tensors.len() * header, recvs.len() * header);
        check_p2p_bounds(&calls, &send_bytes, &recv_bytes, header, header_bytes).map_err(&fail)?;
        let mut sent = vec![0; n];
        for &(dst, bytes) in &send_plan {
            sent[dst] += bytes;
        }
        self.p2p.count_payload(&sent);
        if calls.is_empty() {
            return Ok(outputs.into_iter().map(DeviceBuffer::Cuda).collect());
        }
        let client = like.client.clone();
        let resource = |t: &CubeTensor, what: &str| {
            cuda_mem::device_ptr(&client, &t.handle).map_err(|e| fail(format!("{e} (for {what})")))
        };
        let send_res = tensors
            .iter()
            .map(|(t, _)| resource(t, "a send"))
            .collect::<Result<Vec<_>>>()?;
        let recv_res = outputs
            .iter()
            .map(|t| resource(t, "a receive"))
            .collect::<Result<Vec<_>>>()?;
        let src: Vec<u64> = send_res.iter().map(|r| r.ptr).collect();
        let dst: Vec<u64> = recv_res.iter().map(|r| r.ptr).collect();
        // CubeCL's kernels that wrote the sends (or last used the outputs' memory) finish
        // before NCCL touches them.
        cuda_mem::finish_pending(&client).map_err(&fail)?;
        let mut peers: Vec<usize> = send_plan
            .iter()
            .map(|s| s.0)
            .chain(recv_plan.iter().map(|r| r.0))
            .filter(|&p| p != me)
            .collect();
        peers.sort_unstable();
        peers.dedup();
        let deadline = Instant::now() + self.p2p.timeout();
        let landed = self.p2p.links().with_wire(deadline, |wire| {
            issue_p2p(
                wire,
                &calls,
                (&src, &dst),
                (&send_headers, recvs.len() * header),
                header,
                peers,
                deadline,
            )
        });
        // The allocations stay pinned until NCCL is done (or aborted).
        drop((send_res, recv_res, tensors));
        let landed = landed.map_err(|e| self.p2p.link_failure(OP, e, site))?;
        for call in &calls {
            if let P2pCall::RecvHeader { peer, recv } = *call {
                let spec = &recvs[recv];
                let at = recv * header;
                check_message_header(
                    landed.get(at..at + header).unwrap_or_default(),
                    (&spec.shape, spec.dtype),
                    (ranks[peer], ranks[me]),
                    site,
                )
                .map_err(|d| self.p2p.group_error(OP, d))?;
            }
        }
        Ok(outputs.into_iter().map(DeviceBuffer::Cuda).collect())
    }
}

/// Issues a batched exchange's planned calls in one NCCL group on the wire's communicator
/// and stream, waits for it until `deadline` (aborting the communicator on a timeout), and
/// returns the received headers. `src[k]` / `dst[k]` are the device pointers of send `k` /
/// receive `k` (bounds checked by the caller); `send_headers` holds one header per send.
fn issue_p2p(
    wire: &mut HostStagedNccl,
    calls: &[P2pCall],
    (src, dst): (&[u64], &[u64]),
    (send_headers, recv_headers): (&[u8], usize),
    header: usize,
    peers: Vec<usize>,
    deadline: Instant,
) -> std::result::Result<Vec<u8>, LinkError> {
    let comm = wire.comm()?;
    let (raw, stream) = (comm.raw(), Arc::clone(comm.stream()));
    stream
        .context()
        .bind_to_thread()
        .map_err(cuda("binding the GPU"))?;
    let cu = stream.cu_stream();
    let nccl_stream = cu as cudaStream_t;
    let bytes_type = ncclDataType_t::ncclUint8;
    // The headers travel through small device staging buffers on the communicator's stream.
    let staged = if send_headers.is_empty() {
        None
    } else {
        Some(
            stream
                .clone_htod(send_headers)
                .map_err(cuda("staging the message headers"))?,
        )
    };
    let landing = if recv_headers == 0 {
        None
    } else {
        // SAFETY: written by the header receives before it is read.
        Some(
            unsafe { stream.alloc::<u8>(recv_headers) }
                .map_err(cuda("allocating the header receive buffer"))?,
        )
    };
    let staged_ptr = staged.as_ref().map(|b| b.device_ptr(&stream).0);
    let landing_ptr = landing.as_ref().map(|b| b.device_ptr(&stream).0);
    let missing = || LinkError::Failed("a header transfer without a header buffer".into());
    let group = GroupGuard::start().map_err(nccl("ncclGroupStart"))?;
    for call in calls {
        // SAFETY (every call below): the send and receive buffers are live CubeCL
        // allocations pinned by the caller's `ManagedResource`s, and the header buffers live
        // in this frame, until the stream's work is done or the communicator is aborted
        // (`wait` below); `check_p2p_bounds` proved every length inside its buffer; `raw` is
        // this group's communicator, used under the group's lock only.
        // (send?, device address, bytes, peer) of the call, or a local copy.
        let (is_send, at, bytes, peer) = match *call {
            P2pCall::SendHeader { peer, send } => (
                true,
                staged_ptr.ok_or_else(missing)? + (send * header) as u64,
                header,
                peer,
            ),
            P2pCall::Send { peer, send, bytes } => (true, src[send], bytes, peer),
            P2pCall::RecvHeader { peer, recv } => (
                false,
                landing_ptr.ok_or_else(missing)? + (recv * header) as u64,
                header,
                peer,
            ),
            P2pCall::Recv { peer, recv, bytes } => (false, dst[recv], bytes, peer),
            P2pCall::Copy { send, recv, bytes } => {
                // Stream-ordered with the group's transfers on the same stream.
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(dst[recv], src[send], bytes, cu)
                }
                .map_err(cuda("a device-to-device copy"))?;
                continue;
            }
        };
        let peer = peer as i32;
        if is_send {
            unsafe {
                cudarc::nccl::result::send(
                    at as *const _,
                    bytes,
                    bytes_type,
                    peer,
                    raw,
                    nccl_stream,
                )
            }
            .map_err(nccl("ncclSend"))?;
        } else {
            unsafe {
                cudarc::nccl::result::recv(at as *mut _, bytes, bytes_type, peer, raw, nccl_stream)
            }
            .map_err(nccl("ncclRecv"))?;
        }
    }
    group.end().map_err(nccl("ncclGroupEnd"))?;
    wire.wait(peers, deadline)?;
    match &landing {
        Some(buf) => stream
            .clone_dtoh(buf)
            .map_err(cuda("copying the received headers to the host")),
        None => Ok(Vec::new()),
    }
}

/// A CUDA tensor's data on the host (the host-staged lone `send`).
fn read(t: CubeTensor, op: &'static str, group: &str) -> Result<TensorData> {
    match burn::tensor::try_read_sync(CubeBackend::float_into_data(t)) {
        Some(Ok(data)) => Ok(data),
        Some(Err(e)) => Err(BackendError::Collective {
            op,
            group: group.to_string(),
            detail: format!("reading the CUDA tensor failed: {e:?}"),
        }),
        None => Err(BackendError::Collective {
            op,
            group: group.to_string(),
            detail: "the CUDA backend cannot read tensors synchronously".into(),
        }),
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        Communicator::rank(&self.p2p)
    }

    fn ranks(&self) -> &[usize] {
        Communicator::ranks(&self.p2p)
    }

    fn all_reduce(&self, data: TensorData, op: ReduceOp, site: CallSite) -> Result<TensorData> {
        Communicator::all_reduce(&self.p2p, data, op, site)
    }

    fn all_gather_v(&self, data: TensorData, site: CallSite) -> Result<(TensorData, Vec<usize>)> {
        Communicator::all_gather_v(&self.p2p, data, site)
    }

    fn reduce_scatter_v(
        &self,
        data: TensorData,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<TensorData> {
        Communicator::reduce_scatter_v(&self.p2p, data, splits, op, site)
    }

    fn all_to_all_v(
        &self,
        data: TensorData,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<TensorData> {
        Communicator::all_to_all_v(&self.p2p, data, send_splits, recv_splits, site)
    }

    fn broadcast(&self, data: TensorData, root: usize, site: CallSite) -> Result<TensorData> {
        Communicator::broadcast(&self.p2p, data, root, site)
    }

    fn send(&self, data: TensorData, dst: usize, site: CallSite) -> Result<()> {
        Communicator::send(&self.p2p, data, dst, site)
    }

    fn recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        site: CallSite,
    ) -> Result<TensorData> {
        Communicator::recv(&self.p2p, shape, dtype, src, site)
    }

    fn barrier(&self, site: CallSite) -> Result<()> {
        Communicator::barrier(&self.p2p, site)
    }

    fn traffic(&self) -> Traffic {
        Communicator::traffic(&self.p2p)
    }

    fn device(&self) -> Option<&dyn DeviceCommunicator> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use burn::tensor::{Int, Tensor, TensorData};

    use super::super::{NcclConfig, nccl_ctx, probe_libraries};
    use super::*;
    use crate::comm::{CallSite, World, buffer};

    fn site() -> CallSite {
        std::panic::Location::caller()
    }

    /// `f` on the threads transport (a world of one).
    fn threads<T: Send>(f: impl Fn(&dyn Communicator) -> Result<T> + Sync) -> Result<T> {
        let mut out = World::run(1, |c| f(c.world()?.communicator().as_ref()));
        out.remove(0)
    }

    /// Rows 0..rows of 3 values of `dtype` (integers as i64 first).
    fn data(rows: usize, dtype: DType) -> TensorData {
        let values: Vec<f32> = (0..rows * 3)
            .map(|i| (i % 13) as f32 - 6.0 + if dtype.is_float() { 0.5 } else { 0.0 })
            .collect();
        TensorData::new(values, [rows, 3]).convert_dtype(dtype)
    }

    /// Every collective of the device path on CUDA tensors of every dtype the step uses,
    /// through the real libnccl at world size 1 (a group of one still runs NCCL's kernels and
    /// the device plumbing: pointers, allocation, stream ordering, the wait), against the
    /// threads transport's results.
    ///
    /// Needs an NVIDIA GPU, libcuda and `libnccl.so` (see the module docs of `nccl`); run
    /// with `cargo test -p moe-backend --features cuda,nccl --lib gpu_device_collectives --
    /// --ignored` (benches/gpu/run.sh, case `nccl_device`).
    #[test]
    #[ignore = "needs an NVIDIA GPU, libcuda and libnccl.so"]
    fn gpu_device_collectives_world_of_one() {
        probe_libraries().expect("libcuda and libnccl.so");
        let device = burn::tensor::Device::cuda(0);
        let results = World::run(1, |boot| {
            let config = NcclConfig {
                timeout: Duration::from_secs(60),
                local_rank: Some(0),
            };
            let ctx = nccl_ctx(boot, config)?;
            let world = ctx.world()?;
            let dc = world.communicator().device().expect("a device path");
            assert!(dc.accepts(BufferKind::Cuda) && dc.accepts(BufferKind::Host));
            let mut checked = 0;
            for dtype in [DType::F32, DType::BF16, DType::F16, DType::I64, DType::I32] {
                let input = data(5, dtype);
                let on_gpu = || {
                    if dtype.is_float() {
                        buffer::take(Tensor::<2>::from_data(input.clone(), (&device, dtype)))
                    } else {
                        buffer::take(Tensor::<2, Int>::from_data(input.clone(), (&device, dtype)))
                    }
                    .expect("a CUDA buffer")
                };
                let back = |buf: DeviceBuffer| -> TensorData {
                    let DeviceBuffer::Cuda(t) = buf else {
                        panic!("the result left the GPU")
                    };
                    read(t, "test", "[0]").unwrap()
                };
                let mut ops = vec![ReduceOp::Sum, ReduceOp::Max];
                if dtype.is_float() {
                    ops.push(ReduceOp::Mean);
                }
                for op in ops {
                    let (buf, _) = on_gpu();
                    let got = back(dc.all_reduce(buf, op, site())?);
                    let want = threads(|r| r.all_reduce(input.clone(), op, site()))?;
                    assert_eq!(got, want, "all_reduce {op:?} {dtype:?}");
                    let (buf, _) = on_gpu();
                    let got = back(dc.reduce_scatter_v(buf, &[5], op, site())?);
                    let want = threads(|r| r.reduce_scatter_v(input.clone(), &[5], op, site()))?;
                    assert_eq!(got, want, "reduce_scatter_v {op:?} {dtype:?}");
                    checked += 2;
                }
                let (buf, _) = on_gpu();
                let (got, sizes) = dc.all_gather_v(buf, site())?;
                let (want, want_sizes) = threads(|r| r.all_gather_v(input.clone(), site()))?;
                assert_eq!(
                    (back(got), sizes),
                    (want, want_sizes),
                    "all_gather_v {dtype:?}"
                );
                let (buf, _) = on_gpu();
                let got = back(dc.all_to_all_v(buf, &[5], &[5], site())?);
                let want = threads(|r| r.all_to_all_v(input.clone(), &[5], &[5], site()))?;
                assert_eq!(got, want, "all_to_all_v {dtype:?}");
                let (buf, _) = on_gpu();
                let got = back(dc.broadcast(buf, 0, site())?);
                assert_eq!(got, threads(|r| r.broadcast(input.clone(), 0, site()))?);
                // Point-to-point to itself (host-staged for CUDA tensors).
                let (buf, _) = on_gpu();
                dc.send(buf, 0, site())?;
                let (like, _) = on_gpu();
                let got = back(dc.recv(&[5, 3], dtype, 0, &like, site())?);
                assert_eq!(got, input, "send/recv {dtype:?}");
                // The batched exchange on the device buffers (a message to itself: a
                // device-to-device copy after the host header check).
                let (buf, _) = on_gpu();
                let (like, _) = on_gpu();
                let spec = RecvSpec {
                    shape: vec![5, 3],
                    dtype,
                    src: 0,
                };
                let mut got = dc.send_recv(vec![(buf, 0)], &[spec], &like, site())?;
                assert_eq!(back(got.remove(0)), input, "send_recv {dtype:?}");
                // A bad argument is the host path's typed error, before any NCCL call.
                let (buf, _) = on_gpu();
                let err = dc.reduce_scatter_v(buf, &[4], ReduceOp::Sum, site());
                assert!(
                    matches!(err, Err(BackendError::Collective { .. })),
                    "{err:?}"
                );
                checked += 5;
            }
            eprintln!("nccl_device: {checked} collectives on CUDA tensors matched the threads");
            Ok(())
        });
        results.into_iter().for_each(|r| r.unwrap());
    }
}
