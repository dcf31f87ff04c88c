#!/usr/bin/env python3
"""Goldens for `moe_bridge::text::sft` from HF TRL's own SFT data preparation.

Run from the repository root (offline, CPU; TRL 1.16.0, transformers 5.23.0, datasets, torch):

    benches/.venv/bin/python tests/make_sft_goldens.py

Inputs (committed): the Qwen3-style tokenizer fixture `tests/fixtures/tokenizer/` (Qwen3's chat
template verbatim, which has no `{% generation %}` tags), the tiny Qwen3-MoE model
`tests/fixtures/qwen3_moe/` (vocab 256), and the JSONL files of `tests/fixtures/sft/`:

    conversational.jsonl              {"messages": [...]}: system + multi-turn, reasoning, a tool
                                      call, a non-ASCII character, rows over the max length
    prompt_completion.jsonl           {"prompt": "...", "completion": "..."} plain text
    prompt_completion_messages.jsonl  {"prompt": [messages], "completion": [messages]}
    generation_template.jinja         a ChatML template with its own `{% generation %}` tags
                                      (passed as `SFTConfig.chat_template_path`)

Every case builds a real `trl.SFTTrainer` (the tiny model, `SFTConfig` with the case's
`max_length` / `assistant_only_loss` / `completion_only_loss` / `packing`) on the JSONL loaded with
`datasets.load_dataset("json", ...)`, so TRL's `_prepare_dataset` (EOS appending, tokenization,
`assistant_masks` through the training chat template TRL swaps in, `completion_mask`, labels,
`keep_start` truncation, dropping fully masked rows, BFD packing) runs unchanged; the collated
rows come from the trainer's own `DataCollatorForLanguageModeling`. A `line` column (the 1-based
line of the row in its file) rides along to name the source of every prepared example.

Writes:

    tests/fixtures/sft/goldens.json          see the keys below
    bridge/src/text/training_templates/*.jinja
                                             the chat templates TRL identifies and the training
                                             variants it swaps in, for the model families
                                             burn-moe trains (copied from the installed TRL)

goldens.json:

    versions              trl / transformers / datasets / torch versions
    cases[]               name, file, max_length, assistant_only_loss, completion_only_loss (as
                          passed, null = TRL's default), chat_template_file (null: the
                          tokenizer's) and examples[] = {line, input_ids, labels}
                          as `trainer.train_dataset` holds them (labels -100 where not trained)
    packed[]              a packing case (strategy bfd, seq_len = max_length = 128): rows[] =
                          {lines, seq_lengths, input_ids, labels, position_ids}, the labels and
                          position ids as the padding-free collator makes them for that row
    bfd[]                 TRL's BFD on bare lengths: {seq_len, lengths, rows (example indices)};
                          one through `_pack_bfd` (one batch), one through `pack_dataset` on
                          2500 examples (datasets' map batches of 1000)
    errors                the messages TRL raises for assistant-only loss on a
                          non-conversational dataset and for a template it cannot patch
    loss                  the conversational examples (assistant-only loss, max_length 64)
                          right-padded into one batch by TRL's collator: input_ids,
                          attention_mask, labels; `model(...).loss` of the tiny Qwen3-MoE in
                          float32 (eager attention) as SFTTrainer computes it (router logits on:
                          loss = ce_loss + router_aux_loss_coef * aux_loss, the load-balancing
                          loss masked by attention_mask), ce_loss alone (mean cross-entropy over
                          the trained, shifted labels), and each example's ce loss alone
"""

import json
import os
import random
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402
from trl.chat_template_utils import get_training_chat_template  # noqa: E402
from trl.data_utils import _pack_bfd, pack_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "tests" / "fixtures" / "tokenizer"
MODEL = ROOT / "tests" / "fixtures" / "qwen3_moe"
SFT = ROOT / "tests" / "fixtures" / "sft"
TEMPLATES = ROOT / "bridge" / "src" / "text" / "training_templates"
MAX_LENGTH = 64
PACK_LEN = 128

# The TRL chat templates embedded in the crate: (original, training variant) of the model
# families burn-moe trains (Qwen3 dense / MoE, Qwen3-Instruct-2507, DeepSeek-V3).
EMBEDDED_TEMPLATES = ["qwen3", "qwen3_instruct_2507", "deepseekv3"]

datasets.disable_progress_bars()
transformers.logging.set_verbosity_error()
warnings.filterwarnings("ignore")


def source_lines(path):
    """1-based line numbers of the non-blank lines of a JSONL file (datasets skips blank ones)."""
    with open(path, encoding="utf-8") as f:
        return [i + 1 for i, line in enumerate(f) if line.strip()]


def load(file):
    dataset = datasets.load_dataset("json", data_files=str(SFT / file), split="train")
    lines = source_lines(SFT / file)
    assert len(lines) == len(dataset), (file, len(lines), len(dataset))
    return dataset.add_column("line", lines)


