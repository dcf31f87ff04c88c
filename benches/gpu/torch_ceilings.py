#!/usr/bin/env python3
"""Ceilings and references measured with the GPU machine's own PyTorch, in the same run as the
Rust cases of `benches/gpu/run.sh` (device-side only: CI never runs this file).

Cases (each one recorded in `--json PATH`, rewritten after every case; an exception in one
case is recorded as an error and the next case runs):
- `dense_bf16_*`: BF16 dense matmul at the grouped GEMM's FLOPs for the DeepSeek-V3 and
  Qwen3-30B-A3B expert shapes, and 8192^3 (the device's tensor-core ceiling);
- `copy_bandwidth`: a 2 GiB device-to-device copy, bytes read plus written per second;
- `grouped_mm_{fprop,dgrad,wgrad}_{shapes}`: `torch._grouped_mm` (what torchtitan's and
  Megatron's BF16 grouped GEMMs amount to) with the routing of the Rust case (ragged, the
  first, last and every 11th expert empty) against the device's dense matmul per group, with
  the output pool NaN-poisoned (a NaN tensor of the output's size freed just before; the
  caching allocator hands its block to the output), then timed against one dense matmul of
  equal FLOPs;
- `nccl_world1_*`: NCCL at world size 1 through `torch.distributed` (the image's NCCL):
  all-reduce, all-gather, reduce-scatter, all-to-all, broadcast on 256 MiB, checked and timed.

Timing: CUDA events around each call, median of `--iters` after 3 warm-ups. Correctness:
no NaN, and max|out - ref| <= tol * max|ref| (bf16: 2e-2).
"""

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

SHAPES = {
    "deepseek_v3": dict(tokens=4096, hidden=7168, width=2048, experts=256, top_k=8),
    "qwen3_30b_a3b": dict(tokens=4096, hidden=2048, width=768, experts=128, top_k=8),
    "quick": dict(tokens=64, hidden=96, width=80, experts=24, top_k=3),
}
TOL_BF16 = 2e-2
# `--device cpu` runs the cases' logic on the CPU (quick shapes), to check this script without a
# GPU; the numbers are then meaningless.
DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class SplitMix:
    """SplitMix64, the generator of the Rust case (`grouped_gemm_check`)."""

    def __init__(self, seed):
        self.state = seed

    def next(self):
        mask = (1 << 64) - 1
        self.state = (self.state + 0x9E3779B97F4A7C15) & mask
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)


def empty_expert(e, experts):
    return e == 0 or e + 1 == experts or e % 11 == 5


def group_sizes(s, seed=42):
    """The Rust case's group sizes (same generator, same empty experts)."""
    rng = SplitMix(seed)
    live = [e for e in range(s["experts"]) if not empty_expert(e, s["experts"])]
    sizes = [0] * s["experts"]
    order = list(live)
    for _ in range(s["tokens"]):
        for i in range(min(s["top_k"], len(order))):
            j = i + rng.next() % (len(order) - i)
            order[i], order[j] = order[j], order[i]
            sizes[order[i]] += 1
    return sizes


def median_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        if DEVICE != "cuda":
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def poison(shape, dtype):
    """Frees a NaN tensor of `shape`, so the caching allocator hands its block to the output."""
    t = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    sync()
    del t


def compare(got, want, tol):
    got, want = got.float(), want.float()
    nan = bool(torch.isnan(got).any())
    err = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    rel = err / scale if scale > 0 else err
    ok = (not nan) and math.isfinite(rel) and rel <= tol
    return dict(status="pass" if ok else "fail", max_abs_err=err, max_abs_ref=scale,
                rel_err=rel, tol=tol, nan_in_output=nan)


def case_dense(name, m, k, n, iters):
    a = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=DEVICE, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, iters)
    flops = 2.0 * m * k * n
    return dict(case=name, status="pass", m=m, k=k, n=n, ms=ms, tflops=flops / ms / 1e9,
                summary=f"{flops / ms / 1e9:.0f} TFLOP/s")


