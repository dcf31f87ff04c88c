//! Which accelerator a rank runs on, and whether this machine has one.
//!
//! Follows the launcher convention of torchrun and Megatron-LM (`torch.cuda.set_device(
//! LOCAL_RANK)` in `megatron/training/initialize.py`, `_initialize_distributed`): the rank's
//! index among the ranks of its node picks the GPU, one GPU per rank. Where Megatron divides
//! the rank by the device count and lets NCCL fail later when two ranks land on one GPU, a job
//! here is refused before any work when a node runs more ranks than it has visible GPUs, and
//! the error names both counts ([`DeviceError::TooFewDevices`]).
//!
//! The probes (`probe_cuda`, `probe_vulkan`) run before Burn or CubeCL touch a runtime:
//! CubeCL starts its CUDA / wgpu runtime on a background server thread and panics there when
//! the driver library is missing or no device answers, which a caller sees as a second panic
//! (`RecvError`) with a backtrace. The CUDA probe opens the driver through cudarc's dynamic
//! loading (the loader Burn's CUDA runtime uses) and calls `cuInit` and `cuDeviceGetCount`;
//! the Vulkan probe opens the Vulkan loader and asks wgpu for Vulkan adapters. Each probe runs
//! once per process; its decision logic ([`probe_cuda_with`], [`probe_vulkan_with`]) takes the
//! driver as a trait so that tests inject every failure.

use std::fmt;

use crate::comm::launch::Launch;

/// A GPU runtime this crate can run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuRuntime {
    /// NVIDIA's CUDA driver (Burn's CUDA runtime, NCCL).
    Cuda,
    /// Vulkan through wgpu (Burn's Vulkan runtime).
    Vulkan,
}

impl GpuRuntime {
    /// The name used on the command line (`--device cuda|vulkan`).
    pub fn name(self) -> &'static str {
        match self {
            GpuRuntime::Cuda => "cuda",
            GpuRuntime::Vulkan => "vulkan",
        }
    }
}

impl fmt::Display for GpuRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a GPU runtime cannot serve this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The runtime's driver library (`libcuda.so.1`, `libvulkan.so.1`) could not be loaded.
    #[error("--device {runtime}: no {runtime} driver on this machine: {detail}")]
    NoDriver {
        /// The runtime asked for.
        runtime: GpuRuntime,
        /// Which library was missing and how to get it.
        detail: String,
    },
    /// The driver loaded but a call failed (e.g. `cuInit` with `CUDA_ERROR_INSUFFICIENT_DRIVER`).
    #[error("--device {runtime}: the {runtime} driver failed in {call}: {detail}")]
    DriverFailed {
        /// The runtime asked for.
        runtime: GpuRuntime,
        /// The driver call.
        call: &'static str,
        /// The driver's error.
        detail: String,
    },
    /// The driver works but reports no device.
    #[error("--device {runtime}: the {runtime} driver reports no device{detail}")]
    NoDevice {
        /// The runtime asked for.
        runtime: GpuRuntime,
        /// Context (the driver's error, `CUDA_VISIBLE_DEVICES`), starting with `: ` or empty.
        detail: String,
    },
    /// More ranks on this node than visible devices (one GPU per rank).
    #[error(
        "--device {runtime}: {local_ranks} ranks on this node ({counted_from}) but {devices} \
         visible {runtime} device(s): every rank needs its own GPU; start at most {devices} \
         ranks per node or make more GPUs visible{visible}"
    )]
    TooFewDevices {
        /// The runtime asked for.
        runtime: GpuRuntime,
        /// Ranks on this node (at least; see `counted_from`).
        local_ranks: usize,
        /// Devices the driver reports.
        devices: usize,
        /// Where the rank count comes from (`LOCAL_WORLD_SIZE of torchrun`, ...).
        counted_from: String,
        /// `CUDA_VISIBLE_DEVICES` when it is set, as ` (CUDA_VISIBLE_DEVICES="0,1")`.
        visible: String,
    },
}

/// How many ranks run on this node, and where that number comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRanks {
    /// Ranks on this node (a lower bound when the launcher only gave the local rank).
    pub count: usize,
    /// Where `count` comes from, for error messages.
    pub counted_from: String,
}

