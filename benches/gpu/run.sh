#!/usr/bin/env bash
# The GPU run of issue 34, self-checking, in one command on a bare H100/H200 machine (no Rust,
# no network; sized for <= 6 minutes including the machine's start-up):
#
#   benches/gpu/run.sh            on the GPU machine (carry .bench/, see below)
#   benches/gpu/run.sh --dry      anywhere without a GPU: runs to the end, records every case as
#                                 skipped and why, checks what would be carried and prints its
#                                 size (CI runs this)
#
# Cases, in this order (correctness first), each with its own timeout; a case that fails, times
# out or crashes is recorded and the next one runs; the summary JSON ($OUT/gpu_run.json) is
# rewritten after every case and a short table is printed last:
#   preflight            driver, device, capabilities (nvidia-smi, PyTorch), libcuda/NCCL,
#                        libcublas (the image's nvidia-cublas wheel, linked as libcublas.so for
#                        cudarc, with `ldd` of it), `ldd` of every carried binary (a missing
#                        library fails the case)
#   refuse_no_driver     only where no libcuda is installed (--dry here, when .bench is built):
#                        every carried binary asked for CUDA ends with the named error
#   refuse_no_device     `moe train --device cuda` with CUDA_VISIBLE_DEVICES="" ends with the
#                        named error, exit code 1, no panic
#   refuse_too_few_gpus  the same launched as one of (GPUs + 1) local ranks: refused naming both
#                        counts
#   grouped_gemm_rust    moe-backend's grouped GEMM (fprop, dgrad, wgrad) on Burn's CUDA runtime
#                        at DeepSeek-V3 and Qwen3-30B-A3B expert shapes against the device's
#                        dense matmul per group, ragged and empty groups, NaN-poisoned pool,
#                        then timed against a dense matmul of equal FLOPs (moe-gpu-gemm-check,
#                        the grouped_gemm_check bench; --gemm-dtype, default bf16), once per
#                        kernel candidate (--gemm-kernels, default cmma,cublas,tiled: CubeCL's
#                        tensor-core body, cuBLAS's grouped GEMM and the scalar shared-memory
#                        body); the summary names the choice, the fastest candidate that passed
#                        every case (MOE_CUBE_GEMM)
#   torch_ceilings       the image's PyTorch: BF16 dense matmul, copy bandwidth,
#                        torch._grouped_mm (same routing, same checks), NCCL at world size 1
#                        (benches/gpu/torch_ceilings.py)
#   moe_train_nccl       `moe train --device cuda --transport nccl` on the Qwen3-MoE fixture,
#                        2 steps, finite losses: the NCCL transport's bootstrap through the real
#                        libnccl (ncclGetUniqueId, ncclCommInitRank; at world size 1 the
#                        collectives themselves never reach NCCL); BF16 mixed precision, moe
#                        train's default on CUDA (needs binaries built after that default landed)
#   nccl_device          every collective of the NCCL device path on CUDA tensors (f32, bf16,
#                        f16, i64, i32) through the real libnccl at world size 1 against the
#                        threads transport (moe-backend's ignored test
#                        gpu_device_collectives_world_of_one, carried as moe-backend-nccl-tests)
#   train_step           one Qwen3-MoE training step at world size 1 (moe-gpu-train-step, the
#                        cube_train_step bench:
#                        tokens/s, MFU against the BF16 peak; BF16 mixed precision, --bf16,
#                        with the grouped GEMM's automatic kernel choice (tensor cores where
#                        the device has them); --train-args replaces the default "--bf16")
#
# Carried (built by benches/gpu/build-cuda.sh on the CPU machine, gitignored):
#   .bench/gpu-bins.tar.xz  moe, moe-gpu-gemm-check, moe-gpu-train-step
#   .bench/manifest.txt     what was built, from which commit, with which features
#
# Options: --dry | --out DIR (default $OUT, else ./out) | --budget SECONDS (default 330, for all
# cases after the preflight) | --gemm-dtype f32|bf16|f16 | --train-args "ARGS" |
# --only NAME[,NAME...] | --keep (keep the unpacked binaries) | --gemm-kernels LIST (default
# cmma,cublas,tiled)
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