def trainer_for(file, out_dir, **config):
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, attn_implementation="eager")
    args = SFTConfig(
        output_dir=out_dir,
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=1,
        **config,
    )
    return SFTTrainer(model=model, args=args, train_dataset=load(file), processing_class=tokenizer)


def case(name, file, out_dir, max_length, assistant_only_loss=False, completion_only_loss=None, template=None):
    extra = {"chat_template_path": str(SFT / template)} if template else {}
    trainer = trainer_for(
        file,
        out_dir,
        max_length=max_length,
        assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss,
        **extra,
    )
    examples = [
        {"line": row["line"], "input_ids": row["input_ids"], "labels": row["labels"]}
        for row in trainer.train_dataset
    ]
    print(f"{name}: {len(examples)} examples, lines {[e['line'] for e in examples]}")
    return trainer, {
        "name": name,
        "file": file,
        "max_length": max_length,
        "assistant_only_loss": assistant_only_loss,
        "completion_only_loss": completion_only_loss,
        "chat_template_file": template,
        "examples": examples,
    }


def packed_case(name, file, out_dir, assistant_only_loss=False, completion_only_loss=None):
    """TRL's packing (bfd) at seq_len PACK_LEN; each row's examples identified by their ids."""
    # The unpacked, untruncated examples, to tell which ones each packed row holds.
    _, unpacked = case(name + "/unpacked", file, out_dir, None, assistant_only_loss, completion_only_loss)
    by_ids = {}
    for example in unpacked["examples"]:
        key = tuple(example["input_ids"][:PACK_LEN])
        assert key not in by_ids, "examples must be distinct to identify them in the packed rows"
        by_ids[key] = example["line"]
    trainer = trainer_for(
        file,
        out_dir,
        max_length=PACK_LEN,
        packing=True,
        assistant_only_loss=assistant_only_loss,
        completion_only_loss=completion_only_loss,
    )
    rows = []
    for row in trainer.train_dataset:
        lines, start = [], 0
        for length in row["seq_lengths"]:
            lines.append(by_ids[tuple(row["input_ids"][start : start + length])])
            start += length
        batch = trainer.data_collator([row])
        rows.append(
            {
                "lines": lines,
                "seq_lengths": row["seq_lengths"],
                "input_ids": batch["input_ids"][0].tolist(),
                "labels": batch["labels"][0].tolist(),
                "position_ids": batch["position_ids"][0].tolist(),
            }
        )
    print(f"{name}: {len(rows)} rows, {[r['lines'] for r in rows]}")
    return {
        "name": name,
        "file": file,
        "seq_len": PACK_LEN,
        "assistant_only_loss": assistant_only_loss,
        "completion_only_loss": completion_only_loss,
        "rows": rows,
    }


def bins_of(packed_ids, packed_lengths):
    """Example indices per packed row, from rows whose tokens are their example's index."""
    rows = []
    for ids, lengths in zip(packed_ids, packed_lengths, strict=True):
        row, start = [], 0
        for length in lengths:
            row.append(ids[start])
            start += length
        rows.append(row)
    return rows


