#!/usr/bin/env python3
"""PyTorch reference timing of one Qwen3-MoE training step on CPU (forward + backward + AdamW).

Trains HF transformers 5.23 `Qwen3MoeForCausalLM` (random init, float32) on one batch of token
ids: `loss = model(ids, labels=ids).loss` (cross-entropy + router_aux_loss_coef x HF's
load-balancing loss, `output_router_logits=True`), `loss.backward()`,
`clip_grad_norm_(1.0)`, `AdamW.step()`, `zero_grad()`. The model shape and the token ids are
those of `benches/train_step.rs` (same 64-bit LCG), which runs this script in the same run.

The routed experts run through `config._experts_implementation` (`--experts`): `grouped_mm`
(sort by expert, `torch.nn.functional.grouped_mm`) or `eager` (transformers' per-expert loop);
`auto` times both and keeps the faster for the reported numbers. The script fails if the
selected path is not what actually ran (counted on the dispatched aten ops of one traced step).

Install (PyPI only; see `benches/torch_moe_block.py`):
    python3 -m venv benches/.venv
    benches/.venv/bin/pip install torch==2.15.0 transformers==5.23.0 safetensors accelerate

Usage:
    benches/.venv/bin/python benches/torch_train_step.py [--threads N] [--iters 3] [--json]

Output: `key: value` lines; with --json, one final JSON line holding the same keys.
Set MOE_BENCH_BREAKDOWN=1 to also time forward / backward / clip+optimizer separately.
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
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

GMM = "aten._grouped_mm.default"


class OpCounter(TorchDispatchMode):
    """Counts the aten/custom ops dispatched inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def lcg_ids(n, vocab, seed):
    """Token ids of `benches/train_step.rs`: a 64-bit LCG, `(state >> 33) % vocab`."""
    mask = (1 << 64) - 1
    state = seed & mask
    out = []
    for _ in range(n):
        state = (state * 6364136223846793005 + 1442695040888963407) & mask
        out.append((state >> 33) % vocab)
    return out


def build(a, experts_impl):
    torch.manual_seed(a.seed)
    config = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
        moe_intermediate_size=a.width, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        num_experts=a.experts, num_experts_per_tok=a.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
        output_router_logits=True, router_aux_loss_coef=0.001, dtype=torch.float32,
    )
    config._experts_implementation = experts_impl
    if config._experts_implementation != experts_impl:
        sys.exit(f"FATAL: could not select experts implementation {experts_impl!r}")
    if experts_impl != "eager" and ALL_EXPERTS_FUNCTIONS.get_interface(experts_impl, None) is None:
        sys.exit(f"FATAL: transformers has no experts implementation {experts_impl!r}")
    model = Qwen3MoeForCausalLM(config).float().train()
    opt_kwargs = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if a.adamw == "fused":
        opt_kwargs["fused"] = True
    elif a.adamw == "foreach":
        opt_kwargs["foreach"] = True
    opt = torch.optim.AdamW(model.parameters(), **opt_kwargs)
    return config, model, opt


