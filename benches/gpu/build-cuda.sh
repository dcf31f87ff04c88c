#!/usr/bin/env bash
# Builds the binaries `benches/gpu/run.sh` runs on a GPU machine, on this CPU machine, offline,
# in one `cargo build --release --features cuda,nccl` (one feature graph: nothing is compiled
# twice):
#   moe                  the CLI (`moe train --device cuda --transport nccl`)
#   moe-gpu-gemm-check   moe-backend's grouped GEMM check/bench (the `grouped_gemm_check` bench)
#   moe-gpu-train-step   the Qwen3-MoE training-step bench (the `cube_train_step` bench)
# checks them here (each refuses cleanly without a driver; with a stub libcuda, "no device" and
# "more ranks than GPUs" are refused naming the counts; `ldd` against what the GPU image has),
# and packs them into .bench/gpu-bins.tar.xz (+ .bench/manifest.txt) to carry (<= 64 MiB with
# the repository). Prints the build times and sizes.
#
# The compiler route (stated and checked): cubecl-cuda 0.11.3 turns kernels into PTX through
# LLVM's NVPTX back end (its default; the `cpp` feature would select CUDA C++ through NVRTC),
# and the CUDA driver JIT-compiles that PTX when the module loads. So the binaries link LLVM
# statically and need at run time only the driver (libcuda.so.1) — no NVRTC, no CUDA toolkit,
# no headers; NCCL (libnccl.so) only for the NCCL transport, from the image's nvidia-nccl-cu13
# wheel (run.sh links it). cudarc is built for the CUDA 12.8 API (`cuda-12080`) and loads the
# driver dynamically; a CUDA 13 driver (580) serves that API.
#
# Offline LLVM: cubecl-cuda depends unconditionally on cubecl-llvm, whose build dependency
# tracel-llvm-bundler 23.1.0-4 downloads a prebuilt LLVM 23.1 from GitHub at build time; that
# host does not resolve here (only the package registries are reachable: checked 2026-12-06,
# "Could not resolve host"). The bundler skips its download when its install directory holds the
# sentinel `.tracel-llvm-installed` and then asks `<dir>/bin/llvm-config --link-static` for the
# libraries: this script fills that directory with Debian's LLVM 22 (`llvm-22-dev`,
# `libpolly-22-dev` from the Debian mirror). llvm-sys 231 is written against LLVM 23's C API;
# LLVM 22's links (measured here) — whether every NVPTX path CubeCL uses behaves as with 23 is
# what the GPU run's correctness cases check.
#
# Usage: benches/gpu/build-cuda.sh [--skip-build] [--no-pack]
#   CARGO_TARGET_DIR (default /work/target-cuda: a separate feature set from the shared dir),
#   LLVM_MAJOR (default 22), NICE (default 10).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
major="${LLVM_MAJOR:-22}"
target="${CARGO_TARGET_DIR:-/work/target-cuda}"
nice_level="${NICE:-10}"
skip_build=0
pack=1
for a in "$@"; do
    case "$a" in
        --skip-build) skip_build=1 ;;
        --no-pack) pack=0 ;;
        *) echo "build-cuda: unknown option $a" >&2; exit 2 ;;
    esac
done
t_all=$SECONDS

# 1) Debian's LLVM with static libraries, and what a static LLVM link needs.
pkgs=("llvm-$major-dev" "libpolly-$major-dev" zlib1g-dev libzstd-dev libxml2-dev libffi-dev
    libz3-dev)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -q '^installed$' \
        || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    $sudo apt-get update -qq >/dev/null
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
fi
prefix="/usr/lib/llvm-$major"
[ -x "$prefix/bin/llvm-config" ] || { echo "build-cuda: no $prefix/bin/llvm-config" >&2; exit 1; }
echo "== LLVM $("$prefix/bin/llvm-config" --version) from $prefix (Debian), NVPTX target: \
$("$prefix/bin/llvm-config" --targets-built | tr ' ' '\n' | grep -c NVPTX)"

# 2) The directory tracel-llvm-bundler installs its bundle into (dirs::data_local_dir()),
#    holding Debian's LLVM and the sentinel that makes the bundler skip its download.
data="${XDG_DATA_HOME:-$HOME/.local/share}"
bundle="$data/tracel/tracel-llvm-23.1.0-4"
mkdir -p "$bundle"
for d in lib include; do
    ln -sfn "$prefix/$d" "$bundle/$d"