impl LocalRanks {
    /// `world` ranks as threads of this process.
    pub fn threads(world: usize) -> Self {
        Self {
            count: world,
            counted_from: format!("{world} in-process rank threads"),
        }
    }

    /// The ranks of this node as the launcher announced them: its local world size
    /// (`LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`, `MPI_LOCALNRANKS`,
    /// `SLURM_NTASKS_PER_NODE`) when it gives one, else at least this process's local rank + 1.
    pub fn from_launch(launch: &Launch) -> Self {
        match launch.local_world_size {
            Some(n) => Self {
                count: n,
                counted_from: format!("the local world size announced by {}", launch.launcher),
            },
            None => Self {
                count: launch.local_rank + 1,
                counted_from: format!(
                    "this process has local rank {} under {}",
                    launch.local_rank, launch.launcher
                ),
            },
        }
    }
}

/// `CUDA_VISIBLE_DEVICES` as a message suffix (` (CUDA_VISIBLE_DEVICES="…")`), or empty.
fn visible_devices_note(runtime: GpuRuntime) -> String {
    match (runtime, std::env::var("CUDA_VISIBLE_DEVICES")) {
        (GpuRuntime::Cuda, Ok(v)) => format!(" (CUDA_VISIBLE_DEVICES={v:?})"),
        _ => String::new(),
    }
}

/// Refuses `local` ranks on a node with `devices` devices when they outnumber the devices.
pub fn check_local_ranks(
    runtime: GpuRuntime,
    local: &LocalRanks,
    devices: usize,
) -> Result<(), DeviceError> {
    if local.count <= devices {
        return Ok(());
    }
    Err(DeviceError::TooFewDevices {
        runtime,
        local_ranks: local.count,
        devices,
        counted_from: local.counted_from.clone(),
        visible: visible_devices_note(runtime),
    })
}

/// The device ordinal of the rank with index `local_index` among its node's ranks, on a node
/// with `devices` devices: the index itself, refused when it is not below `devices`.
pub fn device_index(
    runtime: GpuRuntime,
    local_index: usize,
    devices: usize,
) -> Result<usize, DeviceError> {
    if local_index < devices {
        return Ok(local_index);
    }
    Err(DeviceError::TooFewDevices {
        runtime,
        local_ranks: local_index + 1,
        devices,
        counted_from: format!("a rank with local index {local_index}"),
        visible: visible_devices_note(runtime),
    })
}

/// A failed CUDA driver call: the `CUresult` code and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaCallError {
    /// The `CUresult` value.
    pub code: u32,
    /// Its name (`CUDA_ERROR_NO_DEVICE`, ...).
    pub name: String,
}

/// `CUDA_ERROR_NO_DEVICE`: `cuInit` finds no CUDA-capable device (also what an empty
/// `CUDA_VISIBLE_DEVICES` gives).
pub const CUDA_ERROR_NO_DEVICE: u32 = 100;

/// The CUDA driver calls the probe makes: `LibCuda` (features `cuda`, `nccl`) over the real
/// driver, fakes in tests.
pub trait CudaDriverApi {
    /// Whether the driver library (`libcuda.so`, `libcuda.so.1`) can be loaded.
    fn library_present(&self) -> bool;
    /// `cuInit(0)`.
    fn init(&self) -> Result<(), CudaCallError>;
    /// `cuDeviceGetCount`.
    fn device_count(&self) -> Result<usize, CudaCallError>;
}