def case_copy(iters):
    n = (2 << 30) // 4
    src = torch.rand(n, device=DEVICE, dtype=torch.float32)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters)
    ok = bool(torch.equal(dst[:4096], src[:4096]))
    gbps = 2.0 * n * 4 / ms / 1e6
    return dict(case="copy_bandwidth", status="pass" if ok else "fail", bytes=2 * n * 4, ms=ms,
                gbps=gbps, summary=f"{gbps:.0f} GB/s")


def grouped_cases(shape_name, iters, out):
    s = SHAPES[shape_name]
    sizes = group_sizes(s)
    n, h, f, e = sum(sizes), s["hidden"], s["width"], s["experts"]
    bf = torch.bfloat16
    x = torch.rand(n, h, device=DEVICE, dtype=bf) * 2 - 1
    w = torch.rand(e, f, h, device=DEVICE, dtype=bf) * 2 - 1  # [E, out, in], as the Rust case
    dy = torch.rand(n, f, device=DEVICE, dtype=bf) * 2 - 1
    offs = torch.tensor(sizes, device=DEVICE, dtype=torch.int32).cumsum(0).to(torch.int32)
    bounds = [0]
    for c in sizes:
        bounds.append(bounds[-1] + c)
    flops = 2.0 * n * h * f
    grouped_mm = getattr(torch, "_grouped_mm", None)

    def one(op, run, reference, dense, out_shape):
        name = f"grouped_mm_{op}_{shape_name}"
        if grouped_mm is None:
            out(dict(case=name, status="skipped", reason=f"torch {torch.__version__} has no "
                     "torch._grouped_mm"))
            return
        try:
            poison(out_shape, bf)
            got = run()
            sync()
            rec = compare(got, reference(), TOL_BF16)
            del got
            ms = median_ms(run, iters)
            dense_ms = median_ms(dense, iters)
            tg, td = flops / ms / 1e9, flops / dense_ms / 1e9
            rec.update(case=name, op=op, shapes=shape_name, flops=flops, ms=ms, tflops=tg,
                       dense_ms=dense_ms, dense_tflops=td, ratio_grouped_over_dense=tg / td,
                       summary=f"rel err {rec['rel_err']:.1e}, {tg:.0f} TFLOP/s "
                               f"({tg / td:.2f} of dense)")
            out(rec)
        except Exception as exc:  # recorded, and the next case runs
            out(dict(case=name, status="error", error=f"{type(exc).__name__}: {exc}",
                     trace=traceback.format_exc(limit=3)))

    wt = w.transpose(-2, -1)  # [E, in, out], column-major: the layout _grouped_mm wants
    one("fprop", lambda: grouped_mm(x, wt, offs=offs),
        lambda: torch.cat([x[bounds[g]:bounds[g + 1]] @ w[g].t() for g in range(e)
                           if sizes[g]]),
        lambda: x @ w[1].t(), (n, f))
    one("dgrad", lambda: grouped_mm(dy, w, offs=offs),
        lambda: torch.cat([dy[bounds[g]:bounds[g + 1]] @ w[g] for g in range(e) if sizes[g]]),
        lambda: dy @ w[1], (n, h))
    dyt = dy.t()
    one("wgrad", lambda: grouped_mm(dyt, x, offs=offs),
        lambda: torch.stack([dyt[:, bounds[g]:bounds[g + 1]] @ x[bounds[g]:bounds[g + 1]]
                             if sizes[g] else torch.zeros(f, h, device=DEVICE, dtype=bf)
                             for g in range(e)]),
        lambda: dyt @ x, (e, f, h))


