//! The cuBLAS grouped-GEMM candidate ([`CubeGemmKernel::Cublas`](super::CubeGemmKernel),
//! feature `cuda`): fprop, dgrad and wgrad of the Cube backend's grouped GEMM on CUDA tensors
//! through cuBLAS, as Megatron-Core's `GroupedMLP` does through `grouped_gemm` /
//! cuBLAS(Lt) (one GEMM per expert) and PyTorch's `torch._grouped_mm`.
//!
//! One call of an op:
//! 1. the group sizes are read to the host (cuBLAS takes `m`, `n`, `k` per problem on the host;
//!    the expert layer has them there already, so this read costs one small transfer);
//! 2. the calls are planned and checked on the host (`ops/cublas_plan.rs`: the row-major ↔
//!    column-major mapping, leading dimensions, bounds; tested on the CPU);
//! 3. the output is allocated by the tensor's CubeCL client (zeroed where the plan has ranges no
//!    call writes: the weight gradients of empty groups); device pointers come from CubeCL's
//!    storage, held for the call (`crate::cuda_mem`);
//! 4. **one `cublasGemmGroupedBatchedEx`** (cuBLAS ≥ 12.5; problems of equal shape share a
//!    cuBLAS group; the `A`/`B`/`C` pointer arrays are uploaded through the CubeCL client),
//!    or, where the library lacks that symbol or refuses the call (a
//!    `CUBLAS_STATUS_NOT_SUPPORTED` is remembered for the process), one `cublasGemmEx` per
//!    non-empty group. Operands BF16 / F16 / F32 (`A`, `B`, `C` in the
//!    tensors' dtype), `CUBLAS_COMPUTE_32F` (f32 accumulation, no TF32), `alpha = 1`,
//!    `beta = 0`;
//! 5. stream ordering as the NCCL device path's: CubeCL's pending work is finished before
//!    cuBLAS reads, cuBLAS runs on this module's stream (one per GPU, with its handle) and the
//!    stream is synchronised before the output is handed back.
//!
//! Without libcublas (cudarc loads `libcublas.so` at first use), or when any CUDA / cuBLAS
//! step fails, the call returns [`Failure::Unavailable`] and the caller runs the automatic
//! kernel body with a warning: never a panic for a missing library.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use burn::backend::ops::IntTensorOps;
use burn::tensor::DType;
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys;
use cudarc::driver::{CudaContext, CudaStream};

use super::gemm::{CublasRoute, record_cublas_route};
use super::launch::empty_like_dtype;
use crate::cuda_mem::{self, DevicePtr};
use crate::error::BackendError;
use crate::ops::cublas_plan::{self, GroupedArgs, GroupedShape, Plan, Trans};

/// Why the cuBLAS candidate did not produce the output.
#[derive(Debug)]
pub(super) enum Failure {
    /// The library, the device or a cuBLAS call failed: run another body (with a warning).
    Unavailable(String),
    /// The inputs break the op's contract (group sizes that do not sum to the rows, negative
    /// sizes): the same error every body would meet.
    Input(BackendError),
}

type Outcome<T> = std::result::Result<T, Failure>;

fn unavailable(detail: impl Into<String>) -> Failure {
    Failure::Unavailable(detail.into())
}

/// What the loaded libcublas offers.
struct Library {
    /// `cublasGemmGroupedBatchedEx` is exported (cuBLAS ≥ 12.5).
    grouped: bool,
    /// `major.minor.patch`.
    version: String,
}

/// The library, loaded and probed once per process.
fn library() -> Outcome<&'static Library> {
    static LIB: OnceLock<std::result::Result<Library, String>> = OnceLock::new();
    LIB.get_or_init(load)
        .as_ref()
        .map_err(|e| unavailable(e.clone()))
}

