#!/usr/bin/env python
"""deg_hf benchmarks. ``python scripts/bench.py NAME [--quick]`` runs one and ends with one JSON line.

Speed is measured as a ratio within one run (arms interleaved, medians), because these machines
are noisy; absolute seconds are printed for context only.

* ``stream``    - training-step time of a streamed model vs the same model resident, with and
                  without activation checkpointing; layer loads per step; on CUDA, host-to-device
                  GB/s.
* ``reference`` - layer fetches per step and step-time ratios of DPO and KTO vs SFT (streamed and
                  resident): the reference forward's cost.
* ``planner``   - a length-skewed dataset under a memory target enforced on CPU (``mem_target_gb``):
                  parts, retries, skips, crashes and tokens/s of the planned run vs a fixed
                  micro-batch sized for the worst case and vs ``auto_find_batch_size`` (5
                  interleaved repeats: median and spread).
* ``estimate``  - the planner's estimate vs the measured peak of every part over the harness
                  architectures x trainers x streamed/resident x prefix sharing x batch shapes,
                  and a run calibrated by ``observe()``.
* ``meter``     - the tensor meter's cost: a training step with and without it.
* ``prefix``    - DPO step time with prefix sharing vs without on prompt-heavy pairs (prompt about
                  4x each completion), streamed and resident; tokens per pair and the planner's
                  estimated activation bytes for both.
* ``quant``     - NF4 vs bf16 streaming of one checkpoint: store bytes, bytes moved per step, step
                  time, and the share of the NF4 step spent dequantizing.
* ``disk``      - step time with the store in RAM, on disk and half and half (cold cache), the disk
                  loader's read GB/s, and a plain cold read of the same files (the drive's limit).
* ``ranks``     - host memory per node with 1 and 2 local ranks streaming one checkpoint (~1 GiB store;
                  --quick: ~64 MiB): the store's proportional set size summed over the ranks, with the
                  node-shared store and with one store per rank, and the processes' whole PSS; the time
                  for local rank 1 to be ready after local rank 0 has published the store.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _checkpoint(directory, *, layers, hidden, vocab=1024, heads=8):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=4096,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(directory)
    from harness import write_tokenizer

    write_tokenizer(directory)
    return directory


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")


def _median_times(arms: dict, repeats: int) -> dict:
    """Interleave the arms (a, b, c, a, b, c, ...) so drift hits all of them alike."""
    times = {name: [] for name in arms}
    for fn in arms.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


# --------------------------------------------------------------------------------------- stream


def bench_stream(quick: bool) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    layers, hidden, seq, batch = (4, 256, 128, 2) if quick else (8, 512, 256, 4)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = _checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden)
    streamed, runtime = build_streamed_model(path, device=device, dtype=torch.float32 if device.type == "cpu" else None)
    streamed = get_peft_model(streamed, _lora())
    materialize_adapters(streamed, device)
    dtype = next(p.dtype for p in streamed.parameters() if not p.is_meta and p.is_floating_point())
    resident = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device), _lora())
    resident_ckpt = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device), _lora())
    resident_ckpt.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (batch, seq), generator=gen).to(device)

    def step(model):
        def run():
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
        return run

    runtime.reset_stats()
    times = _median_times({"streamed": step(streamed), "resident_ckpt": step(resident_ckpt),
                           "resident": step(resident)}, repeats=2 if quick else 4)
    steps_run = (2 if quick else 4) + 1
    stats = runtime.stats()
    out = {
        "bench": "stream",
        "device": device.type,
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "dtype": str(dtype)},
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "ratio_vs_resident_ckpt": round(times["streamed"] / times["resident_ckpt"], 3),
        "ratio_vs_resident": round(times["streamed"] / times["resident"], 3),
        "loads_per_step": round(stats["loads"] / steps_run, 2),
        "fetches_per_step": round((stats["loads"] + stats["hits"]) / steps_run, 2),
        "n_layers": layers,
        "store_bytes": stats["store_bytes"],
        "buffer_bytes": stats["buffer_bytes"],
    }
    if device.type == "cuda":
        src = runtime.store.block(0)
        dst = runtime.buffers[0][: src.numel()]
        t0 = time.perf_counter()
        for _ in range(20):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_gb_per_s"] = round(20 * src.numel() / (time.perf_counter() - t0) / 1e9, 2)
    runtime.close()
    return out


# ------------------------------------------------------------------------------------ reference


def bench_reference(quick: bool) -> dict:
    import torch
    from datasets import Dataset
    from harness import kto_rows, pref_rows, sft_rows, trainer_kwargs
    from transformers import AutoTokenizer

    import deg_hf

    layers, hidden = (4, 128) if quick else (6, 256)
    path = _checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden, vocab=512)
    tok = AutoTokenizer.from_pretrained(path)
    tasks = {
        "sft": ("StreamedSFTTrainer", "StreamedSFTConfig", sft_rows),
        "dpo": ("StreamedDPOTrainer", "StreamedDPOConfig", pref_rows),
        "kto": ("StreamedKTOTrainer", "StreamedKTOConfig", kto_rows),
    }
    trainers, steps = {}, {}
    for stream in (True, False):
        for task, (t_name, c_name, rows) in tasks.items():
            args = getattr(deg_hf, c_name)(**trainer_kwargs(tempfile.mkdtemp(), max_length=64, stream_layers=stream,
                                                           per_device_train_batch_size=8))
            tr = getattr(deg_hf, t_name)(model=path, args=args, train_dataset=Dataset.from_list(rows(16)),
                                         processing_class=tok, peft_config=_lora())
            tr.create_optimizer_and_scheduler(num_training_steps=10)
            tr.current_gradient_accumulation_steps = 1
            batch = next(iter(tr.get_train_dataloader()))
            key = f"{task}_{'streamed' if stream else 'resident'}"
            trainers[key] = tr

            def step(tr=tr, batch=batch):
                tr.training_step(tr.model, batch)
                tr.model.zero_grad(set_to_none=True)

            steps[key] = step
    fetches = {}
    for task in tasks:
        runtime = trainers[f"{task}_streamed"].stream_runtime
        runtime.reset_stats()
        steps[f"{task}_streamed"]()
        fetches[task] = runtime.loads + runtime.hits
    times = _median_times(steps, repeats=2 if quick else 4)
    return {
        "bench": "reference",
        "n_layers": layers,
        "fetches_per_step": fetches,
        "fetch_ratio_dpo_vs_sft": round(fetches["dpo"] / fetches["sft"], 3),
        "fetch_ratio_kto_vs_sft": round(fetches["kto"] / fetches["sft"], 3),
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "time_ratio_dpo_vs_sft_streamed": round(times["dpo_streamed"] / times["sft_streamed"], 3),
        "time_ratio_dpo_vs_sft_resident": round(times["dpo_resident"] / times["sft_resident"], 3),
        "time_ratio_kto_vs_sft_streamed": round(times["kto_streamed"] / times["sft_streamed"], 3),
        "time_ratio_kto_vs_sft_resident": round(times["kto_resident"] / times["sft_resident"], 3),
        "torch_threads": torch.get_num_threads(),
    }


# -------------------------------------------------------------------------------------- planner


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


def bench_planner(quick: bool) -> dict:
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

    path = _checkpoint(tempfile.mkdtemp(), layers=4, hidden=128, vocab=512)
    tok = AutoTokenizer.from_pretrained(path)
    n, batch, repeats = (16, 8, 2) if quick else (48, 8, 5)
    rows = _skewed_rows(n, long_every=8, short_words=8, long_words=200)
    data = Dataset.from_list(rows)
    common = dict(max_length=256, num_train_epochs=1, max_steps=-1, learning_rate=1e-4, stream_layers=False,
                  logging_steps=1, disable_tqdm=True)

    def deg_trainer(target_gb, **kw):
        args = deg_hf.StreamedSFTConfig(**trainer_kwargs(tempfile.mkdtemp(), mem_target_gb=target_gb, **{**common, **kw}))
        return deg_hf.StreamedSFTTrainer(model=path, args=args, train_dataset=data, processing_class=tok,
                                         peft_config=_lora())

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
            train_dataset=data, processing_class=tok, peft_config=_lora(), callbacks=[Sizes()])
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


# --------------------------------------------------------------------------------------- prefix


def _prompt_heavy_rows(n: int, prompt_words: int, completion_words: int, seed: int = 0):
    import random

    from harness import WORDS

    rng = random.Random(seed)

    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [{"prompt": words(prompt_words), "chosen": " " + words(completion_words),
             "rejected": " " + words(completion_words)} for _ in range(n)]


def bench_prefix(quick: bool) -> dict:
    import torch
    from datasets import Dataset
    from harness import trainer_kwargs
    from transformers import PreTrainedTokenizerFast

    import deg_hf
    from deg_hf.memory import batch as mb
    from deg_hf.memory.planner import Example

    layers, hidden = (4, 128) if quick else (6, 256)
    prompt_words, completion_words = (64, 16) if quick else (128, 32)
    path = _checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden, vocab=512)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    rows = _prompt_heavy_rows(8, prompt_words, completion_words)
    steps, trainers = {}, {}
    for stream in (True, False):
        for share in (True, False):
            args = deg_hf.StreamedDPOConfig(**trainer_kwargs(
                tempfile.mkdtemp(), max_length=4 * (prompt_words + completion_words), stream_layers=stream,
                prefix_sharing=share, per_device_train_batch_size=4))
            tr = deg_hf.StreamedDPOTrainer(model=path, args=args, train_dataset=Dataset.from_list(rows),
                                           processing_class=tok, peft_config=_lora())
            tr.create_optimizer_and_scheduler(num_training_steps=10)
            tr.current_gradient_accumulation_steps = 1
            batch = next(iter(tr.get_train_dataloader()))
            key = f"{'shared' if share else 'plain'}_{'streamed' if stream else 'resident'}"
            trainers[key] = (tr, batch)

            def step(tr=tr, batch=batch):
                tr.training_step(tr.model, batch)
                tr.model.zero_grad(set_to_none=True)

            steps[key] = step
    times = _median_times(steps, repeats=2 if quick else 10)

    tr, batch = trainers["shared_streamed"]
    inputs = tr._prepare_inputs(batch)
    lens = tr._deg_prompt_lens(inputs)
    plan = tr.deg_prefix.plan(inputs["input_ids"], inputs["attention_mask"], lens)
    pairs = len(lens) // 2
    shared = tr._deg_shared_prompt_lens(inputs)
    lengths = mb.row_lengths(inputs, True)
    planner = tr.deg_planner
    est_packed = planner.estimate([Example(i, (sum(lengths[i]) - shared[i],), prompt_len=shared[i]) for i in range(pairs)])
    est_rows = planner.estimate([Example(i, lengths[i]) for i in range(pairs)])
    return {
        "bench": "prefix",
        "n_layers": layers,
        "prompt_tokens_mean": round(sum(lens[:pairs]) / pairs, 1),
        "completion_tokens_mean": round((plan.tokens_rows - 2 * sum(lens[:pairs])) / (2 * pairs), 1),
        "tokens_per_pair": {"shared": round(plan.tokens_packed / pairs, 1), "plain": round(plan.tokens_rows / pairs, 1)},
        "est_activation_bytes": {"shared": est_packed, "plain": est_rows},
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "speedup_streamed": round(times["plain_streamed"] / times["shared_streamed"], 3),
        "speedup_resident": round(times["plain_resident"] / times["shared_resident"], 3),
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------------------------------- quant


def bench_quant(quick: bool) -> dict:
    """NF4 vs 16-bit streaming of one checkpoint: store bytes and bytes moved per training step (NF4 vs
    bf16), step time, and the share of the NF4 step spent dequantizing. Timed at bf16 on CUDA; on CPU,
    where bf16 matmuls have no fast kernel here (13x slower than fp32), timed at fp32 (NF4 dequantized
    to fp32 vs an fp32 store), and bitsandbytes' host dequantization is not the GPU's."""
    import torch
    from peft import get_peft_model

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters
    from deg_hf.streaming.quant import QuantSpec

    layers, hidden, seq, batch = (2, 256, 64, 2) if quick else (4, 512, 128, 2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = _checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (batch, seq), generator=gen).to(device)
    nf4 = QuantSpec("nf4", 64, True)

    def arm(dtype, spec):
        model, runtime = build_streamed_model(path, device=device, dtype=dtype, quantization=spec, progress=False)
        model = get_peft_model(model, _lora())
        materialize_adapters(model, device)

        def run():
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()

        return run, runtime

    # bytes: one bf16 training step with each store
    moved, store = {}, {}
    for name, spec in (("bf16", None), ("nf4", nf4)):
        run, runtime = arm(torch.bfloat16, spec)
        runtime.reset_stats()
        run()
        moved[name], store[name] = runtime.stats()["bytes_moved"], runtime.stats()["store_bytes"]
        runtime.close()
    # time: the training dtype, arms interleaved
    runs, runtimes = {}, {}
    for name, spec in (("16bit" if device.type == "cuda" else "fp32", None), ("nf4", nf4)):
        runs[name], runtimes[name] = arm(timed_dtype, spec)
    repeats = 2 if quick else 5
    for runtime in runtimes.values():
        runtime.reset_stats()
    times = _median_times(runs, repeats)
    nf4_stats = runtimes["nf4"].stats()
    plain = next(n for n in runs if n != "nf4")
    out = {
        "bench": "quant",
        "device": device.type,
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch},
        "store_bytes": store,
        "store_ratio_nf4_bf16": round(store["nf4"] / store["bf16"], 4),
        "bytes_moved_per_step": moved,
        "moved_ratio_nf4_bf16": round(moved["nf4"] / moved["bf16"], 4),
        "timed_dtype": str(timed_dtype).replace("torch.", ""),
        "step_s": {name: round(t, 4) for name, t in times.items()},
        "step_ratio_nf4_vs_unquantized": round(times["nf4"] / times[plain], 3),
        "dequantize_share": round(nf4_stats["dequantize_s"] / (repeats + 1) / times["nf4"], 4),
    }
    for runtime in runtimes.values():
        runtime.close()
    return out


# ----------------------------------------------------------------------------------------- disk


def _plain_read_gb_per_s(paths: list[str]) -> float:
    """The drive's limit for these files: one cold-cache sequential read of each, straight into a
    buffer (no loader, no compute)."""
    import torch

    from deg_hf.streaming.cache import drop_page_cache, read_file_into
    from deg_hf.streaming.sources import bytes_of

    buf = torch.empty(max(os.path.getsize(p) for p in paths), dtype=torch.uint8)
    total, elapsed = 0, 0.0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            drop_page_cache(fd)
            size = os.path.getsize(path)
            t0 = time.perf_counter()
            read_file_into(fd, bytes_of(buf)[:size], path)
            elapsed += time.perf_counter() - t0
            total += size
        finally:
            os.close(fd)
    return total / elapsed / 1e9


def bench_disk(quick: bool) -> dict:
    """Training steps with the store in RAM, on disk, and half and half (cold cache: the loader drops
    the pages behind each read), and a plain cold read of the same cache files. The shape is chosen so
    a layer's compute takes longer than its read, where the loader can hide the disk entirely."""
    import torch
    from peft import get_peft_model

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    layers, hidden, seq, batch = (4, 512, 256, 2) if quick else (8, 1024, 512, 2)
    path = _checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden)
    cache = tempfile.mkdtemp()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (batch, seq), generator=gen)
    arms, runtimes = {}, {}
    layer_bytes = None
    for name in ("ram", "disk", "mixed"):
        kwargs = {"tier": "ram"} if name == "ram" else {"tier": "disk"} if name == "disk" else \
            {"tier": "auto", "host_mem_gb": layer_bytes * (layers // 2) / 2**30}
        model, runtime = build_streamed_model(path, device="cpu", dtype=torch.float32, cache_dir=cache,
                                              progress=False, **kwargs)
        layer_bytes = runtime.store.max_layer_bytes
        model = get_peft_model(model, _lora())
        materialize_adapters(model, "cpu")

        def run(model=model):
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)

        arms[name], runtimes[name] = run, runtime
    for runtime in runtimes.values():
        runtime.reset_stats()
    repeats = 2 if quick else 4
    times = _median_times(arms, repeats)
    files = [runtimes["disk"].store.cache.layer_path(i) for i in range(layers)]
    plain = _plain_read_gb_per_s(files)
    disk = runtimes["disk"].stats()["tiers"]["disk"]
    mixed = runtimes["mixed"].stats()["tiers"]
    steps = repeats + 1
    per_layer_read_s = disk["read_s"] / max(disk["reads"], 1)
    out = {
        "bench": "disk",
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "dtype": "float32",
                  "layer_mib": round(layer_bytes / 2**20, 1)},
        "plain_read_gb_per_s": round(plain, 3),
        "loader_read_gb_per_s": disk["read_gb_per_s"],
        "loader_share_of_plain": round(disk["read_gb_per_s"] / plain, 3),
        "disk_bytes_per_step": int(disk["bytes_read"] / steps),
        "loader_wait_s_per_step": round(disk["wait_s"] / steps, 4),
        "read_s_per_layer": round(per_layer_read_s, 4),
        "compute_s_per_layer_ram": round(times["ram"] / (4 * layers), 4),  # forward, recompute, two backward matmuls
        "mixed_placement": mixed["placement"],
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "disk_vs_ram": round(times["disk"] / times["ram"], 3),
        "mixed_vs_ram": round(times["mixed"] / times["ram"], 3),
    }
    for runtime in runtimes.values():
        runtime.close()
    return out


