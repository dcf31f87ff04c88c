#!/usr/bin/env bash
# Runs the prebuilt GPU benches on a bare x86-64 GPU machine without Rust and without network,
# through Vulkan, and writes their output (text log + JSON files) to $OUT:
#   - `cube_ops` (moe-backend/benches/cube_ops.rs): grouped GEMM vs the device's dense matmul at
#     DeepSeek-V3 expert shapes (hidden 7168, width 2048, 256 experts, top-8 of 4096 tokens) in
#     f32 and BF16, permute vs a device copy, each ratio measured in the same run
#     -> $OUT/cube_ops_{quick,f32,bf16}.json;
#   - `cube_train_step` (models/benches/cube_train_step.rs): Qwen3-MoE training steps (0.66 B
#     parameters: 2 layers of 64 experts top-8, width 640, hidden 2048; 32768 tokens per step,
#     f32; bounded by wgpu's 2 GiB buffer limit, see the bench's docs) in
#     tokens/s and MFU, with the device's dense matmul in the same run
#     -> $OUT/cube_train_step.json (if that run fails early, e.g. out of memory or over a
#     buffer limit, a 1-layer run in the time left -> $OUT/cube_train_step_1layer.json).
# Sized for <= 8 minutes on an H200 including start-up: every step has a timeout, 405 s in all
# (the optional cube_tests 60 s included); the fallback only uses what the first run left.
#
# Expects, relative to the repository root (the working directory):
#   .gl/*.deb          Vulkan loader + GL vendor-neutral dispatch debs (on a Debian machine:
#                      `apt-get download libvulkan1 libegl1 ...`)
#   .bench/cube_ops.xz, .bench/cube_train_step.xz   the stripped bench binaries, built with
#       cargo build -p moe-backend --features vulkan --bench cube_ops
#       cargo build -p moe-models --features vulkan --bench cube_train_step
#     (dev profile: dependencies optimized, the kernels are compiled by the Vulkan driver), then
#       mkdir -p .bench && for b in cube_ops cube_train_step; do
#           f=$(ls -t target/debug/deps/$b-* | grep -v '\.d$' | head -1)
#           strip -o .bench/$b "$f" && xz -9 -f .bench/$b; done
#     Measured 2026-12-03 (built with `--config 'profile.dev.package."*".opt-level=0'`, as
#     .ci/gpu-lavapipe does): cube_ops.xz 18.0 MiB, cube_train_step.xz 20.1 MiB; with the
#     tracked files (9.1 MB) and .gl (~1 MB) ~47 MiB travel, under the 64 MiB limit only
#     without a cube_tests.xz of similar size.
#   .bench/cube_tests.xz (optional) the stripped `--test cube` binary: run first, so the kernels
#                      are checked against the Flex reference on the real GPU before timing
# Usage: benches/gpu/run_h200.sh [extra cube_ops args]; OUT defaults to ./out.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
log="$OUT/cube_ops.log"
bin=.bench/cube_ops
train=.bench/cube_train_step

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
        timeout 60 .bench/cube_tests --test-threads=1 --skip _on_gl \
            || echo "cube tests failed (exit $?)"
    fi
    # Burn caches autotune results under the home dir; keep them out of the way.
    export HOME="${HOME:-/tmp}"
    echo "== quick (smoke)"
    timeout 25 "$bin" --quick --iters 3 --json "$OUT/cube_ops_quick.json" "$@"
    echo "== DeepSeek-V3 shapes, f32"
    timeout 90 "$bin" --iters 5 --json "$OUT/cube_ops_f32.json" "$@" \
        || echo "f32 run failed (exit $?)"
    echo "== DeepSeek-V3 shapes, bf16 (fails where the Vulkan device has no bf16 shaders)"
    timeout 80 "$bin" --iters 5 --dtype bf16 --json "$OUT/cube_ops_bf16.json" "$@" \
        || echo "bf16 run failed (exit $?)"
    echo "== Qwen3-MoE training step (f32), tokens/s and MFU"
    # The JSON is rewritten after every timed step: a timeout keeps the steps done so far.
    if [ -x "$train" ]; then
        t0=$SECONDS
        timeout 150 "$train" --warmup 1 --steps 3 --json "$OUT/cube_train_step.json"
        rc=$?
        left=$((150 - (SECONDS - t0)))
        if [ "$rc" != 0 ]; then
            echo "training step run failed (exit $rc)"
            if [ "$rc" != 124 ] && [ "$left" -ge 40 ]; then
                echo "== fallback: 1 layer, ${left} s"
                timeout "$left" "$train" --layers 1 --warmup 1 --steps 3 \
                    --json "$OUT/cube_train_step_1layer.json" \
                    || echo "1-layer training step run failed (exit $?)"
            fi
        fi
    else
        echo "no $train"
    fi
    if [ "${MOE_BENCH_F16:-0}" = 1 ]; then
        echo "== DeepSeek-V3 shapes, f16 (MOE_BENCH_F16=1; beyond the 8-minute budget)"
        timeout 90 "$bin" --iters 5 --dtype f16 --json "$OUT/cube_ops_f16.json" "$@" \
            || echo "f16 run failed (exit $?)"
    fi
} 2>&1 | tee "$log"
