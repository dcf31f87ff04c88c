//! The device-buffer path of the collectives: [`DeviceBuffer`] (a tensor's storage on its
//! device, taken out of the Burn tensor without reading it back) and [`DeviceCommunicator`]
//! (a transport's collectives on such buffers).
//!
//! Megatron hands `torch.distributed` the tensors themselves, and NCCL reads and writes their
//! device memory; only the split sizes travel through the host. [`Comm`](super::Comm) does the
//! same when its transport offers a [`DeviceCommunicator`] for the tensors' device
//! ([`Communicator::device`](super::Communicator::device)): the tensor's primitive is taken out
//! of Burn's dispatch layer (no `to_data`), handed to the transport, and the result primitive
//! is wrapped again (no `from_data`). Transports without one take the host-staged path
//! (`to_data` → [`Communicator`](super::Communicator) → `from_data`).
//!
//! Which buffers each transport takes:
//! - the threads ([`World`](super::World)) and the process transports built on point-to-point
//!   links (TCP, MPI, NCCL host-staged) take [`DeviceBuffer::Host`]: on the CPU backend the
//!   device memory is host memory, so the transport reads the Flex tensor's own bytes (blocks
//!   of it are shared with the other threads without a copy, or written to the socket from
//!   it) and the result becomes a Flex tensor over the bytes the transport assembled;
//! - NCCL (features `cuda` and `nccl`) takes `DeviceBuffer::Cuda`: the CubeCL tensor's device
//!   pointer goes to `ncclAllReduce` & co. (module `nccl`).
//!
//! The host transports implement both traits with one set of collectives on byte views
//! ([`HostBuffer`]), so the device path runs the very code, argument checks and reduction
//! order of the host path: results are bit for bit the same.

use std::any::Any;
use std::fmt;
use std::ops::Range;

use burn::backend::tensor::FloatTensor;
use burn::backend::{
    AutodiffBackend, BackendTensor, DispatchAutodiffContext, DispatchTensor, DispatchTensorKind,
    Flex,
};
use burn::tensor::{Bytes, DType, Device, Tensor, TensorData, kind::Basic};
use burn_flex::{FlexTensor, Layout};

use super::{CallSite, Communicator, RecvSpec, ReduceOp, Traffic};
use crate::error::Result;

/// A tensor's storage on its device, moved by a [`DeviceCommunicator`] without a round trip
/// through host [`TensorData`].
#[derive(Clone, Debug)]
// The CubeCL tensor is large; a buffer lives for one collective, as Burn's own dispatch enum
// holds these tensors unboxed.
#[allow(clippy::large_enum_variant)]
pub enum DeviceBuffer {
    /// A tensor of the CPU backend (Flex): its device memory is host memory.
    Host(FlexTensor),
    /// A tensor of Burn's CubeCL backend on a CUDA device (features `cuda` and `nccl`).
    #[cfg(all(feature = "cuda", feature = "nccl"))]
    Cuda(burn_cubecl::tensor::CubeTensor),
}

/// The kind of memory a [`DeviceBuffer`] lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BufferKind {
    /// Host memory (the CPU backend).
    Host,
    /// CUDA device memory.
    Cuda,
}

impl DeviceBuffer {
    /// Where the buffer lives.
    pub fn kind(&self) -> BufferKind {
        match self {
            DeviceBuffer::Host(_) => BufferKind::Host,
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            DeviceBuffer::Cuda(_) => BufferKind::Cuda,
        }
    }

    /// The tensor's shape.
    pub fn shape(&self) -> Vec<usize> {
        use burn::backend::TensorMetadata;
        match self {
            DeviceBuffer::Host(t) => t.shape().to_vec(),
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            DeviceBuffer::Cuda(t) => t.shape().to_vec(),
        }
    }

    /// The tensor's element type.
    pub fn dtype(&self) -> DType {
        match self {
            DeviceBuffer::Host(t) => t.dtype(),
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            DeviceBuffer::Cuda(t) => t.dtype,
        }
    }
}