fn load() -> std::result::Result<Library, String> {
    // SAFETY: only tries to open the candidate library names (without it, cudarc panics when
    // libcublas is missing).
    if !unsafe { sys::is_culib_present() } {
        return Err(
            "libcublas could not be loaded (cudarc looks for libcublas.so, \
                    libcublas.so.12, …, on the library path; benches/gpu/run.sh links the \
                    image's nvidia-cublas wheel as libcublas.so)"
                .into(),
        );
    }
    // SAFETY: the library is present (checked above), so `culib` opens it without panicking;
    // looking a symbol up calls nothing.
    let lib = unsafe { sys::culib() };
    let has = |name: &[u8]| unsafe { lib.get::<unsafe extern "C" fn()>(name) }.is_ok();
    for needed in [
        &b"cublasCreate_v2\0"[..],
        b"cublasSetStream_v2\0",
        b"cublasGemmEx\0",
        b"cublasGetProperty\0",
    ] {
        if !has(needed) {
            return Err(format!(
                "libcublas lacks {}",
                String::from_utf8_lossy(&needed[..needed.len() - 1])
            ));
        }
    }
    let grouped = has(b"cublasGemmGroupedBatchedEx\0");
    let mut parts = [0 as c_int; 3];
    for (part, which) in parts.iter_mut().zip([
        sys::libraryPropertyType::MAJOR_VERSION,
        sys::libraryPropertyType::MINOR_VERSION,
        sys::libraryPropertyType::PATCH_LEVEL,
    ]) {
        // SAFETY: writes one int through a valid pointer; the symbol exists (checked above).
        unsafe { sys::cublasGetProperty(which, part) }
            .result()
            .map_err(|e| format!("cublasGetProperty failed: {e}"))?;
    }
    Ok(Library {
        grouped,
        version: format!("{}.{}.{}", parts[0], parts[1], parts[2]),
    })
}

/// The loaded library in words (for benches and warnings), or why there is none.
pub(super) fn library_info() -> std::result::Result<String, String> {
    match library() {
        Ok(lib) => Ok(format!(
            "libcublas {}, cublasGemmGroupedBatchedEx {}",
            lib.version,
            if lib.grouped {
                "present"
            } else {
                "missing (per-group cublasGemmEx)"
            }
        )),
        Err(Failure::Unavailable(e)) => Err(e),
        Err(Failure::Input(e)) => Err(e.to_string()),
    }
}

/// A GPU's cuBLAS handle and the stream it runs on.
struct DeviceBlas {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
}

/// Handles per GPU ordinal, created on first use and kept for the process.
static DEVICES: Mutex<Vec<(usize, Arc<Mutex<DeviceBlas>>)>> = Mutex::new(Vec::new());

/// Set once `cublasGemmGroupedBatchedEx` answered `CUBLAS_STATUS_NOT_SUPPORTED`: later calls
/// go straight to the per-group route.
static GROUPED_REFUSED: AtomicBool = AtomicBool::new(false);

fn device_blas(ordinal: usize) -> Outcome<Arc<Mutex<DeviceBlas>>> {
    let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, d)) = devices.iter().find(|(o, _)| *o == ordinal) {
        return Ok(Arc::clone(d));
    }
    // The primary context of the GPU, which CubeCL's CUDA runtime uses too: the same address
    // space, so CubeCL's pointers are valid here.
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| unavailable(format!("CUDA context of GPU {ordinal}: {e}")))?;
    let stream = ctx
        .new_stream()
        .map_err(|e| unavailable(format!("a CUDA stream on GPU {ordinal}: {e}")))?;
    let blas = CudaBlas::new(Arc::clone(&stream))
        .map_err(|e| unavailable(format!("cublasCreate on GPU {ordinal}: {e}")))?;
    let d = Arc::new(Mutex::new(DeviceBlas { stream, blas }));
    devices.push((ordinal, Arc::clone(&d)));
    Ok(d)
}

/// cuBLAS's type of a tensor dtype (the candidate's dtypes).
pub(super) fn data_type(dtype: DType) -> Option<sys::cudaDataType_t> {
    match dtype {
        DType::F32 => Some(sys::cudaDataType_t::CUDA_R_32F),
        DType::F16 => Some(sys::cudaDataType_t::CUDA_R_16F),
        DType::BF16 => Some(sys::cudaDataType_t::CUDA_R_16BF),
        _ => None,
    }
}