def nccl_cases(iters, out):
    import torch.distributed as dist

    if not dist.is_nccl_available():
        out(dict(case="nccl_world1", status="skipped", reason="this torch has no NCCL"))
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        version = ".".join(str(v) for v in torch.cuda.nccl.version())
        numel = (256 << 20) // 4
        x = torch.rand(numel, device=DEVICE, dtype=torch.float32)
        bytes_ = numel * 4
        cases = {
            "all_reduce": lambda y: dist.all_reduce(y),
            "all_gather": lambda y: dist.all_gather_into_tensor(torch.empty_like(y), y),
            "reduce_scatter": lambda y: dist.reduce_scatter_tensor(torch.empty_like(y), y),
            "all_to_all": lambda y: dist.all_to_all_single(torch.empty_like(y), y),
            "broadcast": lambda y: dist.broadcast(y, src=0),
        }
        for op, fn in cases.items():
            name = f"nccl_world1_{op}"
            try:
                y = x.clone()
                if op == "all_gather":
                    got = torch.empty_like(y)
                    dist.all_gather_into_tensor(got, y)
                elif op == "reduce_scatter":
                    got = torch.empty_like(y)
                    dist.reduce_scatter_tensor(got, y)
                elif op == "all_to_all":
                    got = torch.empty_like(y)
                    dist.all_to_all_single(got, y)
                else:
                    fn(y)
                    got = y
                torch.cuda.synchronize()
                ok = bool(torch.equal(got, x))  # world size 1: every collective is the identity
                ms = median_ms(lambda: fn(x.clone()), iters, warmup=2)
                out(dict(case=name, status="pass" if ok else "fail", nccl=version, bytes=bytes_,
                         ms=ms, algbw_gbps=bytes_ / ms / 1e6,
                         summary=f"NCCL {version}, {bytes_ / ms / 1e6:.0f} GB/s (incl. clone)"))
            except Exception as exc:
                out(dict(case=name, status="error", error=f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--shapes", default="deepseek_v3,qwen3_30b_a3b")
    p.add_argument("--cases", default="dense,copy,grouped_mm,nccl")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    global DEVICE
    DEVICE = args.device
    report = dict(script="benches/gpu/torch_ceilings.py", torch=torch.__version__,
                  cuda=torch.version.cuda, cases=[])

    def write():
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(report, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, args.json)

    def out(rec):
        report["cases"].append(rec)
        print(f"{rec['case']:<40} {rec['status']:>7}  "
              f"{rec.get('summary') or rec.get('error') or rec.get('reason', '')}", flush=True)
        write()

    if DEVICE == "cuda" and not torch.cuda.is_available():
        report["error"] = "torch.cuda.is_available() is false"
        write()
        print("torch: no CUDA device", file=sys.stderr)
        return 1
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        report["device"] = dict(name=props.name, capability=f"{props.major}.{props.minor}",
                                sms=props.multi_processor_count,
                                memory_gib=props.total_memory / 2**30)
    else:
        report["device"] = dict(name="cpu (a check of this script; numbers meaningless)")
    write()
    wanted = args.cases.split(",")
    shapes = [s for s in args.shapes.split(",") if s]
    t0 = time.time()
    if "dense" in wanted:
        for s in shapes:
            d = SHAPES[s]
            rows = d["tokens"] * d["top_k"]
            try:
                out(case_dense(f"dense_bf16_{s}", rows, d["hidden"], d["width"], args.iters))
            except Exception as exc:
                out(dict(case=f"dense_bf16_{s}", status="error", error=str(exc)))
        try:
            if DEVICE == "cuda":
                out(case_dense("dense_bf16_8192", 8192, 8192, 8192, args.iters))
        except Exception as exc:
            out(dict(case="dense_bf16_8192", status="error", error=str(exc)))
    if "copy" in wanted and DEVICE == "cuda":
        try:
            out(case_copy(args.iters))
        except Exception as exc:
            out(dict(case="copy_bandwidth", status="error", error=str(exc)))
    if "grouped_mm" in wanted:
        for s in shapes:
            grouped_cases(s, args.iters, out)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if "nccl" in wanted and DEVICE == "cuda":
        try:
            nccl_cases(args.iters, out)
        except Exception as exc:
            out(dict(case="nccl_world1", status="error", error=f"{type(exc).__name__}: {exc}"))
    report["seconds"] = time.time() - t0
    write()
    bad = [c["case"] for c in report["cases"] if c["status"] in ("fail", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
