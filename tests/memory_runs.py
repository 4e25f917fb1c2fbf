"""Measured training runs for the memory model: shared by the tests, ``scripts/calibrate_memory.py`` and
``scripts/bench.py estimate``.

:func:`measure` trains one deg_hf trainer for three micro-batches, short, long and length-skewed
(one long example in four), on a tiny real checkpoint, with every part's device memory measured
(the CPU tensor meter, or CUDA's counters), and returns the parts as
:class:`deg_hf.memory.calibrate.Sample` s tagged with what ran.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, beside this file

#: trainer and config class per task
TASKS = {
    "sft": ("StreamedSFTTrainer", "StreamedSFTConfig"),
    "dpo": ("StreamedDPOTrainer", "StreamedDPOConfig"),
    "kto": ("StreamedKTOTrainer", "StreamedKTOConfig"),
    "orpo": ("StreamedORPOTrainer", "StreamedORPOConfig"),
    "simpo": ("StreamedSimPOTrainer", "SimPOConfig"),
}
PAIRED = ("dpo", "orpo", "simpo")  # tasks with prefix sharing
#: (prompt words, completion words) of example i of a micro-batch of 4
SHAPES = {
    "short": lambda i: (4, 6),
    "long": lambda i: (30, 40),
    "skewed": lambda i: (30, 60) if i % 4 == 3 else (4, 6),
}
BATCH = 4


def quiet() -> None:
    import logging
    import warnings

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    logging.getLogger("deg_hf").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _rows(task: str, shapes, seed: int = 0) -> list[dict]:
    from harness import WORDS

    rng = random.Random(seed)

    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    out = []
    for shape in shapes:
        for i in range(BATCH):
            p, c = SHAPES[shape](i)
            prompt = words(p)
            if task == "sft":
                out.append({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": words(c)}]})
            elif task == "kto":
                out.append({"prompt": prompt, "completion": " " + words(c), "label": i % 2 == 0})
            else:
                out.append({"prompt": prompt, "chosen": " " + words(c), "rejected": " " + words(max(1, c - 3))})
    return out


def checkpoint(arch: str, directory: str | None = None, **config) -> str:
    """A tiny real checkpoint of ``arch`` (the test harness's, with ``config`` overrides)."""
    from harness import write_checkpoint

    return write_checkpoint(directory or tempfile.mkdtemp(prefix=f"deg_mem_{arch}_"), arch, **config)


def measure(path: str, task: str, *, stream: bool = True, prefix: bool = True, shapes=tuple(SHAPES),
            device: str = "cpu", coef_file: str | None = None, tags: dict | None = None, lora_r: int = 16):
    """Train ``task`` on ``path`` for one micro-batch per shape; the measured parts as samples."""
    from datasets import Dataset
    from harness import trainer_kwargs
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import deg_hf
    from deg_hf.memory.calibrate import record

    trainer_name, config_name = TASKS[task]
    kwargs = trainer_kwargs(tempfile.mkdtemp(prefix="deg_mem_run_"), max_length=256, max_steps=len(shapes),
                            per_device_train_batch_size=BATCH, stream_layers=stream, logging_steps=1000,
                            train_sampling_strategy="sequential", use_cpu=device == "cpu", mem_coef_file=coef_file)
    if task in PAIRED:
        kwargs["prefix_sharing"] = prefix
    trainer = getattr(deg_hf, trainer_name)(
        model=path, args=getattr(deg_hf, config_name)(**kwargs),
        train_dataset=Dataset.from_list(_rows(task, shapes)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules="all-linear"),
    )
    base = {"task": task, "stream": stream, "prefix": prefix if task in PAIRED else None, **(tags or {})}
    samples = record(trainer, base)
    calls = iter(shapes)

    # tag each part with the shape of the micro-batch it came from (sequential sampling: in order)
    original = trainer.deg_engine.training_step

    def tagged(model, inputs, num_items, run_part):
        trainer.deg_engine.sample_tags = {**base, "shape": next(calls, "?")}
        return original(model, inputs, num_items, run_part)

    trainer.deg_engine.training_step = tagged
    try:
        trainer.train()
    finally:
        trainer.release_stream()
    return samples
