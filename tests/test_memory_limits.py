"""No hollow success: a run that skips every example, or more than oom_max_skip_fraction of them,
stops with an error naming the rows; skipped_ids are dataset row ids; the pre-flight without a
max_length uses the longest tokenised row."""

from __future__ import annotations

import json

import pytest
import torch
from harness import sft_rows, trainer_kwargs

LONG_ROWS = (7, 13)
LONG_ANSWER = " ".join(["good answer please thanks kind sure"] * 8)


def build(path, out, rows, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    kwargs = trainer_kwargs(str(out), max_length=96, per_device_train_batch_size=2, max_steps=len(rows) // 2,
                            learning_rate=1e-3, stream_layers=False)
    kwargs.update(overrides)
    return StreamedSFTTrainer(
        model=path, args=StreamedSFTConfig(**kwargs), train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
    )


def skewed_rows(n=20):
    rows = sft_rows(n)
    for i in LONG_ROWS:
        rows[i]["messages"][1]["content"] = LONG_ANSWER
    return rows


def too_long_for(trainer):
    """A fault hook: out of memory for any part with more label tokens than two short rows hold,
    which a long row alone has (as on a device where the long rows never fit)."""
    lengths = [len(x) for x in trainer.train_dataset["input_ids"]]
    short = sorted(n for i, n in enumerate(lengths) if i not in LONG_ROWS)
    limit = (short[-1] + short[-2] + min(lengths[i] for i in LONG_ROWS)) // 2
    assert short[-1] + short[-2] < limit < min(lengths[i] for i in LONG_ROWS)

    def hook(info, phase):
        if phase == "forward" and info.tokens > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. (injected: a long row)")
    return hook


def test_skips_under_the_threshold_finish_and_report_the_dataset_rows(checkpoint, tmp_path):
    from deg_hf.checkpoint import read_deg_json

    trainer = build(checkpoint("llama"), tmp_path / "run", skewed_rows(), oom_max_skip_fraction=0.1)
    trainer.set_fault_hook(too_long_for(trainer))
    trainer.train()  # 2 of 20 examples: exactly oom_max_skip_fraction, not past it
    counters = trainer.deg_counters
    assert counters["oom_skip"] == 2 and counters["examples"] == 20
    # the dataset's rows, not positions within a micro-batch (those are 0 or 1 here)
    assert sorted(counters["skipped"]) == list(LONG_ROWS)
    trainer.save_model()
    assert sorted(read_deg_json(tmp_path / "run")["memory"]["skipped_ids"]) == list(LONG_ROWS)
    events = [json.loads(line) for line in (tmp_path / "run" / "train.log.jsonl").read_text().splitlines()]
    assert sorted(e["uid"] for e in events if e.get("event") == "oom_skip") == list(LONG_ROWS)


def test_skips_past_the_threshold_stop_the_run_naming_the_rows(checkpoint, tmp_path):
    from deg_hf.memory.split_retry import SkipLimitError

    trainer = build(checkpoint("llama"), tmp_path / "run", skewed_rows())  # the default: 0.05
    trainer.set_fault_hook(too_long_for(trainer))
    with pytest.raises(SkipLimitError, match="oom_max_skip_fraction=0.05") as info:
        trainer.train()
    assert all(f"{row}" in str(info.value) for row in LONG_ROWS) and "max_length" in str(info.value)
    # it stopped after the step of the second skip (2 > 0.05 x 20), not at the end of the run
    events = [json.loads(line) for line in (tmp_path / "run" / "train.log.jsonl").read_text().splitlines()]
    skips = [e for e in events if e.get("event") == "oom_skip"]
    assert len(skips) == 2 and trainer.state.global_step == skips[-1]["step"] + 1


def test_a_run_that_skips_every_example_raises(checkpoint, tmp_path):
    from deg_hf.memory.split_retry import SkipLimitError

    def always(info, phase):
        raise torch.OutOfMemoryError("CUDA out of memory. (injected)")

    rows = sft_rows(8)
    early = build(checkpoint("llama"), tmp_path / "early", rows)
    early.set_fault_hook(always)
    with pytest.raises(SkipLimitError, match="oom_max_skip_fraction"):
        early.train()
    assert early.state.global_step == 1  # stopped after the first step, not after an untrained run

    # with every skip allowed, the end of the run still refuses to call it a success
    late = build(checkpoint("llama"), tmp_path / "late", rows, oom_max_skip_fraction=1.0)
    late.set_fault_hook(always)
    with pytest.raises(SkipLimitError, match="every one of the 8 examples.*nothing was trained"):
        late.train()
    assert late.state.global_step == 4 and late.deg_counters["oom_skip"] == 8


def test_preflight_without_max_length_uses_the_longest_tokenised_row(checkpoint, tmp_path):
    from deg_hf.memory.coef import GIB

    path, rows = checkpoint("llama"), skewed_rows()
    roomy = build(path, tmp_path / "a", rows, max_length=None, mem_target_gb=64.0)
    lengths = [len(x) for x in roomy.train_dataset["input_ids"]]
    report = roomy.deg_preflight
    assert report["max_length"] == max(lengths) and report["max_length"] != 1024
    assert f"dataset row {lengths.index(max(lengths))}" in report["length_source"]
    tight = (report["smallest_unit_bytes"] - 1) / GIB
    row = lengths.index(max(lengths))
    assert row in LONG_ROWS
    with pytest.raises(ValueError, match=rf"{max(lengths)} tokens: the longest tokenised row \(dataset row {row}\)"):
        build(path, tmp_path / "b", rows, max_length=None, mem_target_gb=tight)
    # control: truncating below the long rows fits the same target
    build(path, tmp_path / "c", rows, max_length=min(lengths), mem_target_gb=tight)
