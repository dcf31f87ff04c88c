#!/usr/bin/env bash
# Runs the prebuilt `cube_ops` bench (moe-backend/benches/cube_ops.rs) on a bare x86-64 GPU
# machine without Rust and without network, through Vulkan, and writes its output to $OUT.
#
# Expects, relative to the repository root (the working directory):
#   .gl/*.deb          Vulkan loader + GL vendor-neutral dispatch debs (see
#                      /work/.library/device/README.md: `apt-get download libvulkan1 libegl1 ...`)
#   .bench/cube_ops.xz the stripped bench binary, built with
#                      `CARGO_TARGET_DIR=/work/target-cube cargo build -p moe-backend
#                       --features vulkan --bench cube_ops` (dev profile: optimized
#                       dependencies; the kernels are compiled by the Vulkan driver), `strip`, `xz`
#   .bench/cube_tests.xz (optional) the stripped `--test cube` binary: run first, so the kernels
#                      are checked against the Flex reference on the real GPU before timing
# Usage: benches/gpu/run_h200.sh [extra bench args]; OUT defaults to ./out.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
log="$OUT/cube_ops.log"
bin=.bench/cube_ops

{
    echo "== host: $(uname -m), $(nproc) cores"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    # The Vulkan loader: unpack the carried debs over / (never other packages: they can break /).
    if ! ldconfig -p | grep -q libvulkan.so.1; then
        for f in .gl/*.deb; do dpkg -x "$f" /; done
        ldconfig
    fi
    ldconfig -p | grep libvulkan || echo "no libvulkan after unpacking .gl"
    # Use the NVIDIA ICD directly when the loader finds no driver on its own.
    icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ] \
        && ! ls /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json >/dev/null 2>&1; then
        export VK_DRIVER_FILES="$icd"
        export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
        echo "VK_DRIVER_FILES=$VK_DRIVER_FILES"
    fi
    export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/xdg}"
    mkdir -p -m 700 "$XDG_RUNTIME_DIR"
    for z in .bench/*.xz; do xz -dkf "$z" && chmod +x "${z%.xz}"; done
    if [ -x .bench/cube_tests ]; then
        echo "== Cube kernels vs Flex reference (moe-backend/tests/cube.rs) on this GPU"
        # `_on_gl` tests run the same kernels through wgpu's OpenGL backend, which lavapipe CI
        # needs (see the test docs); on a GPU the Vulkan device already runs the tiled kernels.
        timeout 150 .bench/cube_tests --test-threads=1 --skip _on_gl \
            || echo "cube tests failed (exit $?)"
    fi
    # Burn caches autotune results under the home dir; keep them out of the way.
    export HOME="${HOME:-/tmp}"
    echo "== quick (smoke)"
    timeout 60 "$bin" --quick --iters 3 "$@"
    echo "== DeepSeek-V3 shapes, f32"
    timeout 150 "$bin" --iters 5 "$@"
    echo "== DeepSeek-V3 shapes, bf16 (fails where the Vulkan device has no bf16 shaders)"
    timeout 120 "$bin" --iters 5 --dtype bf16 "$@" || echo "bf16 run failed (exit $?)"
    echo "== DeepSeek-V3 shapes, f16"
    timeout 90 "$bin" --iters 5 --dtype f16 "$@" || echo "f16 run failed (exit $?)"
} 2>&1 | tee "$log"
