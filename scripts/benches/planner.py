"""A length-skewed dataset under a memory target enforced on CPU: the planner vs fixed micro-batches and auto_find_batch_size."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

from benches.common import lora_config, tiny_checkpoint


def _skewed_rows(n: int, long_every: int, short_words: int, long_words: int):
    from harness import WORDS

    rows = []
    for i in range(n):
        words = long_words if i % long_every == long_every - 1 else short_words
        text = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
        rows.append({"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": text}]})
    return rows


def _resident_of(trainer):
    """What a plain (resident) trainer keeps on the device: parameters, buffers, gradients, optimizer state."""
    import torch

    def tensors():
        for p in trainer.model.parameters():
            yield p
            yield p.grad
        yield from trainer.model.buffers()
        for state in getattr(getattr(trainer, "optimizer", None), "state", {}).values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    return tensors


def run(quick: bool) -> dict:
    """A length-skewed SFT run (one long example in eight) under a memory target enforced on CPU by the
    tensor meter, given in the planner's own units (``mem_target_gb``): a micro-batch of short examples
    fits, one holding a long example does not, one long example alone does. Three arms, interleaved,
    5 repeats (2 with --quick): deg_hf planning the batch of 8 into parts; a fixed micro-batch sized for
    the worst case (as many long examples as fit) with gradient accumulation to the same batch; TRL with
    ``auto_find_batch_size`` under the same target. All resident, gradient checkpointing on (TRL's default)."""
    import torch
    from datasets import Dataset
    from harness import trainer_kwargs
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    import deg_hf
    from deg_hf.memory.coef import GIB
    from deg_hf.memory.meter import DeviceMemory
    from deg_hf.memory.planner import Example

    path = tiny_checkpoint(tempfile.mkdtemp(), layers=4, hidden=128, vocab=512)
    tok = AutoTokenizer.from_pretrained(path)
    n, batch, repeats = (16, 8, 2) if quick else (48, 8, 5)
    rows = _skewed_rows(n, long_every=8, short_words=8, long_words=200)
    data = Dataset.from_list(rows)
    common = dict(max_length=256, num_train_epochs=1, max_steps=-1, learning_rate=1e-4, stream_layers=False,
                  logging_steps=1, disable_tqdm=True)

    def deg_trainer(target_gb, **kw):
        args = deg_hf.StreamedSFTConfig(**trainer_kwargs(tempfile.mkdtemp(), mem_target_gb=target_gb, **{**common, **kw}))
        return deg_hf.StreamedSFTTrainer(model=path, args=args, train_dataset=data, processing_class=tok,
                                         peft_config=lora_config())

    # the target, from the planner's own estimate of this data: a batch of 8 short examples fits, one
    # long example alone fits with room, a batch holding the long example does not
    probe = deg_trainer(None, per_device_train_batch_size=batch)
    planner = probe.deg_planner
    lengths = [length for b in probe.get_train_dataloader() for length in b["deg_lengths"]]
    long_len, short_len = max(lengths)[0], min(lengths)[0]
    est = planner.estimate
    worst = est([Example(0, (long_len,))] + [Example(i, (short_len,)) for i in range(1, batch)])
    budget = max(int(1.6 * est(Example(0, (long_len,)))), int(1.2 * est([Example(i, (short_len,)) for i in range(batch)])))
    if not budget < worst:
        raise RuntimeError(f"no target splits the long batch: budget {budget} >= worst batch {worst}")
    static = planner.static_bytes
    target = static + budget
    target_gb = target / GIB
    fixed_mb = max(1, max((m for m in range(1, batch + 1) if batch % m == 0
                           and est([Example(i, (long_len,)) for i in range(m)]) <= budget), default=1))
    tokens = sum(len(ids) for ids in probe.train_dataset["input_ids"])
    probe.release_stream()

    def run_planned():
        tr = deg_trainer(target_gb, per_device_train_batch_size=batch)
        t0 = time.perf_counter()
        tr.train()
        return time.perf_counter() - t0, dict(tr.deg_counters), _retries_after_first_log(tr)

    def run_fixed():
        tr = deg_trainer(target_gb, per_device_train_batch_size=fixed_mb, gradient_accumulation_steps=batch // fixed_mb,
                         mem_plan=False, oom_retry=False)
        t0 = time.perf_counter()
        tr.train()
        return time.perf_counter() - t0, dict(tr.deg_counters), None

    sizes: list[int] = []

    class Sizes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            sizes.append(state.train_batch_size)

    def run_auto():
        class MeteredSFT(SFTTrainer):  # plain TRL; the same CPU device memory, the same target
            def training_step(self, *a, **kw):
                with memory.part():
                    return super().training_step(*a, **kw)

        tr = MeteredSFT(model=path, args=SFTConfig(**trainer_kwargs(
            tempfile.mkdtemp(), per_device_train_batch_size=batch, auto_find_batch_size=True,
            **{k: v for k, v in common.items() if k != "stream_layers"})),
            train_dataset=data, processing_class=tok, peft_config=lora_config(), callbacks=[Sizes()])
        memory = DeviceMemory("cpu", target, resident=_resident_of(tr))
        sizes.clear()
        t0 = time.perf_counter()
        tr.train()
        return time.perf_counter() - t0, {"restarts": max(0, len(sizes) - 1), "batch_sizes": list(sizes)}, None

    arms = {"planned": run_planned, "fixed": run_fixed, "auto_find_batch_size": run_auto}
    seconds = {k: [] for k in arms}
    info, crashes = {}, {k: 0 for k in arms}
    for _ in range(repeats):
        for name, fn in arms.items():  # interleaved: drift hits every arm alike
            try:
                elapsed, counters, after = fn()
            except torch.OutOfMemoryError:
                crashes[name] += 1
                continue
            seconds[name].append(elapsed)
            info[name] = {"counters": counters, "retries_after_first_log": after}

    def spread(xs):
        tps = sorted(tokens / x for x in xs)
        return {"median": round(statistics.median(tps), 1), "min": round(tps[0], 1), "max": round(tps[-1], 1)} if tps else None

    tps = {k: spread(v) for k, v in seconds.items()}
    planned = info.get("planned", {}).get("counters", {})
    ratios = [f / p for p, f in zip(seconds["planned"], seconds["fixed"])]
    return {
        "bench": "planner",
        "examples": n,
        "per_device_batch": batch,
        "repeats": repeats,
        "target_gib": round(target_gb, 6),
        "static_bytes": static,
        "activation_budget_bytes": budget,
        "worst_batch_estimate_bytes": worst,
        "tokens": tokens,
        "crashes": crashes,
        "deg_parts": planned.get("parts"),
        "deg_oom_retry": planned.get("oom_retry"),
        "deg_oom_skip": planned.get("oom_skip"),
        "deg_retry_fraction": round(planned["oom_retry"] / planned["parts"], 4) if planned.get("parts") else None,
        "deg_retries_after_first_log": info.get("planned", {}).get("retries_after_first_log"),
        "fixed_micro_batch": fixed_mb,
        "tokens_per_s": tps,
        "speedup_vs_fixed": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                             "max": round(max(ratios), 3)} if ratios else None,
        "auto_find_batch_size": info.get("auto_find_batch_size", {}).get("counters"),
        "torch_threads": torch.get_num_threads(),
    }


def _retries_after_first_log(trainer) -> dict:
    """Parts and out-of-memory retries logged after the first logging window (train.log.jsonl)."""
    path = os.path.join(trainer.args.output_dir, "train.log.jsonl")
    steps = [json.loads(x) for x in open(path, encoding="utf-8")]
    steps = [r for r in steps if "oom_retry" in r and "event" not in r]
    later = steps[1:]
    return {"windows": len(steps), "parts": sum(r["parts"] for r in later), "oom_retry": sum(r["oom_retry"] for r in later)}
