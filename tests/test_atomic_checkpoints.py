"""checkpoint-N directories appear only complete: staged and renamed; resume_from_checkpoint=True skips
incomplete ones (naming them), a path to one is refused, the Trainer's rotation and best-checkpoint
bookkeeping see final names only, a finished run resumes to itself, and the recipes resume."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import sft_rows, trainer_kwargs
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent


def build(path, out, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    kwargs = trainer_kwargs(str(out), max_length=32, per_device_train_batch_size=2, max_steps=3,
                            save_strategy="steps", save_steps=1)
    kwargs.update(overrides)
    eval_dataset = Dataset.from_list(sft_rows(2)) if kwargs.get("eval_strategy", "no") != "no" else None
    return StreamedSFTTrainer(
        model=path, args=StreamedSFTConfig(**kwargs), train_dataset=Dataset.from_list(sft_rows(8)),
        eval_dataset=eval_dataset, processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"),
    )


def steps(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


def test_checkpoint_problem_names_what_is_missing_or_truncated(checkpoint, tmp_path):
    from deg_hf.checkpoint.atomic import checkpoint_problem

    build(checkpoint("llama"), tmp_path, max_steps=1).train()
    ckpt = tmp_path / "checkpoint-1"
    assert checkpoint_problem(str(ckpt)) is None  # control: a checkpoint the Trainer wrote whole
    assert not (tmp_path / ".deg-staging").exists()
    for name, breaks, problem in [
        ("optimizer.pt", lambda p: p.write_bytes(p.read_bytes()[:-40]), "optimizer.pt is truncated"),
        ("scheduler.pt", lambda p: p.unlink(), "no scheduler.pt"),
        ("adapter_model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-8]), "adapter_model.safetensors"),
        ("trainer_state.json", lambda p: p.write_text('{"global_step": '), "trainer_state.json is unreadable"),
    ]:
        broken = tmp_path / f"broken-{name}"
        shutil.copytree(ckpt, broken)
        breaks(broken / name)
        assert problem in checkpoint_problem(str(broken)), name
    assert checkpoint_problem(str(tmp_path / "broken-scheduler.pt"), optimizer=False) is None  # save_only_model


def test_resume_true_skips_an_incomplete_checkpoint_naming_it(checkpoint, tmp_path, caplog):
    path = checkpoint("llama")
    full = build(path, tmp_path / "full")
    full.train()
    want = load_file(tmp_path / "full" / "checkpoint-3" / "adapter_model.safetensors")

    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-1", out / "checkpoint-1")
    # what an interrupted save of an older deg_hf left: checkpoint-2 without optimizer and trainer state
    partial = out / "checkpoint-2"
    shutil.copytree(tmp_path / "full" / "checkpoint-2", partial)
    (partial / "optimizer.pt").unlink()
    (partial / "trainer_state.json").unlink()
    with caplog.at_level(logging.WARNING):
        resumed = build(path, out)
        resumed.train(resume_from_checkpoint=True)
    assert f"skipping {partial}" in caplog.text and "trainer_state.json" in caplog.text
    assert steps(out) == [1, 2, 3]
    for step in (2, 3):  # the partial directory was replaced by the resumed run's complete one
        assert (out / f"checkpoint-{step}" / "optimizer.pt").is_file()
    got = load_file(out / "checkpoint-3" / "adapter_model.safetensors")
    assert all(got[k].equal(want[k]) for k in want)


def test_resume_true_without_a_complete_checkpoint_starts_from_the_beginning(checkpoint, tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    with caplog.at_level(logging.WARNING):
        build(checkpoint("llama"), out, max_steps=1).train(resume_from_checkpoint=True)
    assert "holds no complete checkpoint-N" in caplog.text and steps(out) == [1]


def test_resuming_a_finished_run_takes_no_extra_step(checkpoint, tmp_path, caplog):
    path, out = checkpoint("llama"), tmp_path / "run"
    first = build(path, out)
    first.train()
    first.save_model()
    want = load_file(out / "adapter_model.safetensors")
    again = build(path, out)
    with caplog.at_level(logging.WARNING):
        result = again.train(resume_from_checkpoint=True)
    assert "is the last step of this run" in caplog.text
    assert result.global_step == 3 and steps(out) == [1, 2, 3]  # the Trainer alone would train a 4th step
    again.save_model()
    got = load_file(out / "adapter_model.safetensors")
    assert all(got[k].equal(want[k]) for k in want)


def test_rotation_and_the_best_checkpoint_see_final_names_only(checkpoint, tmp_path):
    out = tmp_path / "run"
    trainer = build(checkpoint("llama"), out, max_steps=4, save_total_limit=2, eval_strategy="steps",
                    eval_steps=1, metric_for_best_model="loss", greater_is_better=False)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert ".deg-staging" not in best and os.path.dirname(best) == str(out)
    kept = steps(out)
    assert len(kept) == 2 and 4 in kept and Path(best).name in {f"checkpoint-{s}" for s in kept}
    for step in kept:
        state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert ".deg-staging" not in str(state.get("best_model_checkpoint"))
    assert not (out / ".deg-staging").exists()


def test_recipes_resume_from_checkpoint(tmp_path):
    out = tmp_path / "sft"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    common = ["--report_to", "none", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--disable_tqdm",
              "true", "--save_strategy", "steps", "--save_steps", "1", "--output_dir", str(out)]

    def run(*args):
        proc = subprocess.run([sys.executable, str(REPO / "recipes" / "sft.py"), *common, *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]

    run("--max_steps", "2")
    first = {p.name: p.stat().st_mtime_ns for p in (out / "checkpoint-2").iterdir()}
    run("--max_steps", "3", "--resume_from_checkpoint", "true")
    assert steps(out) == [1, 2, 3]
    assert {p.name: p.stat().st_mtime_ns for p in (out / "checkpoint-2").iterdir()} == first  # not retrained
    plans = [json.loads(line)["step"] for line in (out / "train.log.jsonl").read_text().splitlines()
             if '"mem_plan"' in line]
    assert plans == [0, 2]  # the second run started where the first stopped
    for name in ("sft", "dpo", "kto", "orpo", "simpo"):  # every recipe passes the argument on
        assert "resume_from_checkpoint=resume_from(training_args)" in (REPO / "recipes" / f"{name}.py").read_text()


@pytest.mark.parametrize("value, want", [(None, None), ("false", None), ("true", True), ("True", True),
                                         ("out/checkpoint-4", "out/checkpoint-4")])
def test_resume_from_reads_the_argument(value, want):
    from types import SimpleNamespace

    from deg_hf.recipe_utils import resume_from

    assert resume_from(SimpleNamespace(resume_from_checkpoint=value)) == want
