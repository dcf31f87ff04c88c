//! Device memory of CubeCL CUDA tensors handed to CUDA libraries (features `cuda`; used by the
//! NCCL transport's device path, `comm/nccl/device.rs`, and the cuBLAS grouped GEMM,
//! `ops/cube/gemm_cublas.rs`), the way PyTorch hands a tensor's `data_ptr()` to NCCL / cuBLAS.
//!
//! - **Pointers**: CubeCL's storage hands out a tensor's device address
//!   (`client.get_resource::<CudaServer>` → `GpuResource::ptr`); the returned [`DevicePtr`]
//!   holds CubeCL's managed resource, so the allocation is neither freed, reused nor moved
//!   while the foreign library may touch it.
//! - **Stream ordering**: CubeCL does not expose its stream for an event wait, so its pending
//!   work is finished on the host ([`finish_pending`], `client.sync()`) before the library
//!   reads the buffers, and the caller waits for the library's stream before CubeCL's next
//!   kernel reads the results (NCCL: an event polled up to the deadline; cuBLAS: a stream
//!   synchronisation). Two host waits per call.

use burn_cubecl::cubecl::cuda::CudaRuntime;
use burn_cubecl::cubecl::prelude::Client;
use burn_cubecl::cubecl::server::Handle;
use cubecl_runtime::runtime::Runtime;

/// CubeCL's CUDA server: the storage whose resources carry device pointers.
type CudaServer = <CudaRuntime as Runtime>::Server;

/// A device address of a CubeCL allocation, valid (pinned in place) while this value lives.
pub(crate) struct DevicePtr {
    /// The device address of the allocation's first byte.
    pub(crate) ptr: u64,
    /// CubeCL's managed resource: holding it keeps the allocation in place.
    _held: Box<dyn std::any::Any>,
}

/// The device address of `handle` on `client` (a CUDA client), held until the result drops;
/// a CubeCL failure (e.g. a buffer a failed launch never wrote) is described.
pub(crate) fn device_ptr(client: &Client, handle: &Handle) -> Result<DevicePtr, String> {
    let resource = client
        .get_resource::<CudaServer>(handle.clone())
        .map_err(|e| format!("CubeCL gave no device pointer: {e:?}"))?;
    Ok(DevicePtr {
        ptr: resource.resource().ptr,
        _held: Box::new(resource),
    })
}

/// Finishes CubeCL's pending work on `client` (every kernel and upload issued so far).
pub(crate) fn finish_pending(client: &Client) -> Result<(), String> {
    burn_cubecl::cubecl::future::block_on(client.sync())
        .map_err(|e| format!("CubeCL's pending work failed: {e:?}"))
}