dry=0
out="${OUT:-$root/out}"
budget=330
gemm_dtype=bf16
gemm_kernels=cmma,cublas,tiled
train_args="--bf16"
only=""
keep=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) dry=1 ;;
        --out) out="$2"; shift ;;
        --budget) budget="$2"; shift ;;
        --gemm-dtype) gemm_dtype="$2"; shift ;;
        --gemm-kernels) gemm_kernels="$2"; shift ;;
        --train-args) train_args="$2"; shift ;;
        --only) only="$2"; shift ;;
        --keep) keep=1 ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$gemm_dtype" in f32 | bf16 | f16) ;; *) echo "run.sh: --gemm-dtype f32|bf16|f16" >&2; exit 2 ;; esac
mkdir -p "$out"
summary="$out/gpu_run.json"
records="$out/.cases.jsonl"
table="$out/.table.tsv"
: >"$records"
: >"$table"
bin_dir="${MOE_GPU_BIN_DIR:-/tmp/moe-gpu-bin}"
lib_dir="/tmp/moe-gpu-lib"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
t_start=$SECONDS
deadline=$((SECONDS + budget))

# --- JSON without jq (the GPU image may lack it) -------------------------------------------
json_str() {
    local s=$1
    s=${s//\\/\\\\}
    s=${s//\"/\\\"}
    s=${s//$'\n'/\\n}
    s=${s//$'\r'/}
    s=${s//$'\t'/\\t}
    # Other control characters would break the JSON: drop them.
    s=$(printf '%s' "$s" | tr -d '\000-\010\013\014\016-\037')
    printf '"%s"' "$s"
}

# The carried bytes: what the device tool sends (tracked + untracked-not-ignored files) plus
# the carried .bench directory.
carried_bytes() {
    local files bench
    files=$(git ls-files -z --cached --others --exclude-standard 2>/dev/null \
        | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
    bench=0
    [ -d .bench ] && bench=$(find .bench -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }')
    echo $((files + bench))
}

write_summary() {
    local mode=gpu
    [ "$dry" = 1 ] && mode=dry
    {
        printf '{\n "script": "benches/gpu/run.sh",\n "mode": "%s",\n' "$mode"
        printf ' "started": "%s",\n "seconds": %d,\n' "$started" "$((SECONDS - t_start))"
        printf ' "budget_s": %d,\n "gemm_dtype": "%s",\n' "$budget" "$gemm_dtype"
        printf ' "carried_bytes": %s,\n' "${carried:-0}"
        printf ' "commit": %s,\n' "$(json_str "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)")"
        printf ' "cases": [\n'
        awk 'NR > 1 { print prev "," } { prev = $0 } END { if (NR) print prev }' "$records"
        printf ' ]\n}\n'
    } >"$summary.tmp" && mv "$summary.tmp" "$summary"
}

# record NAME STATUS SECONDS SUMMARY [RESULT_JSON_FILE]
record() {
    local name=$1 status=$2 secs=$3 text=$4 file=${5:-} result=null
    if [ -n "$file" ] && [ -s "$file" ]; then
        result=$(tr '\n' ' ' <"$file")
    fi
    printf '  {"case": %s, "status": %s, "seconds": %s, "summary": %s, "result": %s}\n' \
        "$(json_str "$name")" "$(json_str "$status")" "$secs" "$(json_str "$text")" \
        "$result" >>"$records"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$secs" "${text:0:90}" >>"$table"
    write_summary
    printf '== %-20s %-8s %4ss  %s\n' "$name" "$status" "$secs" "${text:0:200}"
}

wanted() {
    [ -z "$only" ] && return 0
    case ",$only," in *",$1,"*) return 0 ;; esac
    return 1
}

# run_case NAME TIMEOUT WHY_SKIPPED_OR_EMPTY -- command...: runs the command with the timeout
# (capped by what is left of the budget), its output to $out/NAME.log; sets $rc, $secs.
rc=0
secs=0
run_case() {
    local name=$1 limit=$2
    shift 3
    local left=$((deadline - SECONDS))
    [ "$limit" -gt "$left" ] && limit=$left
    local t0=$SECONDS
    if [ "$limit" -le 5 ]; then
        rc=125
        secs=0
        return
    fi
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    secs=$((SECONDS - t0))
}

# Status of a finished case from its exit code.
status_of() {
    case "$1" in
        0) echo pass ;;
        124 | 137) echo timeout ;;
        125) echo skipped ;;
        *) echo fail ;;
    esac
}

