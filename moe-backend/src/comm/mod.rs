//! SPMD communication: the [`Communicator`] transport trait, the [`Comm`] tensor-level handle
//! with differentiable collectives, and the in-process [`World`] whose ranks are threads.
//!
//! # Layers
//!
//! - [`Communicator`] moves host [`TensorData`] between the members of one process group. It is
//!   object safe and knows nothing about autodiff. The `local` module implements it with shared memory
//!   between threads; every collective checks that all members called the same collective with
//!   consistent arguments and reports disagreements naming the ranks and call sites.
//! - [`Comm`] wraps an `Arc<dyn Communicator>` and works on Burn tensors of any kind (float in
//!   any float dtype, int, bool). Float collectives are differentiable on autodiff devices: the
//!   backward of each collective is its transpose ([`autograd`]): `all_to_all_v` ↔
//!   `all_to_all_v` with swapped splits, `all_gather` ↔ `reduce_scatter`, `all_reduce` has the
//!   identity backward of the replicated-sum convention used by tensor parallelism. The
//!   Megatron region ops (`copy_to_tensor_parallel_region`, ...) are in [`autograd`].
//!
//! # Semantics
//!
//! Every collective is called by every member of the group, in the same order (SPMD). Results
//! are identical on every rank: reductions sum in group-member order (floats accumulate in f32,
//! or f64 for f64, and round once). A rank that fails or panics makes every pending and later
//! collective of the other ranks return [`BackendError::Aborted`]; a collective that waits
//! longer than the world's timeout returns [`BackendError::Timeout`] (and aborts the world).
//! Errors raised inside a backward pass cannot be returned through Burn's `backward()`, so a
//! failing collective there panics with the error message; [`World::run`] turns the panic into
//! that rank's error and aborts the other ranks' collectives.
//!
//! # Devices
//!
//! Tensors may live on any device (Flex, or a Cube device with feature `cube`). When the
//! transport offers a [`DeviceCommunicator`] for the tensor's buffer
//! ([`Communicator::device`]), a group of several members runs the collective on the
//! tensor's own storage ([`DeviceBuffer`], module `buffer`): the threads and the
//! point-to-point transports (TCP, MPI, NCCL host-staged) do so for CPU (Flex) tensors.
//! Otherwise the tensor is read back, passed to the [`Communicator`] and the result uploaded
//! to the tensor's device ([`Comm::host_transfers`] counts these transfers). A group of one
//! member never touches the host: every collective returns its input (after the same
//! argument checks), so a single-rank run stays on the device.
//!
//! # Transports
//!
//! - [`World`]: ranks as threads of one process (tests, the embedded default).
//! - [`tcp::TcpWorld`]: one process per rank over TCP, started torchrun-style (`RANK`,
//!   `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`; see [`launch`]).
//! - `mpi::MpiWorld` (feature `mpi`): one process per rank over MPI (`mpirun`, `srun`).
//! - `nccl::nccl_ctx` (feature `nccl`): NCCL communicators per group, bootstrapped over a host
//!   transport; host-staged for now (tensors pass through host memory).
//!
//! Every one hands the rank closure a [`RankCtx`]; the process transports build each
//! collective from point-to-point messages (module `p2p`) with the in-process world's argument
//! checks and reduction order, so results are bit for bit those of the threads.

pub mod autograd;
mod buffer;
mod ctx;
mod data;
pub mod launch;
mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
// Used by the NCCL device path (features `cuda` and `nccl`); tested on every build.
#[cfg_attr(not(all(feature = "cuda", feature = "nccl")), allow(dead_code))]
pub(crate) mod nccl_plan;
pub(crate) mod p2p;
pub mod tcp;
#[cfg(test)]
mod tests;

use std::fmt;
use std::panic::Location;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::{Bool, DType, Device, Float, Int, Tensor, TensorData};

use crate::error::{BackendError, Result};

pub use buffer::{BufferKind, DeviceBuffer, DeviceCommunicator};
pub use ctx::{GroupComms, RankCtx};
pub use local::{World, WorldConfig};

/// Where a collective was called from (`#[track_caller]`).
pub type CallSite = &'static Location<'static>;

/// Reduction applied by `all_reduce` / `reduce_scatter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise sum divided by the group size (floats only).
    Mean,
    /// Element-wise maximum (NaN wins).
    Max,
}

