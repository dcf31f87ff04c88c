"""Checks that what `moe train` trains, once `moe export`ed, loads in transformers 5.23 with
the trained weights.

For Qwen3, Qwen3-MoE, DeepSeek-V3, the DeepSeek-V3 FP8 release (trained dequantised), GLM-4.5
and Mixtral, this script

1. trains 3 steps under `tp=2,ep=4` (4 ranks on threads) from the HF fixture, saving a
   distributed checkpoint (`moe train ... --save <tmp>/ckpt`);
2. exports it (`moe export <tmp>/ckpt --out <tmp>/hf`);
3. loads the export with transformers (`output_loading_info=True`, float32) and asserts that
   `missing_keys`, `mismatched_keys` and `error_msgs` are empty and that `unexpected_keys`
   holds nothing but DeepSeek-V3's / GLM-4.5's MTP layers `model.layers.{N+j}.*` (HF 5.23 has
   no MTP module; see tests/check_export.py);
4. asserts that every tensor of the loaded model's state dict equals the exported tensor bit
   for bit, that the trained weights differ from the fixture's, and that the logits of a
   batch are finite.

With `--bf16` every model trains with `moe train --bf16` (BF16 mixed precision) and is
exported with `moe export`'s default, which for such a checkpoint is BF16: the script then also
asserts that every exported weight is bfloat16 (DeepSeek-V3's router bias stays float32), that
the config says `"dtype": "bfloat16"`, and loads the model in bfloat16 (the state dict equals
the export bit for bit).

It needs torch + transformers==5.23.0 (not in CI; `benches/.venv` per
benches/torch_moe_block.py). Run it from the repository root after `cargo build --bins`:

    benches/.venv/bin/python tests/check_trained_export.py [--bf16]

With `--mxfp4` it checks the MXFP4 release format instead: it trains gpt-oss from its MXFP4
release fixture (`ep=2`), exports the checkpoint twice (`--dtype f32` and `--dtype mxfp4`),
loads the MXFP4 export with transformers (which dequantises the experts on load, on CPU) with
no missing or unexpected keys, and asserts that every expert weight transformers dequantised
equals the OCP MX quantisation (computed here in torch, block by block) of the trained f32
weight, and every other tensor the bf16 rounding of it.

Set `MOE_BIN` to use another `moe` binary (default: target/debug/moe, else target/release/moe).
Prints one line per model; exits non-zero naming the model on the first failure.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
CASES = ["qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v3_fp8", "glm4_moe", "mixtral", "gpt_oss"]


def moe_binary() -> Path:
    if "MOE_BIN" in os.environ:
        return Path(os.environ["MOE_BIN"])
    for profile in ("debug", "release"):
        candidate = ROOT / "target" / profile / "moe"
        if candidate.is_file():
            return candidate
    sys.exit("no moe binary: run `cargo build --bins` first (or set MOE_BIN)")


def run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    out = {}
    for name in files:
        out.update(load_file(directory / name))
    return out


def check(binary: Path, tmp: Path, fixture: str, bf16: bool) -> str:
    ckpt, hf = tmp / fixture / "ckpt", tmp / fixture / "hf"
    run([
        str(binary), "train", "--model", str(FIXTURES / fixture), "--layout", "tp=2,ep=4",
        "--steps", "3", "--gbs", "4", "--seq-len", "12", "--lr", "1e-2",
        "--save", str(ckpt), "--transport", "threads",
    ] + (["--bf16"] if bf16 else []))
    run([str(binary), "export", str(ckpt), "--out", str(hf)])

    config = json.loads((hf / "config.json").read_text())
    dtype = torch.float32
    if bf16:
        dtype = torch.bfloat16
        assert config.get("dtype") == "bfloat16", f"{fixture}: config dtype {config.get('dtype')}"
        wide = {n: t.dtype for n, t in tensors(hf).items()
                if t.dtype != torch.bfloat16 and not n.endswith("e_score_correction_bias")}
        assert not wide, f"{fixture}: exported weights not in bfloat16: {wide}"
    model, info = AutoModelForCausalLM.from_pretrained(
        hf, output_loading_info=True, dtype=dtype
    )
    prefixes = ()
    if config.get("model_type") in ("deepseek_v3", "glm4_moe"):
        n = config["num_hidden_layers"]
        prefixes = tuple(
            f"model.layers.{n + j}." for j in range(config.get("num_nextn_predict_layers", 0))
        )
    others = [k for k in info["unexpected_keys"] if not (prefixes and k.startswith(prefixes))]
    assert not others, f"{fixture}: unexpected keys {others}"
    problems = {k: v for k, v in info.items() if v and k != "unexpected_keys"}
    assert not problems, f"{fixture}: loading info not empty: {problems}"

    exported = tensors(hf)
    state = model.state_dict()
    for name, value in state.items():
        if name not in exported:
            continue  # tied or derived buffers (e.g. rotary tables)
        assert torch.equal(value, exported[name].to(value.dtype)), f"{fixture}: {name} differs"
    source = tensors(FIXTURES / "deepseek_v3_fp8_dequant" if fixture.endswith("fp8") else FIXTURES / fixture)
    changed = [n for n in exported if n in source and not torch.equal(
        exported[n].to(torch.float32), source[n].to(torch.float32))]
    assert changed, f"{fixture}: no weight changed by training"
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.arange(12).remainder(config["vocab_size"])[None]).logits
    assert torch.isfinite(logits).all(), f"{fixture}: non-finite logits"
    mode = "BF16 " if bf16 else ""
    return f"{fixture}: {mode}export loads in transformers with the trained weights ({len(changed)} of {len(exported)} tensors trained)"


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ocp_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """The OCP MX quantisation of a parameter `w` [E, in, out] (transformers' orientation),
    packed along `in` in blocks of 32: scale 2^(floor(log2 amax) - 2), values rounded to the
    nearest E2M1 magnitude (ties to the even code), saturating at 6; returned dequantised in
    the same orientation."""
    e, k, out = w.shape
    x = w.transpose(1, 2).reshape(e, out, k // 32, 32).double()
    amax = x.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0))
    scale = torch.exp2(exp.clamp(-127, 127))
    q = (x / scale).abs()
    dist = (q[..., None] - E2M1.double()).abs()
    best = dist.min(-1, keepdim=True).values
    ties = dist == best
    # Ties to the even code: prefer an even index among the nearest.
    even = ties & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.double().argmax(-1), ties.double().argmax(-1))
    v = E2M1.double()[code] * scale * torch.where(x < 0, -1.0, 1.0)
    return v.float().reshape(e, out, k).transpose(1, 2)


def check_mxfp4(binary: Path, tmp: Path) -> str:
    from transformers import GptOssForCausalLM

    fixture = "gpt_oss_mxfp4"
    ckpt, dense, packed = tmp / "mx" / "ckpt", tmp / "mx" / "f32", tmp / "mx" / "mxfp4"
    run([
        str(binary), "train", "--model", str(FIXTURES / fixture), "--layout", "world=2,ep=2",
        "--steps", "2", "--gbs", "2", "--seq-len", "12", "--lr", "1e-2",
        "--save", str(ckpt), "--transport", "threads",
    ])
    run([str(binary), "export", str(ckpt), "--out", str(dense), "--dtype", "f32"])
    run([str(binary), "export", str(ckpt), "--out", str(packed), "--dtype", "mxfp4",
         "--mxfp4-reference", str(FIXTURES / fixture)])
    model, info = GptOssForCausalLM.from_pretrained(
        packed, output_loading_info=True, dtype=torch.float32
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{fixture}: loading info not empty: {problems}"
    trained = tensors(dense)
    state = model.state_dict()
    experts = 0
    for name, value in state.items():
        want = trained[name]
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            want = ocp_mxfp4(want)
            experts += 1
        else:
            want = want.to(torch.bfloat16).float()
        assert torch.equal(value, want), f"{fixture}: {name} differs"
    assert experts == 8, experts
    with torch.no_grad():
        logits = model(input_ids=torch.arange(12)[None]).logits
    assert torch.isfinite(logits).all(), f"{fixture}: non-finite logits"
    return (f"{fixture}: MXFP4 export loads in transformers; its {experts} dequantised expert "
            f"weights are the OCP quantisation of the trained weights")


def main() -> None:
    binary = moe_binary()
    bf16 = "--bf16" in sys.argv[1:]
    if "--mxfp4" in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                print(check_mxfp4(binary, Path(tmp)), flush=True)
            except AssertionError as e:
                sys.exit(f"FAIL {e}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for fixture in CASES:
            try:
                print(check(binary, Path(tmp), fixture, bf16), flush=True)
            except AssertionError as e:
                sys.exit(f"FAIL {e}")


if __name__ == "__main__":
    main()
