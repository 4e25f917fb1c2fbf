"""The planner's estimate vs the measured peak of every part, and a calibrated run."""

from __future__ import annotations

import statistics
import sys
import tempfile


def calibration_run(path, parts: int = 25, task: str = "sft"):
    """One run of ``parts`` micro-batches (mixed lengths) whose measured peaks calibrate the planner as
    it goes; its samples carry the estimate the planner made before each part (``planned_bytes``)."""
    import random as _random

    from datasets import Dataset
    from harness import WORDS, trainer_kwargs
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import deg_hf
    from deg_hf.memory.calibrate import record

    rng = _random.Random(1)
    rows = []
    for _ in range(parts * 2):
        n = rng.choice((6, 12, 24, 48, 80))
        text = " ".join(rng.choice(WORDS) for _ in range(n))
        rows.append({"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": text}]})
    trainer = deg_hf.StreamedSFTTrainer(
        model=path, args=deg_hf.StreamedSFTConfig(**trainer_kwargs(
            tempfile.mkdtemp(), max_length=256, max_steps=parts, per_device_train_batch_size=2, logging_steps=1000)),
        train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    samples = record(trainer, {"task": task})
    trainer.train()
    trainer.release_stream()
    return samples


def run(quick: bool) -> dict:
    """The planner's estimate (shipped coefficients, uncalibrated) against the measured peak of every
    part, over the harness architectures x SFT/DPO/KTO/ORPO/SimPO x streamed/resident x prefix sharing
    on/off x short/long/length-skewed micro-batches; then a run calibrated by observe()."""

    from memory_runs import PAIRED, TASKS, checkpoint, measure, quiet

    from deg_hf.memory.calibrate import accuracy
    from deg_hf.memory.coef import MemCoef, estimate

    quiet()
    coef = MemCoef()
    archs = ("llama", "gemma2") if quick else ("llama", "qwen2", "qwen3", "mistral", "gemma2")
    rows, errs = [], []
    by = {}
    print(f"{'arch':8} {'task':6} {'layout':9} {'prefix':6} {'shape':7} {'estimate':>11} {'measured':>11} {'error':>7}",
          file=sys.stderr)
    for arch in archs:
        path = checkpoint(arch)
        for task in TASKS:
            for stream in (True, False):
                for prefix in ((True, False) if task in PAIRED else (None,)):
                    for s in measure(path, task, stream=stream, prefix=bool(prefix), tags={"arch": arch}):
                        est = estimate(s.features, coef)
                        err = est / s.peak_bytes - 1
                        errs.append(err)
                        for key in (f"task:{task}", f"arch:{arch}", f"shape:{s.tags['shape']}",
                                    f"layout:{'streamed' if stream else 'resident'}",
                                    f"prefix:{prefix}" if prefix is not None else None):
                            if key:
                                by.setdefault(key, []).append(err)
                        rows.append((arch, task, "streamed" if stream else "resident", str(prefix), s.tags["shape"],
                                     est, s.peak_bytes, err))
                        print(f"{arch:8} {task:6} {rows[-1][2]:9} {str(prefix):6} {s.tags['shape']:7} {est:>11} "
                              f"{s.peak_bytes:>11} {err:>+7.1%}", file=sys.stderr)
    calibrated = calibration_run(checkpoint("llama"), parts=12 if quick else 25)
    after = [s.planned_bytes / s.peak_bytes - 1 for s in calibrated[5:]]
    out = {"bench": "estimate", "parts": len(errs), **accuracy(errs),
           "by": {k: accuracy(v) for k, v in sorted(by.items())},
           "calibrated_run": {"parts": len(calibrated), "after_5_parts": accuracy(after),
                              "first_5_parts": accuracy([s.planned_bytes / s.peak_bytes - 1 for s in calibrated[:5]])},
           "mean_abs_error": round(statistics.fmean(abs(e) for e in errs), 4) if errs else None}
    return out