carried=$(carried_bytes)
echo "== carried: $carried bytes ($((carried / 1048576)) MiB of the 64 MiB a device call takes)"

# --- preflight ----------------------------------------------------------------------------
gpu_reason=""
if [ "$dry" = 1 ]; then
    gpu_reason="dry mode (--dry): no GPU is used"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
    gpu_reason="no nvidia-smi on this machine: no NVIDIA driver"
elif ! nvidia-smi -L >/dev/null 2>&1; then
    gpu_reason="nvidia-smi lists no GPU: $(nvidia-smi -L 2>&1 | head -1)"
fi

pre_log="$out/preflight.log"
pre_status=pass
pre_text=""
{
    echo "host: $(uname -srm), $(nproc) cores, commit $(git rev-parse --short HEAD 2>/dev/null)"
    if [ -z "$gpu_reason" ]; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm \
            --format=csv 2>&1
        python3 - <<'PY' 2>&1 || true
import torch
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} cuda {torch.version.cuda}: {p.name}, sm_{p.major}{p.minor}, "
      f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
PY
    else
        echo "no GPU: $gpu_reason"
    fi
    ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc|libnccl|libcublas' || echo "ldconfig: no libcuda / libnvrtc / libnccl / libcublas"
} >"$pre_log" 2>&1

# NCCL from the image's PyTorch wheels: cudarc loads `libnccl.so`, the wheel ships libnccl.so.2.
if [ -z "$gpu_reason" ]; then
    nccl_so=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
    if [ -n "$nccl_so" ] && [ -f "$nccl_so" ]; then
        mkdir -p "$lib_dir"
        ln -sf "$nccl_so" "$lib_dir/libnccl.so"
        ln -sf "$nccl_so" "$lib_dir/libnccl.so.2"
        export LD_LIBRARY_PATH="$lib_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "libnccl.so -> $nccl_so" >>"$pre_log"
    else
        echo "no nvidia.nccl wheel found: the NCCL cases will fail" >>"$pre_log"
    fi
fi

# cuBLAS (the grouped GEMM's `cublas` candidate) from the image's PyTorch wheels: cudarc opens
# `libcublas.so` (or .so.12, .so.11, ...) at run time, the CUDA 13 wheel ships libcublas.so.13
# next to libcublasLt.so.13, so link it and put the wheel's directory on the library path.
if [ -z "$gpu_reason" ]; then
    cublas_so=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
hits = []
for r in roots:
    hits += glob.glob(os.path.join(r, "nvidia", "**", "libcublas.so*"), recursive=True)