fn op(t: Trans) -> sys::cublasOperation_t {
    match t {
        Trans::N => sys::cublasOperation_t::CUBLAS_OP_N,
        Trans::T => sys::cublasOperation_t::CUBLAS_OP_T,
    }
}

/// `v` as a cuBLAS `int` (the plan's check has bounded every value).
fn int(v: usize) -> Outcome<c_int> {
    c_int::try_from(v).map_err(|_| unavailable(format!("{v} exceeds cuBLAS's int range")))
}

/// The group sizes on the host, checked non-negative.
fn host_sizes(op: &'static str, sizes: &CubeTensor) -> Outcome<Vec<usize>> {
    let read = <CubeBackend as IntTensorOps<CubeBackend>>::int_into_data(sizes.clone());
    let data = burn_cubecl::cubecl::future::block_on(read)
        .map_err(|e| unavailable(format!("reading the group sizes failed: {e:?}")))?;
    let values = data
        .convert::<i64>()
        .try_into_vec::<i64>()
        .map_err(|e| unavailable(format!("reading the group sizes failed: {e:?}")))?;
    values
        .into_iter()
        .map(|v| {
            usize::try_from(v).map_err(|_| {
                Failure::Input(BackendError::Index {
                    op,
                    detail: format!("group size {v} is negative"),
                })
            })
        })
        .collect()
}

/// The output of `plan` (zeroed when the plan has ranges no call writes).
fn output<const D: usize>(like: &CubeTensor, plan: &Plan, shape: [usize; D]) -> CubeTensor {
    if plan.zero.is_empty() {
        empty_like_dtype(like, shape, like.dtype)
    } else {
        burn_cubecl::ops::numeric::zeros_client(
            like.client.clone(),
            like.device.clone(),
            burn::tensor::Shape::new(shape),
            like.dtype,
        )
    }
}

/// `moe_grouped_matmul` through cuBLAS: `x [n, k]` (contiguous), `w` contiguous `[G, m, k]`
/// (`transpose_weights`) or `[G, k, m]`, in `x`'s dtype.
pub(super) fn grouped_matmul(
    x: &CubeTensor,
    w: &CubeTensor,
    sizes: &CubeTensor,
    transpose_weights: bool,
    [n, k, m]: [usize; 3],
) -> Outcome<CubeTensor> {
    let op = "moe_grouped_matmul";
    let host = host_sizes(op, sizes)?;
    let shape = GroupedShape::Matmul {
        rows: n,
        k,
        m,
        transpose_weights,
    };
    let plan = cublas_plan::plan(op, shape, &host).map_err(Failure::Input)?;
    let out = output(x, &plan, [n, m]);
    // A is the weights, B is x.
    run(&plan, w, x, &out)?;
    Ok(out)
}

/// `moe_grouped_matmul_wgrad` through cuBLAS: `lhs [n, p]`, `rhs [n, q]` (contiguous, one
/// dtype), output `[G, p, q]`.
pub(super) fn grouped_matmul_wgrad(
    lhs: &CubeTensor,
    rhs: &CubeTensor,
    sizes: &CubeTensor,
    [n, p, q]: [usize; 3],
) -> Outcome<CubeTensor> {
    let op = "moe_grouped_matmul_wgrad";
    let host = host_sizes(op, sizes)?;
    let plan = cublas_plan::plan(op, GroupedShape::Wgrad { rows: n, p, q }, &host)
        .map_err(Failure::Input)?;
    let out = output(lhs, &plan, [host.len(), p, q]);
    // A is rhs, B is lhs.
    run(&plan, rhs, lhs, &out)?;
    Ok(out)
}

