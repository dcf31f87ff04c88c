#!/usr/bin/env bash
# Builds the `moe` CLI with Burn's CUDA backend (feature `cuda`) on a machine without network
# access to GitHub, so a prepared binary can be carried to a GPU machine
# (`moe train --device cuda`, `moe logits --device cuda`).
#
# Why this is needed: Burn 0.22.1's `cuda` feature pulls cubecl-cuda 0.11.3, which depends
# unconditionally on cubecl-llvm, whose build dependency `tracel-llvm-bundler` 23.1.0-4
# downloads a prebuilt LLVM 23.1 bundle from GitHub at build time (no feature turns it off).
# The bundler skips the download when its install directory already holds the sentinel
# `.tracel-llvm-installed`, and then asks `<dir>/bin/llvm-config --link-static` for the
# libraries. This script fills that directory with Debian's LLVM (`llvm-22-dev`, from the
# Debian mirror) instead.
#
# What is known, stated honestly:
# - llvm-sys 231 is written against LLVM 23's C API; LLVM 22's is close (the issue that
#   introduced this route linked it), but the result has not been run on a GPU: the CUDA
#   kernels themselves are compiled at run time by NVRTC (needs the CUDA driver and NVRTC on
#   the GPU machine), and the LLVM path is only used by cubecl-llvm's own code paths.
# - The binary links LLVM statically: expect a large file; `strip` + `xz -9` before carrying it
#   (the device machines take 64 MiB in all).
# - `DOCS_RS=1 cargo check --features cuda` (what .ci/run does) needs none of this.
# - Tried on the CI machine (2026-12-03): with `libpolly-22-dev` added, cubecl-llvm and the
#   whole `moe-backend --features cuda` library compile against LLVM 22.1.8; the first link of
#   a binary failed on `-llibz3` (the bundler turns Debian's `/usr/lib/.../libz3.so` into that
#   name), which the `llvm-config` wrapper below fixes; a complete link after that fix was not
#   reached within that session.
#
# Usage: benches/gpu/build-cuda.sh [extra cargo args]
#   LLVM_MAJOR (default 22), CARGO_TARGET_DIR (default target-cuda), OUT_DIR (default .bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
major="${LLVM_MAJOR:-22}"
target="${CARGO_TARGET_DIR:-$PWD/target-cuda}"
out="${OUT_DIR:-$PWD/.bench}"

# 1) Debian's LLVM with static libraries, and what a static LLVM link needs.
pkgs=("llvm-$major-dev" "libclang-$major-dev" "libpolly-$major-dev" zlib1g-dev libzstd-dev libxml2-dev
    libffi-dev)
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
echo "== LLVM $("$prefix/bin/llvm-config" --version) from $prefix"

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
rm -rf "$bundle/bin"
mkdir -p "$bundle/bin"
cat > "$bundle/bin/llvm-config" <<WRAP
#!/bin/sh
"$prefix/bin/llvm-config" "\$@" | sed -E 's#/[^ ]*/lib([A-Za-z0-9_+-]+)\.(so|a)#-l\1#g'
WRAP
chmod +x "$bundle/bin/llvm-config"
touch "$bundle/.tracel-llvm-installed"
echo "== bundle directory $bundle -> $prefix"

# 3) The build (release-like dependencies as in the dev profile; the CLI with `cuda`).
export CARGO_TARGET_DIR="$target"
cargo build --bin moe --features cuda "$@"
bin="$target/debug/moe"
mkdir -p "$out"
cp "$bin" "$out/moe-cuda"
strip "$out/moe-cuda"
xz -9 -kf "$out/moe-cuda"
ls -l "$out/moe-cuda" "$out/moe-cuda.xz"
echo "== carry $out/moe-cuda.xz; on the GPU machine: xz -d, then"
echo "   ./moe-cuda train --model <HF dir> --device cuda --steps 2 --metrics-out metrics.jsonl"