print(sorted(hits)[-1] if hits else "")
PY
)
    if [ -z "$cublas_so" ]; then
        cublas_so=$(ldconfig -p 2>/dev/null | awk '/libcublas\.so/ && !/Lt/ { print $NF; exit }')
    fi
    if [ -n "$cublas_so" ] && [ -f "$cublas_so" ]; then
        mkdir -p "$lib_dir"
        ln -sf "$cublas_so" "$lib_dir/libcublas.so"
        export LD_LIBRARY_PATH="$lib_dir:$(dirname "$cublas_so")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "libcublas.so -> $cublas_so" >>"$pre_log"
        echo "ldd libcublas: $(ldd "$cublas_so" 2>&1 | awk '{print $1, $3}' | tr '\n' ' ')" >>"$pre_log"
        if ldd "$cublas_so" 2>&1 | grep -q 'not found'; then
            pre_text+="libcublas needs $(ldd "$cublas_so" 2>&1 | awk '/not found/ {print $1}' | tr '\n' ' ')(the cublas candidate will fall back); "
        fi
    else
        echo "no libcublas (nvidia-cublas wheel or system): the cublas candidate falls back to the scalar kernel" >>"$pre_log"
        pre_text+="no libcublas (the cublas candidate falls back); "
    fi
fi

# The carried binaries: unpack and check their libraries.
bins=(moe moe-gpu-gemm-check moe-gpu-train-step)
if [ -f .bench/gpu-bins.tar.xz ]; then
    mkdir -p "$bin_dir"
    if tar -xJf .bench/gpu-bins.tar.xz -C "$bin_dir" 2>>"$pre_log"; then
        [ -f .bench/manifest.txt ] && sed 's/^/manifest: /' .bench/manifest.txt >>"$pre_log"
        for b in "${bins[@]}"; do
            if [ ! -x "$bin_dir/$b" ]; then
                echo "missing binary $b in .bench/gpu-bins.tar.xz" >>"$pre_log"
                pre_status=fail
                pre_text+="no $b; "
                continue
            fi
            missing=$(ldd "$bin_dir/$b" 2>&1 | grep 'not found' | awk '{print $1}' | tr '\n' ' ')
            echo "ldd $b: $(ldd "$bin_dir/$b" 2>&1 | awk '{print $1}' | tr '\n' ' ')" >>"$pre_log"
            if [ -n "$missing" ]; then
                pre_status=fail
                pre_text+="$b needs $missing; "
            fi
        done
    else
        pre_status=fail
        pre_text+="cannot unpack .bench/gpu-bins.tar.xz; "
    fi
else
    if [ "$dry" = 1 ]; then
        pre_text+="no .bench/gpu-bins.tar.xz here (build it with benches/gpu/build-cuda.sh); "
    else
        pre_status=fail
        pre_text+="no .bench/gpu-bins.tar.xz: build it with benches/gpu/build-cuda.sh and carry .bench; "
    fi
fi
if [ "$carried" -gt $((64 * 1048576)) ]; then
    pre_status=fail
    pre_text+="carried set over 64 MiB; "
fi
if [ -n "$gpu_reason" ]; then
    pre_text+="$gpu_reason"
else
    pre_text+="$(nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap \
        --format=csv,noheader 2>&1 | head -1)"
fi
record preflight "$pre_status" 0 "$pre_text" ""

# skip_or NAME: records NAME as skipped (no GPU, or not asked for) and returns 0, else 1.
skip_or() {
    local name=$1
    if ! wanted "$name"; then
        return 0
    fi
    if [ -n "$gpu_reason" ]; then
        record "$name" skipped 0 "$gpu_reason" ""
        return 0
    fi
    if [ ! -d "$bin_dir" ] && [ "$name" != torch_ceilings ]; then
        record "$name" skipped 0 "no unpacked binaries (see preflight)" ""
        return 0
    fi
    return 1
}

fixture="$root/tests/fixtures/qwen3_moe"
gpus=0
[ -z "$gpu_reason" ] && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')