/// Issues `plan` with `a`, `b` and the output `c` (contiguous CUDA tensors of one dtype) and
/// waits for it.
fn run(plan: &Plan, a: &CubeTensor, b: &CubeTensor, c: &CubeTensor) -> Outcome<()> {
    if plan.calls.is_empty() {
        return Ok(());
    }
    let lib = library()?;
    let dt = data_type(c.dtype)
        .ok_or_else(|| unavailable(format!("cuBLAS is not used for {:?}", c.dtype)))?;
    let elem = c.dtype.size();
    for (what, t, len) in [
        ("A", a, plan.a_len),
        ("B", b, plan.b_len),
        ("C", c, plan.c_len),
    ] {
        if t.dtype != c.dtype || t.meta.shape().num_elements() != len {
            return Err(unavailable(format!(
                "internal: operand {what} has {} {:?} elements, the plan {len} {:?}",
                t.meta.shape().num_elements(),
                t.dtype,
                c.dtype
            )));
        }
    }
    plan.check()
        .map_err(|e| unavailable(format!("internal: {e}")))?;
    let ordinal = match &c.device {
        burn_cubecl::CubeDevice::Cuda(d) => d.index,
        other => return Err(unavailable(format!("{other:?} is not a CUDA device"))),
    };
    let device = device_blas(ordinal)?;
    let client = c.client.clone();
    let ptr = |t: &CubeTensor, what: &str| {
        cuda_mem::device_ptr(&client, &t.handle).map_err(|e| unavailable(format!("{e} ({what})")))
    };
    let (pa, pb, pc) = (ptr(a, "A")?, ptr(b, "B")?, ptr(c, "C")?);
    let addr = |base: &DevicePtr, offset: usize| base.ptr + (offset * elem) as u64;

    let grouped = lib.grouped && !GROUPED_REFUSED.load(Ordering::Relaxed);
    // The device pointer arrays of the grouped call, uploaded through CubeCL (finished by the
    // sync below) and held until the stream is done.
    let arrays = if grouped {
        let args = GroupedArgs::of(plan);
        let upload = |f: &dyn Fn(usize) -> u64| {
            let bytes: Vec<u8> = args
                .problems
                .iter()
                .flat_map(|&p| f(p).to_ne_bytes())
                .collect();
            let handle = client.create_from_slice(&bytes);
            cuda_mem::device_ptr(&client, &handle)
                .map(|p| (handle, p))
                .map_err(|e| unavailable(format!("{e} (pointer array)")))
        };
        let aa = upload(&|p| addr(&pa, plan.calls[p].a))?;
        let ba = upload(&|p| addr(&pb, plan.calls[p].b))?;
        let ca = upload(&|p| addr(&pc, plan.calls[p].c))?;
        Some((args, [aa, ba, ca]))
    } else {
        None
    };
    cuda_mem::finish_pending(&client).map_err(unavailable)?;

    let device = device.lock().unwrap_or_else(|e| e.into_inner());
    device
        .stream
        .context()
        .bind_to_thread()
        .map_err(|e| unavailable(format!("binding GPU {ordinal}: {e}")))?;
    let handle = *device.blas.handle();
    let mut route = CublasRoute::PerGroup;
    if let Some((args, [(_, aa), (_, ba), (_, ca)])) = &arrays {
        match grouped_call(handle, args, dt, [aa.ptr, ba.ptr, ca.ptr]) {
            Ok(()) => route = CublasRoute::Grouped,
            // A refusal (e.g. CUBLAS_STATUS_NOT_SUPPORTED for this device or dtype, or
            // INVALID_VALUE for operands a grouped kernel cannot take): the per-group calls
            // compute the same output; a NOT_SUPPORTED refusal is remembered.
            Err(e) => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                if e.contains("CUBLAS_STATUS_NOT_SUPPORTED") {
                    GROUPED_REFUSED.store(true, Ordering::Relaxed);
                }
                WARNED.call_once(|| {
                    eprintln!(
                        "warning: {e}; the cuBLAS grouped GEMM issues one cublasGemmEx per \
                         group instead"
                    )
                });
            }
        }
    }
    let issued = if route == CublasRoute::PerGroup {
        per_group_calls(handle, plan, dt, [&pa, &pb, &pc], elem)
    } else {
        Ok(())
    };
    // Wait for whatever was issued, even after an error: the buffers are released below.
    let waited = device
        .stream
        .synchronize()
        .map_err(|e| unavailable(format!("waiting for cuBLAS on GPU {ordinal}: {e}")));
    drop(arrays);
    drop((pa, pb, pc));
    issued?;
    waited?;
    record_cublas_route(route);
    Ok(())
}