/// Probes CUDA through `api`: the number of visible devices (at least one), or why there is
/// none. Calls nothing past a failed step (no `cuInit` without the library).
pub fn probe_cuda_with(api: &dyn CudaDriverApi) -> Result<usize, DeviceError> {
    let runtime = GpuRuntime::Cuda;
    if !api.library_present() {
        return Err(DeviceError::NoDriver {
            runtime,
            detail: "the CUDA driver library (libcuda.so / libcuda.so.1) could not be loaded; \
                     it comes with the NVIDIA driver: run on a machine with an NVIDIA GPU and its \
                     driver, or put the driver's library directory on LD_LIBRARY_PATH"
                .into(),
        });
    }
    let described = |e: &CudaCallError| format!("{} ({})", e.name, e.code);
    if let Err(e) = api.init() {
        if e.code == CUDA_ERROR_NO_DEVICE {
            return Err(DeviceError::NoDevice {
                runtime,
                detail: format!(
                    ": cuInit returned {}{}",
                    described(&e),
                    visible_devices_note(runtime)
                ),
            });
        }
        return Err(DeviceError::DriverFailed {
            runtime,
            call: "cuInit",
            detail: described(&e),
        });
    }
    let count = api.device_count().map_err(|e| DeviceError::DriverFailed {
        runtime,
        call: "cuDeviceGetCount",
        detail: described(&e),
    })?;
    if count == 0 {
        return Err(DeviceError::NoDevice {
            runtime,
            detail: format!(": cuDeviceGetCount is 0{}", visible_devices_note(runtime)),
        });
    }
    Ok(count)
}

/// The Vulkan calls the probe makes: `WgpuVulkan` (feature `vulkan`) over the real loader,
/// fakes in tests.
pub trait VulkanApi {
    /// Whether the Vulkan loader (`libvulkan.so.1`) can be loaded.
    fn loader_present(&self) -> bool;
    /// The Vulkan adapters wgpu finds, by name.
    fn adapters(&self) -> Vec<String>;
}

/// Probes Vulkan through `api`: the number of adapters (at least one), or why there is none.
pub fn probe_vulkan_with(api: &dyn VulkanApi) -> Result<usize, DeviceError> {
    let runtime = GpuRuntime::Vulkan;
    if !api.loader_present() {
        return Err(DeviceError::NoDriver {
            runtime,
            detail: "the Vulkan loader (libvulkan.so.1) could not be loaded: install it (Debian: \
                     libvulkan1) and a Vulkan driver (the GPU vendor's, or Mesa's lavapipe: \
                     mesa-vulkan-drivers)"
                .into(),
        });
    }
    let adapters = api.adapters();
    if adapters.is_empty() {
        return Err(DeviceError::NoDevice {
            runtime,
            detail: ": the Vulkan loader found no driver (ICD) with a device; check \
                     VK_DRIVER_FILES / VK_ICD_FILENAMES and the driver's ICD json"
                .into(),
        });
    }
    Ok(adapters.len())
}

/// The real CUDA driver through cudarc's dynamic loading (features `cuda` and `nccl`).
#[cfg(any(feature = "cuda", feature = "nccl"))]
#[derive(Debug, Clone, Copy, Default)]
pub struct LibCuda;

#[cfg(any(feature = "cuda", feature = "nccl"))]
impl LibCuda {
    fn call_error(e: cudarc::driver::DriverError) -> CudaCallError {
        CudaCallError {
            code: e.0 as u32,
            name: format!("{:?}", e.0),
        }
    }
}

#[cfg(any(feature = "cuda", feature = "nccl"))]
impl CudaDriverApi for LibCuda {
    fn library_present(&self) -> bool {
        // SAFETY: only opens and closes the candidate library names.
        unsafe { cudarc::driver::sys::is_culib_present() }
    }

    fn init(&self) -> Result<(), CudaCallError> {
        cudarc::driver::result::init().map_err(Self::call_error)
    }

    fn device_count(&self) -> Result<usize, CudaCallError> {
        let n = cudarc::driver::result::device::get_count().map_err(Self::call_error)?;
        Ok(usize::try_from(n).unwrap_or(0))
    }
}

/// The visible CUDA devices of this machine (probed once per process), or why CUDA cannot run
/// here. Call before anything opens the CUDA runtime.
#[cfg(any(feature = "cuda", feature = "nccl"))]
pub fn probe_cuda() -> Result<usize, DeviceError> {
    static PROBE: std::sync::OnceLock<Result<usize, DeviceError>> = std::sync::OnceLock::new();
    PROBE.get_or_init(|| probe_cuda_with(&LibCuda)).clone()
}

