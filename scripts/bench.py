#!/usr/bin/env python
"""deg_hf benchmarks. ``python scripts/bench.py NAME [--quick]`` runs one and ends with one JSON line.

Speed is measured as a ratio within one run (arms interleaved, medians), because these machines
are noisy; absolute seconds are printed for context only.

* ``stream``    - training-step time of a streamed model vs the same model resident, with and
                  without activation checkpointing; layer loads per step; on CUDA, host-to-device
                  GB/s.
* ``reference`` - layer fetches per step and step-time ratios of DPO and KTO vs SFT (streamed and
                  resident): the reference forward's cost.
* ``planner``   - a length-skewed dataset under a simulated device-memory budget: crashes,
                  tokens/s of the planned run vs a fixed micro-batch small enough for the longest
                  batch, and what ``auto_find_batch_size`` does (restarts, effective-batch changes).
* ``prefix``    - DPO step time with prefix sharing vs without on prompt-heavy pairs (prompt about
                  4x each completion), streamed and resident; tokens per pair and the planner's
                  estimated activation bytes for both.
* ``quant``     - NF4 vs bf16 streaming of one checkpoint: store bytes, bytes moved per step, step
                  time, and the share of the NF4 step spent dequantizing.
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


def bench_planner(quick: bool) -> dict:
    import torch
    from datasets import Dataset
    from harness import trainer_kwargs
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    import deg_hf
    from deg_hf.memory.simulate import SimulatedDeviceMemory

    path = _checkpoint(tempfile.mkdtemp(), layers=4, hidden=128, vocab=512)
    tok = AutoTokenizer.from_pretrained(path)
    n, batch = (16, 8) if quick else (48, 8)
    rows = _skewed_rows(n, long_every=8, short_words=8, long_words=200)
    data = Dataset.from_list(rows)
    max_length = 256
    # budget: a batch of 8 short examples fits, a batch holding a long one does not; one long alone fits
    probe = SimulatedDeviceMemory(1 << 62)
    probe_trainer = deg_hf.StreamedSFTTrainer(
        model=path, args=deg_hf.StreamedSFTConfig(**trainer_kwargs(tempfile.mkdtemp(), max_length=max_length,
                                                                   per_device_train_batch_size=1, max_steps=1)),
        train_dataset=Dataset.from_list([rows[7]]), processing_class=tok, peft_config=_lora())
    probe_trainer.deg_memory_simulator = probe
    probe_trainer.train()
    budget = int(probe.peaks[-1] * 1.3)  # one long example fits, with room to spare

    def tokens_per_s(trainer) -> tuple[float, float]:
        t0 = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - t0
        tokens = sum(int(sum(1 for _ in tok(r["messages"][1]["content"])["input_ids"])) for r in rows)
        return tokens / elapsed, elapsed

    common = dict(max_length=max_length, num_train_epochs=1, max_steps=-1, learning_rate=1e-4)
    # deg_hf: the batch the user asked for; long micro-batches are split, nothing restarts
    planned = deg_hf.StreamedSFTTrainer(
        model=path, args=deg_hf.StreamedSFTConfig(**trainer_kwargs(tempfile.mkdtemp(), per_device_train_batch_size=batch,
                                                                   **common)),
        train_dataset=data, processing_class=tok, peft_config=_lora())
    planned.simulate_device_memory(budget)
    crashes = 0
    try:
        planned_tps, planned_s = tokens_per_s(planned)
    except torch.OutOfMemoryError:
        crashes, planned_tps, planned_s = 1, 0.0, float("nan")

    # fixed: the largest micro-batch that survives the longest batch (a long example plus short
    # ones), with gradient accumulation to keep the effective batch
    fixed_mb = 1
    fixed = deg_hf.StreamedSFTTrainer(
        model=path, args=deg_hf.StreamedSFTConfig(**trainer_kwargs(
            tempfile.mkdtemp(), per_device_train_batch_size=fixed_mb, gradient_accumulation_steps=batch // fixed_mb,
            oom_retry=False, mem_plan=False, **common)),
        train_dataset=data, processing_class=tok, peft_config=_lora())
    fixed.simulate_device_memory(budget)
    fixed_tps, fixed_s = tokens_per_s(fixed)

    # auto_find_batch_size: plain TRL, the same simulated device; it restarts with a smaller batch
    class SimulatedSFT(SFTTrainer):
        def training_step(self, *args, **kwargs):
            with sim.part():
                return super().training_step(*args, **kwargs)

    sim = SimulatedDeviceMemory(budget)
    sizes = []

    class Sizes(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            sizes.append(state.train_batch_size)

    auto = SimulatedSFT(model=path, args=SFTConfig(**trainer_kwargs(tempfile.mkdtemp(), per_device_train_batch_size=batch,
                                                                    auto_find_batch_size=True, **common)),
                        train_dataset=data, processing_class=tok, peft_config=_lora(), callbacks=[Sizes()])
    auto_crash = 0
    try:
        auto.train()
    except torch.OutOfMemoryError:
        auto_crash = 1
    distinct = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    return {
        "bench": "planner",
        "examples": n,
        "per_device_batch": batch,
        "simulated_budget_bytes": budget,
        "crashes": crashes,
        "deg_parts": planned.deg_counters["parts"],
        "deg_oom_retry": planned.deg_counters["oom_retry"],
        "deg_oom_skip": planned.deg_counters["oom_skip"],
        "deg_restarts": 0,
        "deg_effective_batch_changes": 0,
        "planned_tokens_per_s": round(planned_tps, 1),
        "fixed_micro_batch": fixed_mb,
        "fixed_tokens_per_s": round(fixed_tps, 1),
        "speedup_vs_fixed": round(planned_tps / fixed_tps, 3) if fixed_tps else None,
        "auto_find_batch_size_restarts": max(0, len(sizes) - 1),
        "auto_find_batch_size_batches": sizes,
        "auto_find_batch_size_effective_batch_changes": max(0, len(distinct) - 1),
        "auto_find_batch_size_crashed": auto_crash,
        "seconds": {"planned": round(planned_s, 2), "fixed": round(fixed_s, 2)},
    }


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


BENCHES = {"stream": bench_stream, "reference": bench_reference, "planner": bench_planner, "prefix": bench_prefix,
           "quant": bench_quant}


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