done
# `bin/llvm-config` is a wrapper: Debian's `--system-libs` names z3 by its path
# (`/usr/lib/x86_64-linux-gnu/libz3.so`), which the bundler turns into `-llibz3`; the wrapper
# rewrites such paths to `-l<name>`.
# Written only when it changes: the bundler's build script reruns (and with it cubecl-llvm and
# everything above it, ~30 min) when the wrapper's modification time changes.
mkdir -p "$bundle/bin"
wrapper=$(cat <<WRAP
#!/bin/sh
"$prefix/bin/llvm-config" "\$@" | sed -E 's#/[^ ]*/lib([A-Za-z0-9_+-]+)\.(so|a)#-l\1#g'
WRAP
)
if [ "$(cat "$bundle/bin/llvm-config" 2>/dev/null)" != "$wrapper" ]; then
    printf '%s\n' "$wrapper" >"$bundle/bin/llvm-config"
    chmod +x "$bundle/bin/llvm-config"
fi
[ -e "$bundle/.tracel-llvm-installed" ] || touch "$bundle/.tracel-llvm-installed"
echo "== bundle directory $bundle -> $prefix"

# 3) The build (release profile; its own target dir for the cuda feature set).
export CARGO_TARGET_DIR="$target"
export CARGO_INCREMENTAL=0
stage="$target/gpu-stage"
mkdir -p "$stage"
times=()
bins=(moe moe-gpu-gemm-check moe-gpu-train-step)
if [ "$skip_build" = 0 ]; then
    t0=$SECONDS
    echo "== cargo build --release --features cuda,nccl ${bins[*]/#/--bin }"
    # shellcheck disable=SC2046 # one --bin per binary
    nice -n "$nice_level" cargo build --release --features cuda,nccl $(printf -- '--bin %s ' "${bins[@]}")
    times+=("cargo-build $((SECONDS - t0)) s")
fi
for b in "${bins[@]}"; do
    cp "$target/release/$b" "$stage/$b"
    strip "$stage/$b"
done
echo "== stripped sizes"
ls -l "${bins[@]/#/$stage/}"

# 4) Checks here. (a) The libraries each binary needs: the GPU image is an Ubuntu-based CUDA 13
#    image with PyTorch; glibc, libgcc_s, libstdc++, zlib and zstd (Ubuntu's `required` packages
#    libc6, libgcc-s1, libstdc++6, zlib1g, libzstd1) are there; anything else must be carried.
echo "== ldd"
allowed='linux-vdso|ld-linux-x86-64|libc\.so|libm\.so|libgcc_s|libpthread|libdl\.so|librt\.so|libstdc\+\+|libz\.so\.1|libzstd\.so\.1'
extra=""
for b in "${bins[@]}"; do
    libs=$(ldd "$stage/$b" | awk '{print $1}' | tr '\n' ' ')
    echo "$b: $libs"
    for l in $libs; do
        echo "$l" | grep -qE "$allowed" || extra+="$b needs $l; "
    done
done
glibc=$(for b in "${bins[@]}"; do objdump -T "$stage/$b" | grep -oE 'GLIBC_[0-9.]+'; done \
    | sort -uV | tail -1)
echo "newest glibc symbol version: $glibc"
if [ -n "$extra" ]; then
    echo "build-cuda: libraries the GPU image may lack: $extra" >&2
    exit 1
fi

# (b) Refusals without a driver, and with a stub driver reporting 0 or 1 devices.
echo "== refusals (no driver here; then a stub libcuda)"
stub="$target/stub-libcuda"
mkdir -p "$stub"
cat >"$stub/stub.c" <<'C'
/* A stand-in for libcuda: cuInit and cuDeviceGetCount report STUB_CUDA_DEVICES devices
   (CUDA_ERROR_NO_DEVICE from cuInit for 0). Only for the refusal checks of build-cuda.sh. */