/// Collectives of one process group on [`DeviceBuffer`]s: the same semantics, argument checks
/// and error promises as [`Communicator`] (a member that fails, exits or does not join within
/// the timeout makes the others' calls return [`BackendError::Aborted`] /
/// [`BackendError::Timeout`] / [`BackendError::Collective`], never hang), on the tensors'
/// own storage. Every member of a group must take the same path for a collective (the
/// [`Comm`](super::Comm) picks it from the tensor's device, which is the same on every
/// member of a job).
///
/// [`BackendError::Aborted`]: crate::BackendError::Aborted
/// [`BackendError::Timeout`]: crate::BackendError::Timeout
/// [`BackendError::Collective`]: crate::BackendError::Collective
pub trait DeviceCommunicator: Send + Sync + fmt::Debug {
    /// Whether this transport moves buffers of `kind`.
    fn accepts(&self, kind: BufferKind) -> bool;
    /// As [`Communicator::all_reduce`].
    fn all_reduce(&self, buf: DeviceBuffer, op: ReduceOp, site: CallSite) -> Result<DeviceBuffer>;
    /// As [`Communicator::all_gather_v`].
    fn all_gather_v(&self, buf: DeviceBuffer, site: CallSite)
    -> Result<(DeviceBuffer, Vec<usize>)>;
    /// As [`Communicator::reduce_scatter_v`].
    fn reduce_scatter_v(
        &self,
        buf: DeviceBuffer,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<DeviceBuffer>;
    /// As [`Communicator::all_to_all_v`] (NCCL: grouped send/recv).
    fn all_to_all_v(
        &self,
        buf: DeviceBuffer,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<DeviceBuffer>;
    /// As [`Communicator::broadcast`].
    fn broadcast(&self, buf: DeviceBuffer, root: usize, site: CallSite) -> Result<DeviceBuffer>;
    /// As [`Communicator::send`].
    fn send(&self, buf: DeviceBuffer, dst: usize, site: CallSite) -> Result<()>;
    /// As [`Communicator::recv`], into a buffer like `like` (its kind and device; its shape
    /// and dtype are not used).
    fn recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        like: &DeviceBuffer,
        site: CallSite,
    ) -> Result<DeviceBuffer>;
    /// As [`Communicator::send_recv`]: the buffers of `sends` go to their members and one
    /// buffer like `like` is received per entry of `recvs`, all issued together (NCCL: one
    /// group of `ncclSend`/`ncclRecv` on the buffers). The default sends, then receives (the
    /// buffered transports).
    fn send_recv(
        &self,
        sends: Vec<(DeviceBuffer, usize)>,
        recvs: &[RecvSpec],
        like: &DeviceBuffer,
        site: CallSite,
    ) -> Result<Vec<DeviceBuffer>> {
        for (buf, dst) in sends {
            self.send(buf, dst, site)?;
        }
        recvs
            .iter()
            .map(|r| self.recv(&r.shape, r.dtype, r.src, like, site))
            .collect()
    }
}

// ---------------------------------------------------------------------------------------
// Tensors in and out of buffers.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Float,
    Int,
    Bool,
}

/// How to wrap a buffer into a tensor again: the tensor kind and its autodiff context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rewrap {
    tag: Tag,
    autodiff: DispatchAutodiffContext,
}