def bfd_single(lengths, seq_len):
    table = pa.table({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
    packed = _pack_bfd(table, seq_len, on_seq_length_overflow="truncate")
    rows = bins_of(packed["input_ids"].to_pylist(), packed["seq_lengths"].to_pylist())
    return {"via": "_pack_bfd", "seq_len": seq_len, "lengths": lengths, "rows": rows}


def bfd_dataset(lengths, seq_len):
    dataset = datasets.Dataset.from_dict({"input_ids": [[i] * n for i, n in enumerate(lengths)]})
    packed = pack_dataset(dataset, seq_len, strategy="bfd")
    rows = bins_of(packed["input_ids"], packed["seq_lengths"])
    return {"via": "pack_dataset", "seq_len": seq_len, "lengths": lengths, "rows": rows}


def copy_templates():
    source = Path(trl.__file__).parent / "chat_templates"
    TEMPLATES.mkdir(parents=True, exist_ok=True)
    for name in EMBEDDED_TEMPLATES:
        for suffix in ("", "_training"):
            shutil.copyfile(source / f"{name}{suffix}.jinja", TEMPLATES / f"{name}{suffix}.jinja")


def errors(out_dir):
    out = {}
    try:
        trainer_for("prompt_completion.jsonl", out_dir, max_length=MAX_LENGTH, assistant_only_loss=True)
        raise AssertionError("TRL accepted assistant_only_loss on a non-conversational dataset")
    except ValueError as e:
        out["assistant_only_loss_not_conversational"] = str(e)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenizer.chat_template = tokenizer.chat_template + " "
    try:
        get_training_chat_template(tokenizer)
        raise AssertionError("TRL patched an unknown template")
    except ValueError as e:
        out["unknown_template"] = str(e)
    return out


def loss_golden(trainer, examples):
    rows = [{"input_ids": e["input_ids"], "labels": e["labels"]} for e in examples]
    batch = trainer.data_collator(rows)
    model = trainer.model.float().eval()
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "labels": batch["labels"]}
    with torch.no_grad():
        # As SFTTrainer trains a MoE: it turns `output_router_logits` on, so `loss` adds
        # `router_aux_loss_coef * aux_loss` (the load-balancing loss over the unpadded tokens).
        with_aux = model(**inputs, output_router_logits=True)
        ce = model(**inputs, output_router_logits=False).loss
        each = [
            model(
                input_ids=torch.tensor([r["input_ids"]]),
                labels=torch.tensor([r["labels"]]),
                output_router_logits=False,
            ).loss.item()
            for r in rows
        ]
    coef = model.config.router_aux_loss_coef
    assert abs(with_aux.loss.item() - (ce.item() + coef * with_aux.aux_loss.item())) < 1e-5
    return {
        "case": "conversational_assistant_only_max64",
        "lines": [e["line"] for e in examples],
        "pad_token_id": trainer.processing_class.pad_token_id,
        "input_ids": batch["input_ids"].tolist(),
        "attention_mask": batch["attention_mask"].tolist(),
        "labels": batch["labels"].tolist(),
        "loss": with_aux.loss.item(),
        "ce_loss": ce.item(),
        "aux_loss": with_aux.aux_loss.item(),
        "router_aux_loss_coef": coef,
        "example_ce_losses": each,
    }


def main():
    if trl.__version__ != "1.16.0" or transformers.__version__ != "5.23.0":
        print(f"warning: written for trl 1.16.0 / transformers 5.23.0, running {trl.__version__} / "
              f"{transformers.__version__}", file=sys.stderr)
    torch.manual_seed(0)
    copy_templates()
    goldens = {
        "versions": {
            "trl": trl.__version__,
            "transformers": transformers.__version__,
            "datasets": datasets.__version__,
            "torch": torch.__version__,
        },
        "cases": [],
        "packed": [],
    }
    with tempfile.TemporaryDirectory() as out_dir:
        conv = "conversational.jsonl"
        pc = "prompt_completion.jsonl"
        pcm = "prompt_completion_messages.jsonl"
        specs = [
            ("conversational_full", conv, None, False, None),
            ("conversational_max64", conv, MAX_LENGTH, False, None),
            ("conversational_assistant_only", conv, None, True, None),
            ("conversational_assistant_only_max64", conv, MAX_LENGTH, True, None),
            ("prompt_completion", pc, None, False, None),
            ("prompt_completion_max64", pc, MAX_LENGTH, False, None),
            ("prompt_completion_full_loss_max64", pc, MAX_LENGTH, False, False),
            ("prompt_completion_messages", pcm, None, False, None),
            ("prompt_completion_messages_max64", pcm, MAX_LENGTH, False, None),
            ("prompt_completion_messages_full_loss", pcm, None, False, False),
            ("prompt_completion_messages_assistant_only_max64", pcm, MAX_LENGTH, True, None),
        ]
        trainers = {}
        for name, file, max_length, assistant_only, completion_only in specs:
            trainer, result = case(name, file, out_dir, max_length, assistant_only, completion_only)
            trainers[name] = trainer
            goldens["cases"].append(result)
        # A template with its own `{% generation %}` tags (TRL keeps it), via `chat_template_path`.
        for name, file in [
            ("conversational_template_file_assistant_only", conv),
            ("prompt_completion_messages_template_file_assistant_only", pcm),
        ]:
            _, result = case(name, file, out_dir, MAX_LENGTH, True, None, template="generation_template.jinja")
            goldens["cases"].append(result)
        goldens["packed"] = [
            packed_case("conversational_assistant_only_packed", conv, out_dir, assistant_only_loss=True),
            packed_case("prompt_completion_packed", pc, out_dir),
            packed_case("prompt_completion_messages_packed", pcm, out_dir),
        ]
        goldens["errors"] = errors(out_dir)
        loss_case = next(c for c in goldens["cases"] if c["name"] == "conversational_assistant_only_max64")
        goldens["loss"] = loss_golden(trainers[loss_case["name"]], loss_case["examples"])
        print(f"loss: {goldens['loss']['loss']}")

    rng = random.Random(1234)
    ties = [5, 3, 5, 8, 0, 3, 12, 5, 1, 7, 9, 3, 2, 8, 10, 4, 4, 15, 6, 1]
    long = [rng.choice([rng.randint(1, 40), rng.randint(1, 9), rng.randint(30, 70), 0]) for _ in range(2500)]
    goldens["bfd"] = [
        bfd_single(ties, 12),
        bfd_single([rng.randint(1, 100) for _ in range(300)], 128),
        bfd_dataset(long, 64),
    ]
    with open(SFT / "goldens.json", "w", encoding="utf-8") as f:
        json.dump(goldens, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {SFT / 'goldens.json'}")


if __name__ == "__main__":
    main()