# --- refusals -------------------------------------------------------------------------------
# Without a driver (this machine in --dry mode): every carried binary ends with the named error.
if wanted refuse_no_driver && [ -d "$bin_dir" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so'; then
    t0=$SECONDS
    st=pass
    text=""
    for cmd in "moe train --model $fixture --steps 1 --device cuda:1" \
        "moe-gpu-gemm-check --device cuda --shapes quick:3" \
        "moe-gpu-train-step --device cuda --quick:3"; do
        want=${cmd##*:}
        cmd=${cmd%:*}
        # shellcheck disable=SC2086 # the command line is split on purpose
        timeout 30 "$bin_dir"/$cmd >"$out/refuse_no_driver.log" 2>&1
        code=$?
        if [ "$code" != "$want" ] || ! grep -q 'no cuda driver' "$out/refuse_no_driver.log" \
            || grep -qE 'panicked|RecvError' "$out/refuse_no_driver.log"; then
            st=fail
            text+="${cmd%% *}: exit $code, $(head -c 200 "$out/refuse_no_driver.log"); "
        else
            text+="${cmd%% *}: exit $code; "
        fi
    done
    record refuse_no_driver "$st" "$((SECONDS - t0))" "$text$(head -c 160 "$out/refuse_no_driver.log")" ""
fi
if ! skip_or refuse_no_device; then
    run_case refuse_no_device 20 "" env CUDA_VISIBLE_DEVICES= "$bin_dir/moe" train \
        --model "$fixture" --steps 1 --device cuda
    log="$out/refuse_no_device.log"
    if [ "$rc" = 1 ] && grep -q 'reports no device' "$log" && ! grep -qE 'panicked|RecvError' "$log"; then
        record refuse_no_device pass "$secs" "$(head -c 200 "$log")" ""
    else
        record refuse_no_device fail "$secs" "exit $rc: $(head -c 300 "$log")" ""
    fi
fi
if ! skip_or refuse_too_few_gpus; then
    n=$((gpus + 1))
    run_case refuse_too_few_gpus 20 "" env RANK=0 WORLD_SIZE="$n" LOCAL_RANK=0 \
        LOCAL_WORLD_SIZE="$n" MASTER_ADDR=127.0.0.1 MASTER_PORT=29531 \
        "$bin_dir/moe" train --model "$fixture" --steps 1 --device cuda
    log="$out/refuse_too_few_gpus.log"
    if [ "$rc" = 1 ] && grep -q "$n ranks on this node" "$log" && grep -q "but $gpus visible" "$log" \
        && ! grep -qE 'panicked|RecvError' "$log"; then
        record refuse_too_few_gpus pass "$secs" "$(head -c 200 "$log")" ""
    else
        record refuse_too_few_gpus fail "$secs" "exit $rc: $(head -c 300 "$log")" ""
    fi
fi

# --- correctness, then speed: grouped GEMM (Rust) -----------------------------------------
if ! skip_or grouped_gemm_rust; then
    json="$out/grouped_gemm_rust.json"
    run_case grouped_gemm_rust 170 "" "$bin_dir/moe-gpu-gemm-check" --device cuda \
        --dtype "$gemm_dtype" --shapes deepseek_v3,qwen3_30b_a3b --kernels "$gemm_kernels" \
        --iters 5 --json "$json"
    text="$(grep -cE ' pass ' "$out/grouped_gemm_rust.log") pass, $(grep -cE ' FAIL | ERROR ' "$out/grouped_gemm_rust.log") fail/error; $(grep -oE '^choice: [^ ]+' "$out/grouped_gemm_rust.log"); $(grep -oE '\[[a-z]+\] .*ratio [0-9.]+' "$out/grouped_gemm_rust.log" | sed -E 's/\] .*ratio /]/' | tr '\n' ' ')"
    record grouped_gemm_rust "$(status_of "$rc")" "$secs" "$text" "$json"
fi

# --- the image's PyTorch: ceilings and references -----------------------------------------
if ! skip_or torch_ceilings; then
    json="$out/torch_ceilings.json"
    run_case torch_ceilings 75 "" python3 "$root/benches/gpu/torch_ceilings.py" --json "$json"
    text="$(grep -cE ' pass ' "$out/torch_ceilings.log") pass, $(grep -cE ' (fail|error) ' "$out/torch_ceilings.log") fail/error; $(grep -E '^dense_bf16_8192|^copy_bandwidth' "$out/torch_ceilings.log" | awk '{$2=""; print}' | tr -s ' ' | tr '\n' ';')"
    record torch_ceilings "$(status_of "$rc")" "$secs" "$text" "$json"
fi

# --- the CLI end to end on the GPU: CUDA + NCCL, 2 steps ------------------------------------
if ! skip_or moe_train_nccl; then
    metrics="$out/moe_train_nccl.jsonl"
    rm -f "$metrics"
    run_case moe_train_nccl 75 "" "$bin_dir/moe" train --model "$fixture" --device cuda \
        --transport nccl --steps 2 --gbs 4 --seq-len 16 --metrics-out "$metrics"
    st=$(status_of "$rc")
    if [ "$st" = pass ] && { [ ! -s "$metrics" ] || grep -qiE '"loss": *(null|nan|inf)' "$metrics"; }; then
        st=fail
    fi
    record moe_train_nccl "$st" "$secs" "$(tail -c 300 "$out/moe_train_nccl.log" | tr '\n' ' ')" ""
fi

# --- NCCL on device memory: every collective on CUDA tensors through the real libnccl ---------
# The ignored test `gpu_device_collectives_world_of_one` of moe-backend (features cuda,nccl),
# carried as the test binary moe-backend-nccl-tests when the build packs it:
#   cargo test --release -p moe-backend --features cuda,nccl --lib --no-run
if ! skip_or nccl_device; then
    tests_bin="$bin_dir/moe-backend-nccl-tests"
    if [ ! -x "$tests_bin" ]; then
        record nccl_device skipped 0 "no moe-backend-nccl-tests in the carried set (build it with cargo test --release -p moe-backend --features cuda,nccl --lib --no-run)" ""
    else
        run_case nccl_device 60 "" "$tests_bin" --ignored --exact \
            comm::nccl::device::tests::gpu_device_collectives_world_of_one --nocapture
        record nccl_device "$(status_of "$rc")" "$secs" \
            "$(grep -E 'nccl_device:|test result|panicked' "$out/nccl_device.log" | tr '\n' ' ' | head -c 300)" ""
    fi
fi

# --- one Qwen3-MoE training step at world size 1 -------------------------------------------
if ! skip_or train_step; then
    json="$out/train_step.json"
    left=$((deadline - SECONDS))
    # shellcheck disable=SC2086 # --train-args is a list of arguments
    run_case train_step "$left" "" "$bin_dir/moe-gpu-train-step" --device cuda --warmup 1 \
        --steps 3 --json "$json" $train_args
    record train_step "$(status_of "$rc")" "$secs" \
        "$(grep -E 'MFU|tokens/s' "$out/train_step.log" | tail -1)" "$json"
fi

[ "$keep" = 1 ] || { [ -d "$bin_dir" ] && [ "$bin_dir" = /tmp/moe-gpu-bin ] && rm -rf "$bin_dir"; }
write_summary
rm -f "$records.tmp"

echo
echo "== GPU run ($([ "$dry" = 1 ] && echo dry || echo gpu)), $((SECONDS - t_start)) s, carried $((carried / 1048576)) MiB; JSON: $summary"
printf '%-20s %-8s %5s  %s\n' case status s summary
while IFS=$'\t' read -r name status s text; do
    printf '%-20s %-8s %5s  %s\n' "$name" "$status" "$s" "$text"
done <"$table"
bad=$(awk -F'\t' '$2 == "fail" || $2 == "timeout" || $2 == "error"' "$table" | wc -l)
pass=$(awk -F'\t' '$2 == "pass"' "$table" | wc -l)
skipped=$(awk -F'\t' '$2 == "skipped"' "$table" | wc -l)
echo "gpu run: pass $pass, fail $bad, skipped $skipped"
[ "$bad" = 0 ]