/// One `cublasGemmGroupedBatchedEx` over the packed plan; `arrays` are the device addresses
/// of the `A`, `B`, `C` pointer arrays (in `args.problems` order). The error says why cuBLAS
/// refused.
fn grouped_call(
    handle: sys::cublasHandle_t,
    args: &GroupedArgs,
    dt: sys::cudaDataType_t,
    arrays: [u64; 3],
) -> std::result::Result<(), String> {
    let count = args.groups.len();
    let int = |v: usize| c_int::try_from(v).map_err(|_| format!("{v} exceeds cuBLAS's int range"));
    let ints = |f: &dyn Fn(usize) -> usize| -> std::result::Result<Vec<c_int>, String> {
        (0..count).map(|i| int(f(i))).collect()
    };
    let g = &args.groups;
    let transa: Vec<_> = g.iter().map(|k| op(k.transa)).collect();
    let transb: Vec<_> = g.iter().map(|k| op(k.transb)).collect();
    let (m, n, k) = (ints(&|i| g[i].m)?, ints(&|i| g[i].n)?, ints(&|i| g[i].k)?);
    let (lda, ldb, ldc) = (
        ints(&|i| g[i].lda)?,
        ints(&|i| g[i].ldb)?,
        ints(&|i| g[i].ldc)?,
    );
    let group_size = ints(&|i| args.group_size[i])?;
    // CUBLAS_COMPUTE_32F: f32 scalars, on the host (the handle's default pointer mode).
    let (alpha, beta) = (vec![1.0f32; count], vec![0.0f32; count]);
    // SAFETY: every host array has `count` entries; the pointer arrays hold
    // Σ group_size device addresses inside live, pinned CubeCL allocations whose footprints the
    // plan's check bounded; the handle belongs to this GPU and is used under its lock.
    unsafe {
        sys::cublasGemmGroupedBatchedEx(
            handle,
            transa.as_ptr(),
            transb.as_ptr(),
            m.as_ptr(),
            n.as_ptr(),
            k.as_ptr(),
            alpha.as_ptr().cast::<c_void>(),
            arrays[0] as *const *const c_void,
            dt,
            lda.as_ptr(),
            arrays[1] as *const *const c_void,
            dt,
            ldb.as_ptr(),
            beta.as_ptr().cast::<c_void>(),
            arrays[2] as *const *mut c_void,
            dt,
            ldc.as_ptr(),
            int(count)?,
            group_size.as_ptr(),
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    }
    .result()
    .map_err(|e| format!("cublasGemmGroupedBatchedEx failed: {e}"))
}

/// One `cublasGemmEx` per planned call.
fn per_group_calls(
    handle: sys::cublasHandle_t,
    plan: &Plan,
    dt: sys::cudaDataType_t,
    [a, b, c]: [&DevicePtr; 3],
    elem: usize,
) -> Outcome<()> {
    let (alpha, beta) = (1.0f32, 0.0f32);
    for call in &plan.calls {
        let at = |base: &DevicePtr, offset: usize| base.ptr + (offset * elem) as u64;
        // SAFETY: the addresses are inside live, pinned CubeCL allocations and the plan's check
        // bounded the footprints; alpha and beta are f32 on the host (CUBLAS_COMPUTE_32F).
        unsafe {
            sys::cublasGemmEx(
                handle,
                op(call.transa),
                op(call.transb),
                int(call.m)?,
                int(call.n)?,
                int(call.k)?,
                (&alpha as *const f32).cast::<c_void>(),
                at(a, call.a) as *const c_void,
                dt,
                int(call.lda)?,
                at(b, call.b) as *const c_void,
                dt,
                int(call.ldb)?,
                (&beta as *const f32).cast::<c_void>(),
                at(c, call.c) as *mut c_void,
                dt,
                int(call.ldc)?,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .result()
        .map_err(|e| unavailable(format!("cublasGemmEx failed for group {}: {e}", call.group)))?;
    }
    Ok(())
}