/// What [`Comm::vote`] agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vote {
    /// Per flag: whether any member raised it.
    pub raised: Vec<bool>,
    /// The lowest member index (in the group) that raised any flag.
    pub first: Option<usize>,
}

/// A receive of a batched point-to-point exchange ([`Communicator::send_recv`]): the next
/// tensor member `src` sends, which must have `shape` and `dtype`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvSpec {
    /// Expected shape.
    pub shape: Vec<usize>,
    /// Expected element type.
    pub dtype: DType,
    /// The sending member.
    pub src: usize,
}

/// How the in-process [`World`]'s point-to-point `send` completes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PointToPoint {
    /// Buffered (the TCP and MPI transports' behaviour): a send returns at once; the message
    /// waits in the receiver's queue.
    #[default]
    Buffered,
    /// Rendezvous (NCCL's behaviour): a send completes only when the receiver has posted the
    /// matching receive, and a batch ([`Communicator::send_recv`]) when every send in it has
    /// been received and every receive filled. A program that relies on buffering (a rank
    /// that sends before it receives while its peer does the same, each waiting for its own
    /// send) then waits until the timeout — which is how the tests prove that the pipeline's
    /// batched exchanges cannot deadlock on NCCL.
    Rendezvous,
}

/// Bytes a member has addressed to the other members of its group (payload only: a ring or
/// tree algorithm may move more on the wire).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Collectives and sends issued.
    pub calls: u64,
    /// Payload bytes addressed to other members.
    pub bytes_sent: u64,
}

