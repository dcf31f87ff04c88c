"""Checks that `moe export` writes HF checkpoints transformers 5.23 loads exactly.

For every committed fixture in tests/fixtures/, this script

1. exports it with the CLI (`moe export --model <fixture> --out <tmp>/<name> ...`), with a small
   `--max-shard-size` so that the sharded layout (index + several shards) is exercised;
2. loads the export with transformers
   (`AutoModelForCausalLM.from_pretrained(dir, output_loading_info=True, dtype=torch.float32)`)
   and asserts that `missing_keys`, `mismatched_keys` and `error_msgs` are empty and that
   `unexpected_keys` is empty too, except for DeepSeek-V3's MTP layers `model.layers.{N+j}.*`:
   HF 5.23 has no MTP module and reports them as unexpected for the source fixture as well
   (it only ignores the official model's `model.layers.61.*`), while
   docs/checkpoints.md §Minimal loadable export requires exporting them; any other unexpected
   key fails;
3. runs both the exported and the source model on the golden `input_ids` and asserts that the
   logits are equal (bit for bit: the export is lossless, so the same arithmetic runs on the
   same weights).

The FP8 fixture is exported as BF16 (`--dtype bf16`); its "source model" is the exact
dequantisation in `deepseek_v3_fp8_dequant/`, because transformers' CPU FP8 path infers the
block size wrongly for these shapes (docs/models.md §Fixtures) and must not be used as an
oracle. The export must also contain no `*_scale_inv` tensor and no `quantization_config`.

It needs torch + transformers==5.23.0 (not in CI). Run it from the repository root, after
building the CLI:

    cargo build --workspace --bins
    benches/.venv/bin/python tests/check_export.py

Set `MOE_BIN` to use another `moe` binary (default: target/debug/moe, else target/release/moe).
Exits non-zero and names the fixture on the first failure; prints one line per fixture.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

# (fixture, golden with input_ids, extra export arguments, directory of the source model)
CASES = [
    ("qwen3", "qwen3", [], "qwen3"),
    ("qwen3_moe", "qwen3_moe", [], "qwen3_moe"),
    ("qwen3_moe_bf16", "qwen3_moe_bf16", [], "qwen3_moe_bf16"),
    # bf16 -> f32 is exact, so the logits still equal the source's (loaded in f32).
    ("qwen3_moe_bf16", "qwen3_moe_bf16", ["--dtype", "f32"], "qwen3_moe_bf16"),
    ("deepseek_v3", "deepseek_v3", [], "deepseek_v3"),
    ("deepseek_v3_sharded", "deepseek_v3", [], "deepseek_v3"),
    ("deepseek_v3_fp8_dequant", "deepseek_v3_fp8_dequant", [], "deepseek_v3_fp8_dequant"),
    # FP8 -> BF16: compared with the exact dequantisation (never transformers' CPU FP8 path).
    ("deepseek_v3_fp8", "deepseek_v3_fp8_dequant", ["--dtype", "bf16"], "deepseek_v3_fp8_dequant"),
]


def moe_binary() -> Path:
    if "MOE_BIN" in os.environ:
        return Path(os.environ["MOE_BIN"])
    for profile in ("debug", "release"):
        candidate = ROOT / "target" / profile / "moe"
        if candidate.is_file():
            return candidate
    sys.exit("no moe binary: run `cargo build --workspace --bins` first (or set MOE_BIN)")


def load(directory: Path):
    model, info = AutoModelForCausalLM.from_pretrained(
        directory, output_loading_info=True, dtype=torch.float32
    )
    model.eval()
    return model, info


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def export_keys(directory: Path) -> list[str]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    with safe_open(directory / "model.safetensors", "pt") as f:
        return sorted(f.keys())


def mtp_prefixes(config: dict) -> tuple[str, ...]:
    """`model.layers.{N + j}.` for DeepSeek-V3's MTP layers (j < num_nextn_predict_layers)."""
    if config.get("model_type") != "deepseek_v3":
        return ()
    first = config["num_hidden_layers"]
    layers = range(first, first + config.get("num_nextn_predict_layers", 0))
    return tuple(f"model.layers.{layer}." for layer in layers)


def check(binary: Path, tmp: Path, case) -> str:
    fixture, golden, extra, source = case
    target = tmp / (fixture + "".join(extra).replace("-", "_"))
    command = [
        str(binary),
        "export",
        "--model",
        str(FIXTURES / fixture),
        "--out",
        str(target),
        "--max-shard-size",
        "150KB",
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"

    keys = export_keys(target)
    assert not [k for k in keys if k.endswith("_scale_inv")], f"{fixture}: scales exported"
    config = json.loads((target / "config.json").read_text())
    assert "quantization_config" not in config, f"{fixture}: quantization_config kept"

    exported, info = load(target)
    # HF 5.23's DeepseekV3ForCausalLM has no MTP module (it ignores only the official model's
    # `model.layers.61.*`), so the MTP layers `N..N+D` we export are the one expected entry.
    prefixes = mtp_prefixes(config)
    unexpected = sorted(info["unexpected_keys"])
    others = [k for k in unexpected if not (prefixes and k.startswith(prefixes))]
    assert not others, f"{fixture}: unexpected keys: {others}"
    if prefixes:
        assert any(k.startswith(prefixes) for k in keys), f"{fixture}: MTP layers not exported"
    problems = {k: v for k, v in info.items() if v and k != "unexpected_keys"}
    assert not problems, f"{fixture}: loading info not empty: {problems}"

    reference, _ = load(FIXTURES / source)
    input_ids = load_file(FIXTURES / f"{golden}.golden.safetensors")["input_ids"]
    ours, theirs = logits(exported, input_ids), logits(reference, input_ids)
    diff = (ours - theirs).abs().max().item()
    assert torch.equal(ours, theirs), f"{fixture}: logits differ from the source (max {diff})"
    shards = len({p.name for p in target.glob("*.safetensors")})
    note = ""
    if unexpected:
        note = f" except the {len(unexpected)} MTP tensors HF 5.23 has no module for"
    return (
        f"{' '.join([fixture, *extra])}: {len(keys)} tensors in {shards} shard(s), "
        f"no missing/unexpected/mismatched keys{note}, logits equal"
    )


def main() -> int:
    version = transformers.__version__
    assert version == "5.23.0", f"need transformers 5.23.0, have {version}"
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    binary = moe_binary()
    passed = failed = 0
    with tempfile.TemporaryDirectory(prefix="moe-check-export-") as tmp:
        for case in CASES:
            try:
                print("ok  ", check(binary, Path(tmp), case), flush=True)
                passed += 1
            except AssertionError as err:
                print("FAIL", err, flush=True)
                failed += 1
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