/// The CUDA device ordinal of the rank with index `local_index` on its node (probing first).
#[cfg(any(feature = "cuda", feature = "nccl"))]
pub fn cuda_device_index(local_index: usize) -> Result<usize, DeviceError> {
    device_index(GpuRuntime::Cuda, local_index, probe_cuda()?)
}

/// The real Vulkan loader and wgpu's Vulkan adapters (feature `vulkan`).
#[cfg(feature = "vulkan")]
#[derive(Debug, Clone, Copy, Default)]
pub struct WgpuVulkan;

#[cfg(feature = "vulkan")]
impl VulkanApi for WgpuVulkan {
    fn loader_present(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: dlopen of a C string literal, closed again right away; the loader's
            // initialisers only register its own state.
            unsafe {
                let handle = libc::dlopen(c"libvulkan.so.1".as_ptr(), libc::RTLD_NOW);
                if handle.is_null() {
                    return false;
                }
                libc::dlclose(handle);
            }
            true
        }
        #[cfg(not(target_os = "linux"))]
        {
            true
        }
    }

    fn adapters(&self) -> Vec<String> {
        use burn_cubecl::cubecl::future::block_on;
        use burn_cubecl::cubecl::wgpu::wgpu;
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::VULKAN,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        block_on(instance.enumerate_adapters(wgpu::Backends::VULKAN))
            .iter()
            .map(|a| a.get_info().name)
            .collect()
    }
}