/// Transport of one process group: collectives on host tensor data.
///
/// `rank()` is this member's index in [`ranks`](Communicator::ranks) (global ranks in group
/// order). All tensors are split and concatenated along dim 0. Every member must call the same
/// collectives in the same order.
pub trait Communicator: Send + Sync + fmt::Debug {
    /// This member's index in the group.
    fn rank(&self) -> usize;
    /// Global ranks of the group, in member order.
    fn ranks(&self) -> &[usize];
    /// Number of members.
    fn size(&self) -> usize {
        self.ranks().len()
    }
    /// Element-wise reduction over all members; every member gets the result.
    fn all_reduce(&self, data: TensorData, op: ReduceOp, site: CallSite) -> Result<TensorData>;
    /// Concatenation of every member's rows along dim 0 (row counts may differ), with the
    /// row count of each member.
    fn all_gather_v(&self, data: TensorData, site: CallSite) -> Result<(TensorData, Vec<usize>)>;
    /// Rows `splits[j]` (consecutive blocks of dim 0, one per member) reduced over members;
    /// member `j` gets block `j`. Every member must pass the same `splits`.
    fn reduce_scatter_v(
        &self,
        data: TensorData,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<TensorData>;
    /// Block `j` of `send_splits` goes to member `j`; the output concatenates the blocks
    /// received from members `0..size` in order, of `recv_splits` rows. `recv_splits[i]` must
    /// equal member `i`'s `send_splits[rank]`.
    fn all_to_all_v(
        &self,
        data: TensorData,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<TensorData>;
    /// Member `root`'s data on every member (every member passes a tensor of the same shape
    /// and dtype; non-root values are ignored).
    fn broadcast(&self, data: TensorData, root: usize, site: CallSite) -> Result<TensorData>;
    /// Sends `data` to member `dst` (buffered: returns without waiting for the receive).
    fn send(&self, data: TensorData, dst: usize, site: CallSite) -> Result<()>;
    /// Receives the next tensor member `src` sent, which must have `shape` and `dtype`.
    fn recv(&self, shape: &[usize], dtype: DType, src: usize, site: CallSite)
    -> Result<TensorData>;
    /// Sends and receives issued together (Megatron's `batch_isend_irecv`): every tensor of
    /// `sends` goes to its member (as [`send`](Communicator::send)), and one tensor is
    /// received per entry of `recvs` (as [`recv`](Communicator::recv)); all complete before it
    /// returns, the received tensors in the order of `recvs`. Messages between two members
    /// are matched in the order each posts them (sends in the order of `sends`, receives in
    /// the order of `recvs`). On a transport whose sends are rendezvous (NCCL) the batch
    /// completes when every peer has posted the counterparts, so two members that exchange
    /// in one batch each never wait on the other's send. The default (buffered transports)
    /// sends, then receives.
    fn send_recv(
        &self,
        sends: Vec<(TensorData, usize)>,
        recvs: &[RecvSpec],
        site: CallSite,
    ) -> Result<Vec<TensorData>> {
        for (data, dst) in sends {
            self.send(data, dst, site)?;
        }
        recvs
            .iter()
            .map(|r| self.recv(&r.shape, r.dtype, r.src, site))
            .collect()
    }
    /// Returns once every member has entered the barrier.
    fn barrier(&self, site: CallSite) -> Result<()>;
    /// Traffic issued by this member so far (transports that do not count report zeros).
    fn traffic(&self) -> Traffic {
        Traffic::default()
    }
    /// The transport's collectives on device buffers ([`DeviceCommunicator`]), if it has
    /// them; [`Comm`] uses them for tensors whose buffers they
    /// [accept](DeviceCommunicator::accepts) and stages the others through the host.
    fn device(&self) -> Option<&dyn DeviceCommunicator> {
        None
    }
}

/// Tensor kinds the collectives accept; float collectives are differentiable.
pub trait CollectiveKind: burn::tensor::kind::Basic + Sized {
    /// Whether `tensor` is tracked by autodiff (always false for int and bool tensors).
    #[doc(hidden)]
    fn tracked<const D: usize>(_tensor: &Tensor<D, Self>) -> bool {
        false
    }

    /// Attaches `output` to `input`'s autodiff graph with `grad` as backward (floats only).
    #[doc(hidden)]
    fn link<const D: usize>(
        input: Tensor<D, Self>,
        output: Tensor<D, Self>,
        grad: autograd::GradCollective,
    ) -> Tensor<D, Self>;
}

impl CollectiveKind for Float {
    fn tracked<const D: usize>(tensor: &Tensor<D, Self>) -> bool {
        tensor.is_require_grad()
    }

    fn link<const D: usize>(
        input: Tensor<D, Self>,
        output: Tensor<D, Self>,
        grad: autograd::GradCollective,
    ) -> Tensor<D, Self> {
        autograd::link(input, output, grad)
    }
}

impl CollectiveKind for Int {
    fn link<const D: usize>(
        _: Tensor<D, Self>,
        output: Tensor<D, Self>,
        _: autograd::GradCollective,
    ) -> Tensor<D, Self> {
        output
    }
}

impl CollectiveKind for Bool {
    fn link<const D: usize>(
        _: Tensor<D, Self>,
        output: Tensor<D, Self>,
        _: autograd::GradCollective,
    ) -> Tensor<D, Self> {
        output
    }
}

/// A process-group handle working on Burn tensors.
#[derive(Clone, Debug)]
pub struct Comm {
    inner: Arc<dyn Communicator>,
    /// Host transfers made by the host-staged path (shared by the clones).
    staged: Arc<AtomicU64>,
}

fn to_tensor<const D: usize, K: CollectiveKind>(data: TensorData, device: &Device) -> Tensor<D, K> {
    let dtype = data.dtype();
    Tensor::from_data(data, (device, dtype))
}

impl Comm {
    /// Wraps a transport.
    pub fn new(inner: Arc<dyn Communicator>) -> Self {
        Self {
            inner,
            staged: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Host transfers of the host-staged path so far on this group (every read of a tensor
    /// into host [`TensorData`] and every upload of a result, in collectives and their
    /// backward passes). The device-buffer path ([`DeviceCommunicator`]) makes none.
    pub fn host_transfers(&self) -> u64 {
        self.staged.load(Ordering::Relaxed)
    }

    /// Reads `tensor` to the host (counted).
    fn read<const D: usize, K: CollectiveKind>(&self, tensor: &Tensor<D, K>) -> TensorData {
        self.staged.fetch_add(1, Ordering::Relaxed);
        tensor.to_data()
    }

    /// Uploads host `data` to `device` (counted).
    fn upload<const D: usize, K: CollectiveKind>(
        &self,
        data: TensorData,
        device: &Device,
    ) -> Tensor<D, K> {
        self.staged.fetch_add(1, Ordering::Relaxed);
        to_tensor(data, device)
    }

    /// Runs a collective on `tensor`: `on_device` on its buffer when the transport takes
    /// buffers of its device (no host transfer), else `on_host` on its host data (read back,
    /// then the result uploaded to the tensor's device). Returns the (untracked) result and
    /// `on_*`'s extra output.
    fn run<const D: usize, K: CollectiveKind, X>(
        &self,
        tensor: &Tensor<D, K>,
        on_device: impl FnOnce(&dyn DeviceCommunicator, DeviceBuffer) -> Result<(DeviceBuffer, X)>,
        on_host: impl FnOnce(&dyn Communicator, TensorData) -> Result<(TensorData, X)>,
    ) -> Result<(Tensor<D, K>, X)> {
        if let Some(dc) = self.inner.device()
            && let Some((buf, wrap)) = buffer::take(tensor.clone())
            && dc.accepts(buf.kind())
        {
            let (out, extra) = on_device(dc, buf)?;
            return Ok((wrap.wrap(out), extra));
        }
        let (out, extra) = on_host(self.inner.as_ref(), self.read(tensor))?;
        Ok((self.upload(out, &tensor.device()), extra))
    }

    /// [`Comm::run`] on a backend primitive (the backward passes of [`autograd`]).
    pub(crate) fn run_primitive<B: burn::backend::Backend>(
        &self,
        grad: burn::backend::tensor::FloatTensor<B>,
        on_device: impl FnOnce(&dyn DeviceCommunicator, DeviceBuffer) -> Result<DeviceBuffer>,
        on_host: impl FnOnce(&dyn Communicator, TensorData) -> Result<TensorData>,
    ) -> Result<burn::backend::tensor::FloatTensor<B>> {
        use burn::backend::TensorMetadata;
        let grad = match buffer::primitive_buffer::<B>(grad) {
            Ok(buf) => match self.inner.device() {
                Some(dc) if dc.accepts(buf.kind()) => {
                    return buffer::buffer_primitive::<B>(on_device(dc, buf)?);
                }
                _ => buffer::buffer_primitive::<B>(buf)?,
            },
            Err(grad) => grad,
        };
        let device = grad.device();
        self.staged.fetch_add(1, Ordering::Relaxed);
        let data = match burn::tensor::try_read_sync(B::float_into_data(grad)) {
            Some(Ok(data)) => data,
            Some(Err(e)) => {
                return Err(BackendError::Collective {
                    op: "backward",
                    group: self.group_name(),
                    detail: format!("reading the gradient failed: {e:?}"),
                });
            }
            None => {
                return Err(BackendError::Collective {
                    op: "backward",
                    group: self.group_name(),
                    detail: "the backend cannot read tensors synchronously".into(),
                });
            }
        };
        let out = on_host(self.inner.as_ref(), data)?;
        self.staged.fetch_add(1, Ordering::Relaxed);
        Ok(B::float_from_data(out, &device))
    }

    /// The transport.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.inner
    }

    /// This member's index in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank()
    }

    /// Number of members.
    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Global ranks of the group, in member order.
    pub fn ranks(&self) -> &[usize] {
        self.inner.ranks()
    }

    fn check_differentiable<const D: usize, K: CollectiveKind>(
        &self,
        op: &'static str,
        tensor: &Tensor<D, K>,
        reduce: ReduceOp,
        site: CallSite,
    ) -> Result<()> {
        if reduce == ReduceOp::Max && K::tracked(tensor) {
            return Err(BackendError::Collective {
                op,
                group: self.group_name(),
                detail: format!(
                    "max reduction of a tensor that requires grad is not differentiable (at {site}); detach it first"
                ),
            });
        }
        Ok(())
    }

    /// Whether the group has one member: every collective is then the identity and runs
    /// without a host round trip.
    fn single(&self) -> bool {
        self.size() == 1
    }

    /// Argument check of a single-member collective taking dim-0 `splits` (one entry, the
    /// row count).
    fn check_single_splits<const D: usize, K: CollectiveKind>(
        &self,
        op: &'static str,
        tensor: &Tensor<D, K>,
        what: &str,
        splits: &[usize],
        site: CallSite,
    ) -> Result<()> {
        let rows = tensor.dims().first().copied();
        if D == 0 || splits.len() != 1 || Some(splits[0]) != rows {
            return Err(BackendError::Collective {
                op,
                group: self.group_name(),
                detail: format!(
                    "{what} {splits:?} for 1 member and a tensor of shape {:?} (at {site})",
                    tensor.dims()
                ),
            });
        }
        Ok(())
    }

    pub(crate) fn group_name(&self) -> String {
        format!("{:?}", self.inner.ranks())
    }

    /// Element-wise reduction over the group. Backward (floats): identity for `Sum` (the
    /// replicated-sum convention of tensor parallelism: each rank's loss depends on the sum),
    /// `1/size` for `Mean`; `Max` is not differentiable and returns an error on a tensor that
    /// requires grad.
    #[track_caller]
    pub fn all_reduce<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<D, K>> {
        let site = Location::caller();
        self.check_differentiable("all_reduce", &tensor, op, site)?;
        if self.single() {
            return Ok(tensor);
        }
        let (out, ()) = self.run(
            &tensor,
            |dc, buf| Ok((dc.all_reduce(buf, op, site)?, ())),
            |c, data| Ok((c.all_reduce(data, op, site)?, ())),
        )?;
        let grad = match op {
            ReduceOp::Sum => autograd::GradCollective::Identity,
            ReduceOp::Mean => autograd::GradCollective::Scale(1.0 / self.size() as f64),
            ReduceOp::Max => autograd::GradCollective::NotDifferentiable("all_reduce(max)"),
        };
        Ok(K::link(tensor, out, grad))
    }

    /// Agreement on boolean flags (one collective, on `device`, the caller's compute device):
    /// which of `local`'s flags any member raised, and the lowest member index that raised one.
    /// Every member gets the same answer, e.g. to refuse a step on every rank when one rank saw
    /// a non-finite value. The values travel as f32 (member indices are exact below 2²⁴).
    #[track_caller]
    pub fn vote(&self, local: &[bool], device: &burn::tensor::Device) -> Result<Vote> {
        let size = self.size();
        // Per flag 0/1, then `size − index` where this member raised any (the maximum names
        // the lowest such member).
        let mut values: Vec<f32> = local.iter().map(|&b| f32::from(u8::from(b))).collect();
        values.push(if local.iter().any(|&b| b) {
            (size - self.rank()) as f32
        } else {
            0.0
        });
        let n = values.len();
        let t = Tensor::<1>::from_data(burn::tensor::TensorData::new(values, [n]), device);
        let agreed: Vec<f32> = self
            .all_reduce(t, ReduceOp::Max)?
            .into_data()
            .iter::<f32>()
            .collect();
        let lowest = agreed.last().copied().unwrap_or(0.0);
        Ok(Vote {
            raised: agreed.iter().take(local.len()).map(|&v| v > 0.0).collect(),
            first: (lowest > 0.0).then(|| size - lowest as usize),
        })
    }

    /// Concatenation along dim 0 of every member's tensor; all members must have the same row
    /// count. Backward: reduce-scatter (sum) of the gradient.
    #[track_caller]
    pub fn all_gather<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
    ) -> Result<Tensor<D, K>> {
        let site = Location::caller();
        let (out, sizes) = self.all_gather_v_at(tensor, site)?;
        if sizes.windows(2).any(|w| w[0] != w[1]) {
            return Err(BackendError::Collective {
                op: "all_gather",
                group: self.group_name(),
                detail: format!(
                    "members passed different row counts {sizes:?} (use all_gather_v), called at {site}"
                ),
            });
        }
        Ok(out)
    }

    /// Concatenation along dim 0 of every member's rows (counts may differ), and the count of
    /// each member. Backward: reduce-scatter (sum) with those counts.
    #[track_caller]
    pub fn all_gather_v<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
    ) -> Result<(Tensor<D, K>, Vec<usize>)> {
        self.all_gather_v_at(tensor, Location::caller())
    }

    fn all_gather_v_at<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        site: CallSite,
    ) -> Result<(Tensor<D, K>, Vec<usize>)> {
        if self.single() {
            if D == 0 {
                return Err(BackendError::Collective {
                    op: "all_gather",
                    group: self.group_name(),
                    detail: format!("a 0-d tensor has no dim 0 (at {site})"),
                });
            }
            let rows = tensor.dims().first().copied().unwrap_or(0);
            return Ok((tensor, vec![rows]));
        }
        let (out, sizes) = self.run(
            &tensor,
            |dc, buf| dc.all_gather_v(buf, site),
            |c, data| c.all_gather_v(data, site),
        )?;
        let grad = autograd::GradCollective::ReduceScatter {
            comm: self.clone(),
            splits: sizes.clone(),
            site,
        };
        Ok((K::link(tensor, out, grad), sizes))
    }

