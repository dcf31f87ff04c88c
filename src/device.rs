//! The compute device of a CLI run (`moe train` / `moe logits` `--device cpu|vulkan|cuda`).
//!
//! `cpu` is Burn's Flex backend (always built). `vulkan` and `cuda` are Burn's CubeCL runtimes
//! with moe-backend's GPU kernels, available when the binary was built with the `vulkan` or
//! `cuda` Cargo feature; asking for one that was not built is a [`DeviceError`].

use burn::tensor::Device;

/// Which Burn device a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// Burn's Flex CPU backend.
    #[default]
    Cpu,
    /// Burn's Vulkan runtime (wgpu, SPIR-V), default adapter; feature `vulkan`.
    Vulkan,
    /// Burn's CUDA runtime, GPU 0; feature `cuda`.
    Cuda,
}

/// A device the binary cannot provide.
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

    /// The Burn device (without autodiff), or why this binary cannot provide it.
    pub fn device(self) -> Result<Device, DeviceError> {
        match self {
            DeviceChoice::Cpu => Ok(Device::flex()),
            DeviceChoice::Vulkan => vulkan(),
            DeviceChoice::Cuda => cuda(),
        }
    }
}

#[cfg(feature = "vulkan")]
fn vulkan() -> Result<Device, DeviceError> {
    Ok(Device::vulkan(burn::tensor::DeviceKind::DefaultDevice))
}

#[cfg(not(feature = "vulkan"))]
fn vulkan() -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt {
        device: "vulkan",
        feature: "vulkan",
    })
}

#[cfg(feature = "cuda")]
fn cuda() -> Result<Device, DeviceError> {
    Ok(Device::cuda(0))
}

#[cfg(not(feature = "cuda"))]
fn cuda() -> Result<Device, DeviceError> {
    Err(DeviceError::NotBuilt {
        device: "cuda",
        feature: "cuda",
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_is_the_default_and_always_available() {
        assert_eq!(DeviceChoice::default(), DeviceChoice::Cpu);
        assert!(DeviceChoice::Cpu.device().is_ok());
    }

    #[cfg(not(feature = "vulkan"))]
    #[test]
    fn vulkan_without_the_feature_names_it() {
        let err = DeviceChoice::Vulkan.device().unwrap_err().to_string();
        assert!(err.contains("without the `vulkan` feature"), "{err}");
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_names_it() {
        let err = DeviceChoice::Cuda.device().unwrap_err().to_string();
        assert!(err.contains("without the `cuda` feature"), "{err}");
    }
}