def train_step(model, opt, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out.loss.detach(), norm


def check_path(model, opt, ids, experts_impl, layers):
    """One traced step: the selected experts path must be what ran."""
    with OpCounter() as ops:
        train_step(model, opt, ids)
    gmm = ops.counts.get(GMM, 0)
    # Forward: 2 grouped_mm per layer (gate_up, down); backward: 2 per forward call at least.
    if experts_impl == "grouped_mm":
        bad = [n for n in ops.counts if "fallback" in n]
        if gmm < 4 * layers or bad:
            seen = {n: c for n, c in ops.counts.items() if "mm" in n or n in bad}
            sys.exit(f"FATAL: grouped_mm path not used (ops seen: {seen})")
    index_add = ops.counts.get("aten.index_add_.default", 0) + ops.counts.get(
        "aten.index_add.default", 0)
    if experts_impl == "eager" and (gmm or not index_add):
        sys.exit(f"FATAL: eager experts path not used ({gmm} grouped_mm, {index_add} index_add)")
    return gmm, index_add


def median_step(model, opt, ids, warmup, iters):
    for _ in range(warmup):
        train_step(model, opt, ids)
    times, losses = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        loss, _ = train_step(model, opt, ids)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return statistics.median(times), losses


def breakdown(model, opt, ids, iters):
    """Medians of forward, backward, clip + AdamW + zero_grad, each timed on its own."""
    parts = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(iters):
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        t1 = time.perf_counter()
        out.loss.backward()
        t2 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        parts["forward"].append(t1 - t0)
        parts["backward"].append(t2 - t1)
        parts["optimizer"].append(t3 - t2)
    return {k: round(statistics.median(v), 4) for k, v in parts.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--width", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ids-seed", type=int, default=7)
    p.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "eager", "auto"])
    p.add_argument("--adamw", default="fused", choices=["default", "foreach", "fused"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print a one-line JSON")
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    ids = torch.tensor(lcg_ids(a.batch * a.seq, a.vocab, a.ids_seed), dtype=torch.long)
    ids = ids.view(a.batch, a.seq)
    tokens = a.batch * a.seq
    impls = ["grouped_mm", "eager"] if a.experts_impl == "auto" else [a.experts_impl]
    r = {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "shape": f"layers={a.layers} H={a.hidden} E={a.experts} k={a.top_k} F={a.width} "
                 f"heads={a.heads}/{a.kv_heads}x{a.head_dim} V={a.vocab} B={a.batch} S={a.seq} f32",
        "adamw": a.adamw,
    }
    best = None
    for impl in impls:
        config, model, opt = build(a, impl)
        r["attn_implementation"] = model.config._attn_implementation
        if model.config._experts_implementation != impl:
            sys.exit(f"FATAL: the model runs {model.config._experts_implementation!r}, not {impl!r}")
        r["params"] = sum(p.numel() for p in model.parameters())
        gmm_calls, index_add_calls = check_path(model, opt, ids, impl, a.layers)
        t, losses = median_step(model, opt, ids, a.warmup, a.iters)
        r[f"torch_{impl}_grouped_mm_calls_per_step"] = gmm_calls
        r[f"torch_{impl}_index_add_calls_per_step"] = index_add_calls
        r[f"torch_{impl}_step_s"] = round(t, 4)
        r[f"torch_{impl}_tokens_per_s"] = round(tokens / t, 1)
        r[f"torch_{impl}_losses"] = [round(x, 4) for x in losses]
        if best is None or t < best[1]:
            best = (impl, t)
        if os.environ.get("MOE_BENCH_BREAKDOWN") == "1":
            r[f"torch_{impl}_breakdown_s"] = breakdown(model, opt, ids, a.iters)
        if impl == impls[-1]:
            with torch.no_grad():  # routing balance of the first layer at the final weights
                layer = model.model.layers[0]
                h = layer.input_layernorm(model.model.embed_tokens(ids)).view(-1, a.hidden)
                _, _, idx = layer.mlp.gate(h)
                load = torch.bincount(idx.flatten(), minlength=a.experts)
                r["routing_layer0_tokens_per_expert_min_max"] = [int(load.min()), int(load.max())]
        del model, opt
    r["torch_experts_implementation"] = best[0]
    r["torch_train_step_s"] = round(best[1], 4)
    r["torch_train_tokens_per_s"] = round(tokens / best[1], 1)

    m, k, n = tokens * a.top_k, a.hidden, a.width
    A, B = torch.randn(m, k), torch.randn(k, n)
    C = torch.empty(m, n)
    for _ in range(2):
        torch.matmul(A, B, out=C)
    ts = []
    for _ in range(a.iters):
        t0 = time.perf_counter()
        torch.matmul(A, B, out=C)
        ts.append(time.perf_counter() - t0)
    t_mm = statistics.median(ts)
    r["torch_dense_gemm_shape"] = f"[{m},{k}]x[{k},{n}]"
    r["torch_dense_gemm_gflops"] = round(2 * m * k * n / t_mm / 1e9, 2)
    for key, v in r.items():
        print(f"{key}: {v}")
    if a.json:
        print(json.dumps(r, separators=(",", ":")))


if __name__ == "__main__":
    main()