#include <stdlib.h>
static int devices(void) { const char *s = getenv("STUB_CUDA_DEVICES"); return s ? atoi(s) : 0; }
int cuInit(unsigned int flags) { (void)flags; return devices() == 0 ? 100 : 0; }
int cuDeviceGetCount(int *count) { *count = devices(); return 0; }
int cuDriverGetVersion(int *version) { *version = 13000; return 0; }
C
cc -shared -fPIC -O1 -o "$stub/libcuda.so" "$stub/stub.c"
fixture="$root/tests/fixtures/qwen3_moe"
checks=0
# expect NAME EXIT NEEDLE -- command...: the command must exit with EXIT, print NEEDLE, and
# print no panic.
expect() {
    local name=$1 code=$2 needle=$3
    shift 4
    local log rc=0
    log=$("$@" 2>&1) || rc=$?
    if [ "$rc" != "$code" ] || ! grep -qF -- "$needle" <<<"$log" \
        || grep -qE 'panicked|RecvError|backtrace' <<<"$log"; then
        echo "build-cuda: $name: exit $rc, expected $code and \"$needle\":" >&2
        echo "$log" >&2
        exit 1
    fi
    checks=$((checks + 1))
    echo "ok   $name (exit $rc): $(head -c 160 <<<"$log")"
}
if ldconfig -p | grep -q 'libcuda\.so'; then
    echo "(this machine has libcuda: the no-driver checks are skipped)"
else
    expect "moe, no driver" 1 "no cuda driver" -- \
        "$stage/moe" train --model "$fixture" --steps 1 --device cuda
    expect "moe-gpu-gemm-check, no driver" 3 "no cuda driver" -- \
        "$stage/moe-gpu-gemm-check" --device cuda --shapes quick
    expect "moe-gpu-train-step, no driver" 3 "no cuda driver" -- \
        "$stage/moe-gpu-train-step" --device cuda --quick
fi
expect "moe, no device" 1 "the cuda driver reports no device" -- \
    env LD_LIBRARY_PATH="$stub" STUB_CUDA_DEVICES=0 \
    "$stage/moe" train --model "$fixture" --steps 1 --device cuda
expect "moe, 2 thread ranks on 1 GPU" 1 "2 ranks on this node (2 in-process rank threads) but 1 visible cuda" -- \
    env LD_LIBRARY_PATH="$stub" STUB_CUDA_DEVICES=1 \
    "$stage/moe" train --model "$fixture" --steps 1 --device cuda --layout dp=2 --transport threads
expect "moe, 4 launched local ranks on 2 GPUs" 1 "4 ranks on this node (the local world size announced by torchrun) but 2 visible cuda" -- \
    env LD_LIBRARY_PATH="$stub" STUB_CUDA_DEVICES=2 RANK=3 WORLD_SIZE=4 LOCAL_RANK=3 \
    LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 MASTER_PORT=9 \
    "$stage/moe" train --model "$fixture" --steps 1 --device cuda
expect "moe-gpu-gemm-check, no device" 3 "reports no device" -- \
    env LD_LIBRARY_PATH="$stub" STUB_CUDA_DEVICES=0 \
    "$stage/moe-gpu-gemm-check" --device cuda --shapes quick

# 5) Pack: one tar, xz with a dictionary spanning all binaries, so the LLVM and Burn code they
#    share is stored about once.
manifest="$root/.bench/manifest.txt"
mkdir -p "$root/.bench"
if [ "$pack" = 1 ]; then
    total=$(du -cb "${bins[@]/#/$stage/}" | tail -1 | cut -f1)
    dict_mib=$(((total >> 20) + 64))
    [ "$dict_mib" -gt 1536 ] && dict_mib=1536
    t0=$SECONDS
    tar -cf - -C "$stage" "${bins[@]}" \
        | nice -n "$nice_level" xz -9 --lzma2="preset=9,dict=${dict_mib}MiB" -T1 \
            >"$root/.bench/gpu-bins.tar.xz"
    times+=("xz $((SECONDS - t0)) s")
fi
{
    echo "commit $(git rev-parse HEAD)$(git diff --quiet || echo ' (dirty)')"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm), rustc $(rustc -V | cut -d' ' -f2)"
    echo "route: LLVM $("$prefix/bin/llvm-config" --version) NVPTX (cubecl-cuda default), PTX JIT by the driver; cudarc cuda-12080 dynamic loading"
    for b in "${bins[@]}"; do echo "$b $(stat -c %s "$stage/$b") bytes stripped"; done
    echo "gpu-bins.tar.xz $(stat -c %s "$root/.bench/gpu-bins.tar.xz" 2>/dev/null || echo 0) bytes"
    echo "newest glibc symbol: $glibc"
    echo "times: ${times[*]:-none}"
} >"$manifest"
cat "$manifest"
echo "== $checks refusal checks passed; $((SECONDS - t_all)) s in all"
bash "$root/benches/gpu/run.sh" --dry --out "${TMPDIR:-/tmp}/gpu-dry-run" | tail -3