    /// Reduction over the group of equal blocks of dim 0; member `j` gets block `j` (dim 0
    /// must divide by the group size). Backward: all-gather of the gradient (scaled by
    /// `1/size` for `Mean`; `Max` is not differentiable).
    #[track_caller]
    pub fn reduce_scatter<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<D, K>> {
        let site = Location::caller();
        let rows = tensor.dims().first().copied().unwrap_or(1);
        let n = self.size();
        if rows % n != 0 {
            return Err(BackendError::Collective {
                op: "reduce_scatter",
                group: self.group_name(),
                detail: format!(
                    "{rows} rows do not divide over {n} members (use reduce_scatter_v), called at {site}"
                ),
            });
        }
        self.reduce_scatter_v_at(tensor, &vec![rows / n; n], op, site)
    }

    /// Reduction over the group of the dim-0 blocks `splits` (one per member, identical on
    /// every member); member `j` gets block `j`. Backward as [`Comm::reduce_scatter`].
    #[track_caller]
    pub fn reduce_scatter_v<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        splits: &[usize],
        op: ReduceOp,
    ) -> Result<Tensor<D, K>> {
        self.reduce_scatter_v_at(tensor, splits, op, Location::caller())
    }

    fn reduce_scatter_v_at<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<Tensor<D, K>> {
        self.check_differentiable("reduce_scatter", &tensor, op, site)?;
        if self.single() {
            self.check_single_splits("reduce_scatter", &tensor, "splits", splits, site)?;
            return Ok(tensor);
        }
        let (out, ()) = self.run(
            &tensor,
            |dc, buf| Ok((dc.reduce_scatter_v(buf, splits, op, site)?, ())),
            |c, data| Ok((c.reduce_scatter_v(data, splits, op, site)?, ())),
        )?;
        let grad = match op {
            ReduceOp::Max => autograd::GradCollective::NotDifferentiable("reduce_scatter(max)"),
            _ => autograd::GradCollective::AllGather {
                comm: self.clone(),
                scale: if op == ReduceOp::Mean {
                    1.0 / self.size() as f64
                } else {
                    1.0
                },
                site,
            },
        };
        Ok(K::link(tensor, out, grad))
    }

    /// Variable all-to-all along dim 0: block `j` of `send_splits` goes to member `j`; the
    /// result has the blocks from members `0..size` in order (`recv_splits` rows each).
    /// Backward: the all-to-all with the splits swapped.
    #[track_caller]
    pub fn all_to_all_v<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Tensor<D, K>> {
        let site = Location::caller();
        if self.single() {
            const OP: &str = "all_to_all_v";
            self.check_single_splits(OP, &tensor, "send_splits", send_splits, site)?;
            self.check_single_splits(OP, &tensor, "recv_splits", recv_splits, site)?;
            return Ok(tensor);
        }
        let (out, ()) = self.run(
            &tensor,
            |dc, buf| Ok((dc.all_to_all_v(buf, send_splits, recv_splits, site)?, ())),
            |c, data| Ok((c.all_to_all_v(data, send_splits, recv_splits, site)?, ())),
        )?;
        let grad = autograd::GradCollective::AllToAll {
            comm: self.clone(),
            send_splits: recv_splits.to_vec(),
            recv_splits: send_splits.to_vec(),
            site,
        };
        Ok(K::link(tensor, out, grad))
    }

    /// Member `root`'s tensor on every member (all pass the same shape). Backward: the
    /// gradients of all members summed onto `root` (zero elsewhere).
    #[track_caller]
    pub fn broadcast<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        root: usize,
    ) -> Result<Tensor<D, K>> {
        let site = Location::caller();
        if self.single() {
            if root != 0 {
                return Err(BackendError::Collective {
                    op: "broadcast",
                    group: self.group_name(),
                    detail: format!("root {root} out of range for 1 member (at {site})"),
                });
            }
            return Ok(tensor);
        }
        let (out, ()) = self.run(
            &tensor,
            |dc, buf| Ok((dc.broadcast(buf, root, site)?, ())),
            |c, data| Ok((c.broadcast(data, root, site)?, ())),
        )?;
        let grad = autograd::GradCollective::ReduceToRoot {
            comm: self.clone(),
            root,
            site,
        };
        Ok(K::link(tensor, out, grad))
    }

    /// Sends `tensor` to member `dst` (not differentiable).
    #[track_caller]
    pub fn send<const D: usize, K: CollectiveKind>(
        &self,
        tensor: Tensor<D, K>,
        dst: usize,
    ) -> Result<()> {
        let site = Location::caller();
        if let Some(dc) = self.inner.device()
            && let Some((buf, _)) = buffer::take(tensor.clone())
            && dc.accepts(buf.kind())
        {
            return dc.send(buf, dst, site);
        }
        self.staged.fetch_add(1, Ordering::Relaxed);
        self.inner.send(tensor.into_data(), dst, site)
    }

    /// Receives a tensor of `shape` and `dtype` from member `src` onto `device` (not
    /// differentiable).
    #[track_caller]
    pub fn recv<const D: usize, K: CollectiveKind>(
        &self,
        shape: [usize; D],
        dtype: DType,
        src: usize,
        device: &Device,
    ) -> Result<Tensor<D, K>> {
        let site = Location::caller();
        if let Some(dc) = self.inner.device()
            && let Some((like, wrap)) = buffer::Rewrap::of_device::<K>(device)
            && dc.accepts(like.kind())
        {
            return Ok(wrap.wrap(dc.recv(&shape, dtype, src, &like, site)?));
        }
        let data = self.inner.recv(&shape, dtype, src, site)?;
        Ok(self.upload(data, device))
    }

    /// Sends and receives issued together, as Megatron's `_batched_p2p_ops`
    /// (`torch.distributed.batch_isend_irecv`): each `(tensor, dst)` of `sends` goes to member
    /// `dst`, and one tensor is received per entry of `recvs` (shape, dtype, source member)
    /// onto `device`; everything completes before it returns (see
    /// [`Communicator::send_recv`] for the matching order). On a transport with a device path
    /// for the tensors' buffers (NCCL on CUDA tensors, the host transports on Flex tensors)
    /// the batch moves the tensors' own storage: one NCCL group of `ncclSend`/`ncclRecv`, no
    /// host copy. Not differentiable.
    #[track_caller]
    pub fn send_recv<const D: usize, K: CollectiveKind>(
        &self,
        sends: Vec<(Tensor<D, K>, usize)>,
        recvs: &[([usize; D], DType, usize)],
        device: &Device,
    ) -> Result<Vec<Tensor<D, K>>> {
        let site = Location::caller();
        let specs: Vec<RecvSpec> = recvs
            .iter()
            .map(|(shape, dtype, src)| RecvSpec {
                shape: shape.to_vec(),
                dtype: *dtype,
                src: *src,
            })
            .collect();
        if let Some(dc) = self.inner.device()
            && let Some((like, wrap)) = buffer::Rewrap::of_device::<K>(device)
            && dc.accepts(like.kind())
        {
            let mut bufs = Vec::with_capacity(sends.len());
            for (tensor, dst) in &sends {
                match buffer::take(tensor.clone()) {
                    Some((buf, _)) if buf.kind() == like.kind() => bufs.push((buf, *dst)),
                    _ => break,
                }
            }
            if bufs.len() == sends.len() {
                let got = dc.send_recv(bufs, &specs, &like, site)?;
                return Ok(got.into_iter().map(|b| wrap.wrap(b)).collect());
            }
        }
        let data: Vec<(TensorData, usize)> = sends
            .into_iter()
            .map(|(t, dst)| {
                self.staged.fetch_add(1, Ordering::Relaxed);
                (t.into_data(), dst)
            })
            .collect();
        let got = self.inner.send_recv(data, &specs, site)?;
        Ok(got.into_iter().map(|d| self.upload(d, device)).collect())
    }

    /// Payload traffic this member has issued on the group so far.
    pub fn traffic(&self) -> Traffic {
        self.inner.traffic()
    }

    /// Returns once every member has reached the barrier.
    #[track_caller]
    pub fn barrier(&self) -> Result<()> {
        self.inner.barrier(Location::caller())
    }
}