# ------------------------------------------------------------------------------------- estimate


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


def bench_estimate(quick: bool) -> dict:
    """The planner's estimate (shipped coefficients, uncalibrated) against the measured peak of every
    part, over the harness architectures x SFT/DPO/KTO/ORPO/SimPO x streamed/resident x prefix sharing
    on/off x short/long/length-skewed micro-batches; then a run calibrated by observe()."""
    import statistics

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


# ---------------------------------------------------------------------------------------- meter


def bench_meter(quick: bool) -> dict:
    """A streamed SFT training step with the tensor meter measuring (what a CPU target costs) and
    without it, interleaved; two model sizes, since the meter costs per operation, not per byte."""
    from datasets import Dataset
    from harness import sft_rows, trainer_kwargs
    from transformers import AutoTokenizer

    import deg_hf
    from deg_hf.memory.meter import DeviceMemory

    out = {"bench": "meter", "sizes": {}}
    for layers, hidden, max_length in ((2, 64, 64), (4, 256, 256)) if not quick else ((2, 64, 64),):
        path = _checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden, vocab=512)
        tok = AutoTokenizer.from_pretrained(path)
        rows = [{"messages": [m[0], {"role": "assistant", "content": " ".join([m[1]["content"]] * (max_length // 8))}]}
                for m in (r["messages"] for r in sft_rows(8))]
        tr = deg_hf.StreamedSFTTrainer(
            model=path, args=deg_hf.StreamedSFTConfig(**trainer_kwargs(tempfile.mkdtemp(), max_length=max_length,
                                                                       per_device_train_batch_size=4)),
            train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=_lora())
        tr.create_optimizer_and_scheduler(num_training_steps=10)
        tr.current_gradient_accumulation_steps = 1
        batch = next(iter(tr.get_train_dataloader()))
        off = DeviceMemory("cpu", resident=tr._deg_resident_tensors)
        on = DeviceMemory("cpu", resident=tr._deg_resident_tensors, measure=True)

        def step(memory, tr=tr, batch=batch):
            def run():
                tr.deg_memory = memory
                tr.training_step(tr.model, batch)
                tr.model.zero_grad(set_to_none=True)
            return run

        times = _median_times({"off": step(off), "metered": step(on)}, repeats=3 if quick else 7)
        ops = on.meter.allocations
        out["sizes"][f"{layers}x{hidden}x{max_length}"] = {
            "step_s": {k: round(v, 4) for k, v in times.items()},
            "overhead": round(times["metered"] / times["off"] - 1, 3),
            "storages_counted_per_step": ops // ((3 if quick else 7) + 1),
        }
        tr.release_stream()
    return out


def bench_ranks(quick: bool) -> dict:
    """Local ranks as torchrun starts them (LOCAL_RANK, LOCAL_WORLD_SIZE, one MASTER_PORT per run),
    each building the streamed model as a trainer does (tests/shared_worker.py), measured once every
    rank of the run holds its store: the store's PSS (``/proc/<pid>/smaps``, the mapping's share) and
    the whole process's (``smaps_rollup``), summed over the node's ranks."""
    import subprocess

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "shared_worker.py")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(worker)))
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        # hidden 2048: one layer is 46M parameters, 176 MiB at fp32
        ckpt = _checkpoint(os.path.join(tmp, "ckpt"), layers=1 if quick else 6, hidden=1024 if quick else 2048)

        def node(name, world, share=True):
            out = os.path.join(tmp, name)
            env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1", DEG_HF_SHM_DIR=shm, LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(abs(hash(name)) % 50000), TORCHELASTIC_RUN_ID=name,
                       DEG_HF_SHARE_STORE="1" if share else "0")
            procs = [subprocess.Popen([sys.executable, worker, ckpt, out], env={**env, "LOCAL_RANK": str(r)},
                                      stderr=subprocess.PIPE, text=True) for r in range(world)]
            for p in procs:
                err = p.communicate(timeout=1200)[1]
                if p.returncode:
                    raise RuntimeError(err[-3000:])
            return [json.load(open(os.path.join(out, f"rank{r}.json"), encoding="utf-8")) for r in range(world)]

        one, two, own = node("one", 1), node("two", 2), node("own", 2, share=False)
    store = one[0]["bytes"]

    def total(records, key):
        return sum(r[key] for r in records)

    return {
        "bench": "ranks",
        "store_bytes": store,
        "store_pss_1_rank": total(one, "pss"),
        "store_pss_2_ranks_shared": total(two, "pss"),
        "store_pss_2_ranks_own": total(own, "pss"),
        "store_ratio_2_over_1_shared": round(total(two, "pss") / total(one, "pss"), 3),
        "store_ratio_2_over_1_own": round(total(own, "pss") / total(one, "pss"), 3),
        "node_pss_1_rank": total(one, "process_pss"),
        "node_pss_2_ranks_shared": total(two, "process_pss"),
        "node_pss_2_ranks_own": total(own, "process_pss"),
        "node_ratio_2_over_1_shared": round(total(two, "process_pss") / total(one, "process_pss"), 3),
        "roles": [r["share"].get("role") for r in two],
        "build_s": round(two[0]["built_s"], 3),
        "rank1_ready_after_publish_s": round(two[1]["store_ready_at"] - two[0]["store_ready_at"], 4),
    }


BENCHES = {"stream": bench_stream, "reference": bench_reference, "planner": bench_planner, "prefix": bench_prefix,
           "estimate": bench_estimate, "meter": bench_meter, "quant": bench_quant, "disk": bench_disk,
           "ranks": bench_ranks}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(BENCHES))
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    result = BENCHES[args.name](args.quick)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
