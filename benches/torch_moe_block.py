#!/usr/bin/env python3
"""PyTorch reference timing for one Qwen3-MoE sparse MoE block on CPU (forward+backward).

Times HF transformers 5.23 `Qwen3MoeSparseMoeBlock` with `config._experts_implementation =
"grouped_mm"` (sort tokens by expert, then `torch.nn.functional.grouped_mm`), the fastest CPU
path, at the Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8, expert width 768),
2048 tokens, float32, plus one dense f32 GEMM [16384,2048]x[2048,768] for reference.
The script fails if the grouped_mm path (aten._grouped_mm) is not what actually ran.

Install (PyPI only; torch is the default CUDA wheel, whose nvidia-* dependencies (~5 GB) are
needed just to `import torch`, even on CPU: `--no-deps` installs fail with libcudart not found):
    python3 -m venv benches/.venv
    benches/.venv/bin/pip install torch==2.15.0 transformers==5.23.0 safetensors accelerate

Usage:
    benches/.venv/bin/python benches/torch_moe_block.py [--iters 5] [--threads N] [--json]

Output: `key: value` lines; with --json, one final JSON line holding the same keys.
FLOP counts cover the three expert GEMMs only (gate, up, down; router GEMM excluded):
forward = 3 * 2*T*k*H*W, forward+backward = 3x that.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3MoeConfig
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, grouped_mm_experts_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock


class OpCounter(TorchDispatchMode):
    """Counts the aten/custom ops dispatched inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def median_seconds(fn, warmup, iters, setup=None):
    for _ in range(warmup):
        setup and setup()
        fn()
    times = []
    for _ in range(iters):
        setup and setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--width", type=int, default=768, help="moe_intermediate_size")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print a one-line JSON")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    T, H, E, K, W = a.tokens, a.hidden, a.experts, a.top_k, a.width

    config = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K,
                            moe_intermediate_size=W, norm_topk_prob=True, dtype=torch.float32)
    # A bare config defaults to None, i.e. the eager per-expert loop; the block reads this
    # property at every forward via ALL_EXPERTS_FUNCTIONS (transformers/integrations/moe.py).
    config._experts_implementation = "grouped_mm"
    if config._experts_implementation != "grouped_mm" or \
            ALL_EXPERTS_FUNCTIONS.get_interface("grouped_mm", None) is not grouped_mm_experts_forward:
        sys.exit("FATAL: could not select experts implementation 'grouped_mm'")
    block = Qwen3MoeSparseMoeBlock(config).float()
    with torch.no_grad():  # experts are torch.empty and the router is zeros: init like HF does
        for prm in block.parameters():
            prm.normal_(0.0, config.initializer_range)
    x = torch.randn(1, T, H, requires_grad=True)
    gy = torch.randn(1, T, H)

    def zero_grads():
        block.zero_grad(set_to_none=True)
        x.grad = None

    def fwd_bwd():
        block(x).backward(gy)

    def fwd():
        with torch.no_grad():
            block(x)

    # Prove the grouped_mm kernel ran: one traced fwd+bwd must use aten._grouped_mm and
    # neither transformers' python fallback (grouped_mm_fallback) nor the eager index_add_ loop.
    with OpCounter() as fwd_ops:
        y = block(x)
    with OpCounter() as bwd_ops:
        y.backward(gy)
    zero_grads()
    gmm = "aten._grouped_mm.default"
    bad = [n for n in list(fwd_ops.counts) + list(bwd_ops.counts) if "fallback" in n or "index_add" in n]
    if fwd_ops.counts.get(gmm, 0) != 2 or bwd_ops.counts.get(gmm, 0) < 2 or bad:
        seen = {n: c for ops in (fwd_ops, bwd_ops) for n, c in ops.counts.items() if "mm" in n or n in bad}
        sys.exit(f"FATAL: grouped_mm path not used (ops seen: {seen})")
    with torch.no_grad():
        _, _, idx = block.gate(x.view(-1, H))
        load = torch.bincount(idx.flatten(), minlength=E)

    t_fb = median_seconds(fwd_bwd, a.warmup, a.iters, setup=zero_grads)
    t_f = median_seconds(fwd, a.warmup, a.iters)
    m_dense = T * K  # the dense GEMM has as many rows as routed (token, expert) pairs
    A, B = torch.randn(m_dense, H), torch.randn(H, W)
    C = torch.empty(m_dense, W)
    t_mm = median_seconds(lambda: torch.matmul(A, B, out=C), a.warmup + 1, a.iters)

    fwd_flop = 3 * 2 * T * K * H * W
    r = {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": sys.executable,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_available": torch.backends.mkl.is_available(),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("OPENBLAS_", "OMP_", "MKL_", "KMP_", "DNNL_", "ONEDNN_"))},
        "experts_implementation": config._experts_implementation,
        "grouped_mm_calls_fwd": fwd_ops.counts[gmm],
        "grouped_mm_calls_bwd": bwd_ops.counts[gmm],
        "shape": f"T={T} H={H} E={E} k={K} W={W} f32 norm_topk_prob=True",
        "routing_tokens_per_expert_min": int(load.min()),
        "routing_tokens_per_expert_max": int(load.max()),
        "iters": a.iters,
        "torch_moe_fwd_bwd_s": round(t_fb, 4),
        "torch_moe_fwd_bwd_tokens_per_s": round(T / t_fb, 1),
        "torch_moe_fwd_bwd_gflops": round(3 * fwd_flop / t_fb / 1e9, 2),
        "torch_moe_fwd_s": round(t_f, 4),
        "torch_moe_fwd_tokens_per_s": round(T / t_f, 1),
        "torch_moe_fwd_gflops": round(fwd_flop / t_f / 1e9, 2),
        "torch_dense_gemm_shape": f"[{m_dense},{H}]x[{H},{W}]",
        "torch_dense_gemm_s": round(t_mm, 4),
        "torch_dense_gemm_gflops": round(2 * m_dense * H * W / t_mm / 1e9, 2),
    }
    for k, v in r.items():
        print(f"{k}: {v}")
    if a.json:
        print(json.dumps(r, separators=(",", ":")))


if __name__ == "__main__":
    main()