/// The Vulkan adapters of this machine (probed once per process), or why Vulkan cannot run
/// here. Call before anything opens the wgpu runtime.
#[cfg(feature = "vulkan")]
pub fn probe_vulkan() -> Result<usize, DeviceError> {
    static PROBE: std::sync::OnceLock<Result<usize, DeviceError>> = std::sync::OnceLock::new();
    PROBE.get_or_init(|| probe_vulkan_with(&WgpuVulkan)).clone()
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// A CUDA driver with scripted answers that counts the calls made.
    struct FakeCuda {
        present: bool,
        init: Result<(), CudaCallError>,
        count: Result<usize, CudaCallError>,
        calls: Cell<usize>,
    }

    impl FakeCuda {
        fn new(present: bool, init: Result<(), u32>, count: Result<usize, u32>) -> Self {
            let err = |code| CudaCallError {
                code,
                name: format!("CODE_{code}"),
            };
            Self {
                present,
                init: init.map_err(err),
                count: count.map_err(err),
                calls: Cell::new(0),
            }
        }
    }

    impl CudaDriverApi for FakeCuda {
        fn library_present(&self) -> bool {
            self.present
        }
        fn init(&self) -> Result<(), CudaCallError> {
            self.calls.set(self.calls.get() + 1);
            self.init.clone()
        }
        fn device_count(&self) -> Result<usize, CudaCallError> {
            self.calls.set(self.calls.get() + 1);
            self.count.clone()
        }
    }

    #[test]
    fn a_missing_cuda_library_is_no_driver_and_calls_nothing() {
        let fake = FakeCuda::new(false, Ok(()), Ok(4));
        let err = probe_cuda_with(&fake).unwrap_err();
        assert!(matches!(
            err,
            DeviceError::NoDriver {
                runtime: GpuRuntime::Cuda,
                ..
            }
        ));
        assert!(
            err.to_string().starts_with("--device cuda: no cuda driver"),
            "{err}"
        );
        assert!(err.to_string().contains("libcuda.so.1"), "{err}");
        assert_eq!(fake.calls.get(), 0);
    }

    #[test]
    fn no_device_from_cuinit_or_from_a_zero_count() {
        let err =
            probe_cuda_with(&FakeCuda::new(true, Err(CUDA_ERROR_NO_DEVICE), Ok(0))).unwrap_err();
        assert!(matches!(err, DeviceError::NoDevice { .. }), "{err:?}");
        assert!(
            err.to_string().contains("cuInit returned CODE_100 (100)"),
            "{err}"
        );
        let err = probe_cuda_with(&FakeCuda::new(true, Ok(()), Ok(0))).unwrap_err();
        assert!(matches!(err, DeviceError::NoDevice { .. }), "{err:?}");
        assert!(err.to_string().contains("cuDeviceGetCount is 0"), "{err}");
    }

    #[test]
    fn other_driver_failures_name_the_call() {
        // CUDA_ERROR_INSUFFICIENT_DRIVER (35): a driver older than the runtime.
        let fake = FakeCuda::new(true, Err(35), Ok(1));
        let err = probe_cuda_with(&fake).unwrap_err();
        assert_eq!(
            err,
            DeviceError::DriverFailed {
                runtime: GpuRuntime::Cuda,
                call: "cuInit",
                detail: "CODE_35 (35)".into()
            }
        );
        assert_eq!(
            fake.calls.get(),
            1,
            "no cuDeviceGetCount after a failed cuInit"
        );
        let err = probe_cuda_with(&FakeCuda::new(true, Ok(()), Err(999))).unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::DriverFailed {
                    call: "cuDeviceGetCount",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn a_working_driver_gives_its_count() {
        assert_eq!(probe_cuda_with(&FakeCuda::new(true, Ok(()), Ok(8))), Ok(8));
    }

    struct FakeVulkan {
        loader: bool,
        adapters: Vec<String>,
    }

    impl VulkanApi for FakeVulkan {
        fn loader_present(&self) -> bool {
            self.loader
        }
        fn adapters(&self) -> Vec<String> {
            self.adapters.clone()
        }
    }

    #[test]
    fn vulkan_without_loader_or_adapter_is_refused() {
        let err = probe_vulkan_with(&FakeVulkan {
            loader: false,
            adapters: vec!["x".into()],
        })
        .unwrap_err();
        assert!(matches!(
            err,
            DeviceError::NoDriver {
                runtime: GpuRuntime::Vulkan,
                ..
            }
        ));
        assert!(err.to_string().contains("libvulkan.so.1"), "{err}");
        let err = probe_vulkan_with(&FakeVulkan {
            loader: true,
            adapters: vec![],
        })
        .unwrap_err();
        assert!(matches!(
            err,
            DeviceError::NoDevice {
                runtime: GpuRuntime::Vulkan,
                ..
            }
        ));
        let ok = FakeVulkan {
            loader: true,
            adapters: vec!["llvmpipe".into(), "NVIDIA H200".into()],
        };
        assert_eq!(probe_vulkan_with(&ok), Ok(2));
    }

    #[test]
    fn each_local_rank_gets_its_own_device() {
        for devices in 1..=8 {
            for rank in 0..devices {
                assert_eq!(device_index(GpuRuntime::Cuda, rank, devices), Ok(rank));
            }
        }
        let err = device_index(GpuRuntime::Cuda, 2, 2).unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::TooFewDevices {
                    local_ranks: 3,
                    devices: 2,
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(device_index(GpuRuntime::Cuda, 0, 0).is_err());
    }

    #[test]
    fn more_local_ranks_than_devices_names_both_counts() {
        assert_eq!(
            check_local_ranks(GpuRuntime::Cuda, &LocalRanks::threads(2), 2),
            Ok(())
        );
        let err = check_local_ranks(GpuRuntime::Cuda, &LocalRanks::threads(4), 2).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("4 ranks on this node (4 in-process rank threads) but 2 visible cuda"),
            "{msg}"
        );
        let launch = |local_rank, local_world_size| Launch {
            rank: 5,
            world_size: 16,
            local_rank,
            local_world_size,
            master_addr: None,
            master_port: None,
            launcher: "torchrun",
        };
        let local = LocalRanks::from_launch(&launch(1, Some(8)));
        assert_eq!(local.count, 8);
        let msg = check_local_ranks(GpuRuntime::Cuda, &local, 4)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("8 ranks on this node (the local world size announced by torchrun) but 4"),
            "{msg}"
        );
        // Without a local world size: at least local rank + 1.
        let local = LocalRanks::from_launch(&launch(3, None));
        assert_eq!(local.count, 4);
        assert!(check_local_ranks(GpuRuntime::Cuda, &local, 4).is_ok());
        assert!(check_local_ranks(GpuRuntime::Cuda, &local, 3).is_err());
    }
}