/// The buffer of `tensor` (consumed; tensors are reference-counted, so pass a clone to keep
/// it) and how to wrap a result like it, or `None` when its backend has no device-buffer
/// path here (the caller takes the host path). A tracked float gives its value (the
/// autodiff graph stays with the caller's tensor).
pub(crate) fn take<const D: usize, K: Basic>(
    tensor: Tensor<D, K>,
) -> Option<(DeviceBuffer, Rewrap)> {
    let DispatchTensor { kind, autodiff } = tensor.into_dispatch();
    let (buf, tag) = match kind {
        DispatchTensorKind::Flex(t) => host_of(t)?,
        DispatchTensorKind::Autodiff(inner) => match *inner {
            DispatchTensorKind::Flex(BackendTensor::Autodiff(t)) => {
                (DeviceBuffer::Host(t.into_primitive()), Tag::Float)
            }
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            DispatchTensorKind::Cube(BackendTensor::Autodiff(t)) => {
                (cuda_of(t.into_primitive())?, Tag::Float)
            }
            #[allow(unreachable_patterns)]
            _ => return None,
        },
        #[cfg(all(feature = "cuda", feature = "nccl"))]
        DispatchTensorKind::Cube(t) => {
            let (t, tag) = match t {
                BackendTensor::Float(t) => (t, Tag::Float),
                BackendTensor::Int(t) => (t, Tag::Int),
                BackendTensor::Bool(t) => (t, Tag::Bool),
                _ => return None,
            };
            (cuda_of(t)?, tag)
        }
        #[allow(unreachable_patterns)]
        _ => return None,
    };
    Some((buf, Rewrap { tag, autodiff }))
}

fn host_of(t: BackendTensor<Flex>) -> Option<(DeviceBuffer, Tag)> {
    Some(match t {
        BackendTensor::Float(t) => (DeviceBuffer::Host(t), Tag::Float),
        BackendTensor::Int(t) => (DeviceBuffer::Host(t), Tag::Int),
        BackendTensor::Bool(t) => (DeviceBuffer::Host(t), Tag::Bool),
        _ => return None,
    })
}

/// A CubeCL tensor's buffer when it lives on a CUDA device.
#[cfg(all(feature = "cuda", feature = "nccl"))]
fn cuda_of(t: burn_cubecl::tensor::CubeTensor) -> Option<DeviceBuffer> {
    matches!(t.device, burn_cubecl::CubeDevice::Cuda(_)).then_some(DeviceBuffer::Cuda(t))
}

/// The buffer of a backend float primitive (a backward pass's gradient), or the primitive
/// back when its backend has no device-buffer path here.
pub(crate) fn primitive_buffer<B: burn::backend::Backend>(
    grad: FloatTensor<B>,
) -> std::result::Result<DeviceBuffer, FloatTensor<B>> {
    let any: Box<dyn Any> = Box::new(grad);
    let any = match any.downcast::<FlexTensor>() {
        Ok(t) => return Ok(DeviceBuffer::Host(*t)),
        Err(any) => any,
    };
    #[cfg(all(feature = "cuda", feature = "nccl"))]
    let any = match any.downcast::<burn_cubecl::tensor::CubeTensor>() {
        Ok(t) if matches!(t.device, burn_cubecl::CubeDevice::Cuda(_)) => {
            return Ok(DeviceBuffer::Cuda(*t));
        }
        Ok(t) => t as Box<dyn Any>,
        Err(any) => any,
    };
    match any.downcast::<FloatTensor<B>>() {
        Ok(t) => Err(*t),
        // Unreachable: `any` was made from a `FloatTensor<B>` and only other types were
        // taken out above.
        Err(_) => unreachable!("a float primitive changed type"),
    }
}

/// The float primitive of backend `B` holding `buf` (the inverse of [`primitive_buffer`]).
pub(crate) fn buffer_primitive<B: burn::backend::Backend>(
    buf: DeviceBuffer,
) -> Result<FloatTensor<B>> {
    let kind = buf.kind();
    let any: Box<dyn Any> = match buf {
        DeviceBuffer::Host(t) => Box::new(t),
        #[cfg(all(feature = "cuda", feature = "nccl"))]
        DeviceBuffer::Cuda(t) => Box::new(t),
    };
    any.downcast::<FloatTensor<B>>()
        .map(|t| *t)
        .map_err(|_| crate::BackendError::Collective {
            op: "backward",
            group: String::new(),
            detail: format!(
                "a {kind:?} buffer is not a float tensor of the gradient's backend {}",
                std::any::type_name::<B>()
            ),
        })
}

impl Rewrap {
    /// How a tensor of kind `K` on `device` is wrapped (for receives), or `None` when the
    /// device has no device-buffer path here. Probes with an empty tensor (no data).
    pub(crate) fn of_device<K: Basic>(device: &Device) -> Option<(DeviceBuffer, Rewrap)> {
        take(Tensor::<1, K>::empty([0], device))
    }

