//! The compute device of a CLI run (`moe train` / `moe logits` `--device cpu|vulkan|cuda`).
//!
//! `cpu` is Burn's Flex backend (always built). `vulkan` and `cuda` are Burn's CubeCL runtimes
//! with moe-backend's GPU kernels, available when the binary was built with the `vulkan` or
//! `cuda` Cargo feature; asking for one that was not built is a [`DeviceError::NotBuilt`].
//!
//! A GPU device is probed before Burn opens its runtime ([`moe_backend::devices`]): no driver,
//! no device, or more ranks on this node than CUDA GPUs is a [`DeviceError::Unavailable`]
//! rather than a panic in CubeCL's runtime thread. Every CUDA rank gets its own GPU, the one
//! its local index names (torchrun's `LOCAL_RANK` and its peers for processes, the rank for
//! in-process threads), as Megatron's `torch.cuda.set_device(local_rank)` does. Vulkan ranks
//! share the default adapter (wgpu numbers adapters by kind, not by rank).

use burn::tensor::Device;
use moe_backend::comm::RankCtx;
use moe_backend::comm::launch::Launch;
use moe_backend::devices::LocalRanks;

/// Which Burn device a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// Burn's Flex CPU backend.
    #[default]
    Cpu,
    /// Burn's Vulkan runtime (wgpu, SPIR-V), default adapter; feature `vulkan`.
    Vulkan,
    /// Burn's CUDA runtime, one GPU per rank (the rank's local index); feature `cuda`.
    Cuda,
}

/// A device the binary or the machine cannot provide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The backend's Cargo feature was off when the binary was built.
    #[error(
        "--device {device}: this binary was built without the `{feature}` feature (rebuild with \
         `cargo build --release --features {feature}`)"
    )]
    NotBuilt {
        /// The device asked for.
        device: &'static str,
        /// The Cargo feature that provides it.
        feature: &'static str,
    },
    /// The runtime is built but this machine cannot serve it: no driver, no device, or fewer
    /// GPUs than ranks on this node.
    #[error(transparent)]
    Unavailable(#[from] moe_backend::devices::DeviceError),
}

impl DeviceChoice {
    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Vulkan => "vulkan",
            DeviceChoice::Cuda => "cuda",
        }
    }

    /// Checks that the device can be used here, before anything opens its runtime: the
    /// binary has its feature, the driver loads and reports at least one device. Returns the
    /// number of devices (1 for the CPU). Probed once per process.
    pub fn probe(self) -> Result<usize, DeviceError> {
        match self {
            DeviceChoice::Cpu => Ok(1),
            DeviceChoice::Vulkan => probe_vulkan(),
            DeviceChoice::Cuda => probe_cuda(),
        }
    }

    /// Refuses a job whose node runs more ranks than this device has GPUs (CUDA; one GPU per
    /// rank), naming both counts; probes first. The CPU and Vulkan take any number of ranks.
    pub fn check_local_ranks(self, local: &LocalRanks) -> Result<(), DeviceError> {
        let devices = self.probe()?;
        match self {
            DeviceChoice::Cuda => Ok(moe_backend::devices::check_local_ranks(
                moe_backend::devices::GpuRuntime::Cuda,
                local,
                devices,
            )?),
            DeviceChoice::Cpu | DeviceChoice::Vulkan => Ok(()),
        }
    }

    /// The Burn device (without autodiff) of a process's first rank (GPU 0), or why this
    /// binary or machine cannot provide it.
    pub fn device(self) -> Result<Device, DeviceError> {
        self.rank_device(0)
    }

    /// The Burn device (without autodiff) of the rank with index `local_index` among the ranks
    /// of its node ([`local_index`]): CUDA GPU `local_index`, refused when the node has no
    /// such GPU.
    pub fn rank_device(self, local_index: usize) -> Result<Device, DeviceError> {
        match self {
            DeviceChoice::Cpu => Ok(Device::flex()),
            DeviceChoice::Vulkan => vulkan(),
            DeviceChoice::Cuda => cuda(local_index),
        }
    }
}

/// The index of `ctx`'s rank among the ranks of its node: the launcher's local rank for a rank
/// that is a process of a multi-process job, the rank itself for in-process threads.
pub fn local_index(ctx: &RankCtx) -> Result<usize, moe_backend::BackendError> {
    if ctx.is_multiprocess() {
        Ok(Launch::from_env()?.map_or(0, |l| l.local_rank))
    } else {
        Ok(ctx.rank())
    }
}

#[cfg(feature = "vulkan")]
fn probe_vulkan() -> Result<usize, DeviceError> {
    Ok(moe_backend::devices::probe_vulkan()?)
}

#[cfg(feature = "vulkan")]
fn vulkan() -> Result<Device, DeviceError> {
    probe_vulkan()?;
    Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice))
}

#[cfg(not(feature = "vulkan"))]
fn probe_vulkan() -> Result<usize, DeviceError> {
    Err(DeviceError::NotBuilt {
        device: "vulkan",
        feature: "vulkan",
    })
}

#[cfg(not(feature = "vulkan"))]
fn vulkan() -> Result<Device, DeviceError> {
    probe_vulkan().map(|_| Device::flex())
}

#[cfg(feature = "cuda")]
fn probe_cuda() -> Result<usize, DeviceError> {
    Ok(moe_backend::devices::probe_cuda()?)
}

#[cfg(feature = "cuda")]
fn cuda(local_index: usize) -> Result<Device, DeviceError> {
    let index = moe_backend::devices::cuda_device_index(local_index)?;
    Ok(Device::cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda() -> Result<usize, DeviceError> {
    Err(DeviceError::NotBuilt {
        device: "cuda",
        feature: "cuda",
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda(_local_index: usize) -> Result<Device, DeviceError> {
    probe_cuda().map(|_| Device::flex())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_the_default_and_always_available() {
        assert_eq!(DeviceChoice::default(), DeviceChoice::Cpu);
        assert!(DeviceChoice::Cpu.device().is_ok());
        assert_eq!(DeviceChoice::Cpu.probe(), Ok(1));
        // Any number of CPU ranks.
        assert_eq!(
            DeviceChoice::Cpu.check_local_ranks(&LocalRanks::threads(64)),
            Ok(())
        );
    }

    #[cfg(not(feature = "vulkan"))]
    #[test]
    fn vulkan_without_the_feature_names_it() {
        let err = DeviceChoice::Vulkan.device().unwrap_err().to_string();
        assert!(err.contains("without the `vulkan` feature"), "{err}");
        let err = DeviceChoice::Vulkan.probe().unwrap_err().to_string();
        assert!(err.contains("without the `vulkan` feature"), "{err}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_names_it() {
        for err in [
            DeviceChoice::Cuda.device().unwrap_err(),
            DeviceChoice::Cuda.rank_device(3).unwrap_err(),
            DeviceChoice::Cuda
                .check_local_ranks(&LocalRanks::threads(1))
                .unwrap_err(),
        ] {
            assert!(
                matches!(err, DeviceError::NotBuilt { device: "cuda", .. }),
                "{err:?}"
            );
            assert!(
                err.to_string().contains("without the `cuda` feature"),
                "{err}"
            );
        }
    }

    #[test]
    fn threads_use_their_rank_as_local_index() {
        let indices = moe_backend::comm::World::run(3, local_index);
        let indices: Vec<usize> = indices.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(indices, vec![0, 1, 2]);
    }
}