    /// `buf` as a tensor of the kind and autodiff context recorded (untracked: the caller
    /// links it to the input's graph).
    pub(crate) fn wrap<const D: usize, K: Basic>(self, buf: DeviceBuffer) -> Tensor<D, K> {
        let enabled = matches!(self.autodiff, DispatchAutodiffContext::Enabled(_));
        let kind = match buf {
            DeviceBuffer::Host(t) => {
                match self.tag {
                    Tag::Float if enabled => DispatchTensorKind::Autodiff(Box::new(
                        DispatchTensorKind::Flex(BackendTensor::Autodiff(
                            <burn::backend::Autodiff<Flex> as AutodiffBackend>::from_inner(t),
                        )),
                    )),
                    Tag::Float => DispatchTensorKind::Flex(BackendTensor::Float(t)),
                    Tag::Int => DispatchTensorKind::Flex(BackendTensor::Int(t)),
                    Tag::Bool => DispatchTensorKind::Flex(BackendTensor::Bool(t)),
                }
            }
            #[cfg(all(feature = "cuda", feature = "nccl"))]
            DeviceBuffer::Cuda(t) => match self.tag {
                Tag::Float if enabled => DispatchTensorKind::Autodiff(Box::new(
                    DispatchTensorKind::Cube(BackendTensor::Autodiff(<burn::backend::Autodiff<
                        burn_cubecl::CubeBackend,
                    > as AutodiffBackend>::from_inner(
                        t
                    ))),
                )),
                Tag::Float => DispatchTensorKind::Cube(BackendTensor::Float(t)),
                Tag::Int => DispatchTensorKind::Cube(BackendTensor::Int(t)),
                Tag::Bool => DispatchTensorKind::Cube(BackendTensor::Bool(t)),
            },
        };
        Tensor::from_dispatch(DispatchTensor {
            kind,
            autodiff: self.autodiff,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Host buffers: what the host transports move.

enum Owner {
    Data(TensorData),
    Flex(FlexTensor),
    Bytes(Vec<u8>),
}

/// A contiguous host tensor seen as bytes, whoever owns them: host [`TensorData`] (the
/// host-staged path), a Flex tensor's storage (the device path on the CPU) or bytes a
/// collective assembled. Converting to either side is free when the bytes are unshared.
pub(crate) struct HostBuffer {
    owner: Owner,
    range: Range<usize>,
    shape: Vec<usize>,
    dtype: DType,
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl HostBuffer {
    /// Host tensor data (the host-staged path).
    pub(crate) fn from_data(data: TensorData) -> Self {
        let shape = data.shape().to_vec();
        let dtype = data.dtype();
        let len = data.as_bytes().len();
        Self {
            owner: Owner::Data(data),
            range: 0..len,
            shape,
            dtype,
        }
    }

    /// A Flex tensor's own storage (copied only when the tensor is a non-contiguous view).
    pub(crate) fn from_flex(t: FlexTensor) -> Self {
        let t = if t.layout().contiguous_offsets().is_some() {
            t
        } else {
            t.to_contiguous()
        };
        let elem = t.dtype().size();
        let (start, end) = t.layout().contiguous_offsets().unwrap_or((0, 0));
        let shape = t.layout().shape().to_vec();
        let dtype = t.dtype();
        Self {
            owner: Owner::Flex(t),
            range: start * elem..end * elem,
            shape,
            dtype,
        }
    }

    /// Bytes a collective assembled.
    pub(crate) fn from_bytes(bytes: Vec<u8>, shape: Vec<usize>, dtype: DType) -> Self {
        let len = bytes.len();
        Self {
            owner: Owner::Bytes(bytes),
            range: 0..len,
            shape,
            dtype,
        }
    }

    /// Another handle on the same bytes: free for a Flex storage (reference-counted,
    /// copy-on-write), a copy otherwise.
    pub(crate) fn duplicate(&self) -> HostBuffer {
        match &self.owner {
            Owner::Flex(t) => HostBuffer {
                owner: Owner::Flex(t.clone()),
                range: self.range.clone(),
                shape: self.shape.clone(),
                dtype: self.dtype,
            },
            _ => HostBuffer::from_bytes(self.bytes().to_vec(), self.shape.clone(), self.dtype),
        }
    }

    /// The concatenation of whole-row byte blocks along dim 0 (`rows` rows of `trailing`).
    pub(crate) fn concat<'a>(
        parts: impl IntoIterator<Item = &'a [u8]>,
        rows: usize,
        trailing: &[usize],
        dtype: DType,
    ) -> HostBuffer {
        let row_bytes = trailing.iter().product::<usize>() * dtype.size();
        let mut bytes = Vec::with_capacity(rows * row_bytes);
        for part in parts {
            bytes.extend_from_slice(part);
        }
        let mut shape = Vec::with_capacity(trailing.len() + 1);
        shape.push(rows);
        shape.extend_from_slice(trailing);
        HostBuffer::from_bytes(bytes, shape, dtype)
    }

    /// The element bytes, row-major.
    pub(crate) fn bytes(&self) -> &[u8] {
        let all: &[u8] = match &self.owner {
            Owner::Data(d) => d.as_bytes(),
            Owner::Flex(t) => t.bytes(),
            Owner::Bytes(b) => b,
        };
        &all[self.range.clone()]
    }

    /// The shape.
    pub(crate) fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Rows (dim 0; a 0-d tensor counts as one) and bytes per row.
    pub(crate) fn rows_and_row_bytes(&self) -> (usize, usize) {
        let elem = self.dtype.size();
        match self.shape.split_first() {
            Some((&rows, rest)) => (rows, rest.iter().product::<usize>() * elem),
            None => (1, elem),
        }
    }

    /// Trailing dims (after dim 0).
    pub(crate) fn trailing(&self) -> &[usize] {
        self.shape.get(1..).unwrap_or_default()
    }

    /// Consecutive byte ranges (relative to [`bytes`](Self::bytes)) of `splits` rows each.
    pub(crate) fn row_ranges(&self, splits: &[usize]) -> Vec<Range<usize>> {
        let (_, row_bytes) = self.rows_and_row_bytes();
        let mut start = 0;
        splits
            .iter()
            .map(|&n| {
                let r = start..start + n * row_bytes;
                start = r.end;
                r
            })
            .collect()
    }

    /// As host tensor data (no copy unless the bytes are a shared Flex storage).
    pub(crate) fn into_data(self) -> TensorData {
        match self.owner {
            Owner::Data(d) => d,
            Owner::Bytes(b) => TensorData::from_bytes_vec(b, self.shape, self.dtype),
            Owner::Flex(t) => t.into_data(),
        }
    }

    /// As a Flex tensor (no copy from assembled bytes or a Flex storage).
    pub(crate) fn into_flex(self) -> FlexTensor {
        match self.owner {
            Owner::Flex(t) => t,
            Owner::Bytes(b) => FlexTensor::new(
                Bytes::from_bytes_vec(b),
                Layout::contiguous(self.shape.into()),
                self.dtype,
            ),
            Owner::Data(d) => FlexTensor::from_data(d),
        }
    }
}

/// The collectives of a host transport on [`HostBuffer`]s. Implementing it gives the
/// transport both [`Communicator`] (host [`TensorData`]) and [`DeviceCommunicator`] (Flex
/// buffers) with one code path.
pub(crate) trait HostCollectives: Send + Sync + fmt::Debug {
    /// This member's index.
    fn member(&self) -> usize;
    /// Global ranks of the group, in member order.
    fn members(&self) -> &[usize];
    /// See [`Communicator::all_reduce`].
    fn host_all_reduce(&self, buf: HostBuffer, op: ReduceOp, site: CallSite) -> Result<HostBuffer>;
    /// See [`Communicator::all_gather_v`].
    fn host_all_gather_v(
        &self,
        buf: HostBuffer,
        site: CallSite,
    ) -> Result<(HostBuffer, Vec<usize>)>;
    /// See [`Communicator::reduce_scatter_v`].
    fn host_reduce_scatter_v(
        &self,
        buf: HostBuffer,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<HostBuffer>;
    /// See [`Communicator::all_to_all_v`].
    fn host_all_to_all_v(
        &self,
        buf: HostBuffer,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<HostBuffer>;
    /// See [`Communicator::broadcast`].
    fn host_broadcast(&self, buf: HostBuffer, root: usize, site: CallSite) -> Result<HostBuffer>;
    /// See [`Communicator::send`].
    fn host_send(&self, buf: HostBuffer, dst: usize, site: CallSite) -> Result<()>;
    /// See [`Communicator::recv`].
    fn host_recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        site: CallSite,
    ) -> Result<HostBuffer>;
    /// See [`Communicator::send_recv`] (default: sends, then receives).
    fn host_send_recv(
        &self,
        sends: Vec<(HostBuffer, usize)>,
        recvs: &[RecvSpec],
        site: CallSite,
    ) -> Result<Vec<HostBuffer>> {
        for (buf, dst) in sends {
            self.host_send(buf, dst, site)?;
        }
        recvs
            .iter()
            .map(|r| self.host_recv(&r.shape, r.dtype, r.src, site))
            .collect()
    }
    /// See [`Communicator::barrier`].
    fn host_barrier(&self, site: CallSite) -> Result<()>;
    /// See [`Communicator::traffic`].
    fn host_traffic(&self) -> Traffic;
}

impl<T: HostCollectives> Communicator for T {
    fn rank(&self) -> usize {
        self.member()
    }

    fn ranks(&self) -> &[usize] {
        self.members()
    }

    fn all_reduce(&self, data: TensorData, op: ReduceOp, site: CallSite) -> Result<TensorData> {
        self.host_all_reduce(HostBuffer::from_data(data), op, site)
            .map(HostBuffer::into_data)
    }

    fn all_gather_v(&self, data: TensorData, site: CallSite) -> Result<(TensorData, Vec<usize>)> {
        let (out, sizes) = self.host_all_gather_v(HostBuffer::from_data(data), site)?;
        Ok((out.into_data(), sizes))
    }

    fn reduce_scatter_v(
        &self,
        data: TensorData,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<TensorData> {
        self.host_reduce_scatter_v(HostBuffer::from_data(data), splits, op, site)
            .map(HostBuffer::into_data)
    }

    fn all_to_all_v(
        &self,
        data: TensorData,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<TensorData> {
        self.host_all_to_all_v(HostBuffer::from_data(data), send_splits, recv_splits, site)
            .map(HostBuffer::into_data)
    }

    fn broadcast(&self, data: TensorData, root: usize, site: CallSite) -> Result<TensorData> {
        self.host_broadcast(HostBuffer::from_data(data), root, site)
            .map(HostBuffer::into_data)
    }

    fn send(&self, data: TensorData, dst: usize, site: CallSite) -> Result<()> {
        self.host_send(HostBuffer::from_data(data), dst, site)
    }

    fn recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        site: CallSite,
    ) -> Result<TensorData> {
        self.host_recv(shape, dtype, src, site)
            .map(HostBuffer::into_data)
    }

    fn send_recv(
        &self,
        sends: Vec<(TensorData, usize)>,
        recvs: &[RecvSpec],
        site: CallSite,
    ) -> Result<Vec<TensorData>> {
        let sends = sends
            .into_iter()
            .map(|(d, dst)| (HostBuffer::from_data(d), dst))
            .collect();
        let got = self.host_send_recv(sends, recvs, site)?;
        Ok(got.into_iter().map(HostBuffer::into_data).collect())
    }

    fn barrier(&self, site: CallSite) -> Result<()> {
        self.host_barrier(site)
    }

    fn traffic(&self) -> Traffic {
        self.host_traffic()
    }

    fn device(&self) -> Option<&dyn DeviceCommunicator> {
        Some(self)
    }
}

/// The host buffer of a device buffer this transport accepts (callers check
/// [`DeviceCommunicator::accepts`] first; another kind is a typed error, not a panic).
fn host(buf: DeviceBuffer, op: &'static str, group: &[usize]) -> Result<HostBuffer> {
    match buf {
        DeviceBuffer::Host(t) => Ok(HostBuffer::from_flex(t)),
        #[allow(unreachable_patterns)]
        other => Err(crate::BackendError::Collective {
            op,
            group: format!("{group:?}"),
            detail: format!(
                "a host transport cannot move a {:?} device buffer",
                other.kind()
            ),
        }),
    }
}

fn dev(buf: HostBuffer) -> DeviceBuffer {
    DeviceBuffer::Host(buf.into_flex())
}

impl<T: HostCollectives> DeviceCommunicator for T {
    fn accepts(&self, kind: BufferKind) -> bool {
        kind == BufferKind::Host
    }

    fn all_reduce(&self, buf: DeviceBuffer, op: ReduceOp, site: CallSite) -> Result<DeviceBuffer> {
        let buf = host(buf, "all_reduce", self.members())?;
        self.host_all_reduce(buf, op, site).map(dev)
    }

    fn all_gather_v(
        &self,
        buf: DeviceBuffer,
        site: CallSite,
    ) -> Result<(DeviceBuffer, Vec<usize>)> {
        let buf = host(buf, "all_gather", self.members())?;
        let (out, sizes) = self.host_all_gather_v(buf, site)?;
        Ok((dev(out), sizes))
    }

    fn reduce_scatter_v(
        &self,
        buf: DeviceBuffer,
        splits: &[usize],
        op: ReduceOp,
        site: CallSite,
    ) -> Result<DeviceBuffer> {
        let buf = host(buf, "reduce_scatter", self.members())?;
        self.host_reduce_scatter_v(buf, splits, op, site).map(dev)
    }

    fn all_to_all_v(
        &self,
        buf: DeviceBuffer,
        send_splits: &[usize],
        recv_splits: &[usize],
        site: CallSite,
    ) -> Result<DeviceBuffer> {
        let buf = host(buf, "all_to_all_v", self.members())?;
        self.host_all_to_all_v(buf, send_splits, recv_splits, site)
            .map(dev)
    }

    fn broadcast(&self, buf: DeviceBuffer, root: usize, site: CallSite) -> Result<DeviceBuffer> {
        let buf = host(buf, "broadcast", self.members())?;
        self.host_broadcast(buf, root, site).map(dev)
    }

    fn send(&self, buf: DeviceBuffer, dst: usize, site: CallSite) -> Result<()> {
        let buf = host(buf, "send", self.members())?;
        self.host_send(buf, dst, site)
    }

    fn recv(
        &self,
        shape: &[usize],
        dtype: DType,
        src: usize,
        like: &DeviceBuffer,
        site: CallSite,
    ) -> Result<DeviceBuffer> {
        if like.kind() != BufferKind::Host {
            return Err(crate::BackendError::Collective {
                op: "recv",
                group: format!("{:?}", self.members()),
                detail: format!(
                    "a host transport cannot receive into a {:?} device buffer",
                    like.kind()
                ),
            });
        }
        self.host_recv(shape, dtype, src, site).map(dev)
    }

    fn send_recv(
        &self,
        sends: Vec<(DeviceBuffer, usize)>,
        recvs: &[RecvSpec],
        like: &DeviceBuffer,
        site: CallSite,
    ) -> Result<Vec<DeviceBuffer>> {
        if like.kind() != BufferKind::Host {
            return Err(crate::BackendError::Collective {
                op: "send_recv",
                group: format!("{:?}", self.members()),
                detail: format!(
                    "a host transport cannot receive into a {:?} device buffer",
                    like.kind()
                ),
            });
        }
        let sends = sends
            .into_iter()
            .map(|(b, dst)| Ok((host(b, "send_recv", self.members())?, dst)))
            .collect::<Result<Vec<_>>>()?;
        let got = self.host_send_recv(sends, recvs, site)?;
        Ok(got.into_iter().map(dev).collect())
    }
}
