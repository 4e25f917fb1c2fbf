"""DPO step time with prefix sharing vs without, on prompt-heavy pairs."""

from __future__ import annotations

import tempfile

from benches.common import lora_config, median_times, tiny_checkpoint


def _prompt_heavy_rows(n: int, prompt_words: int, completion_words: int, seed: int = 0):
    import random

    from harness import WORDS

    rng = random.Random(seed)

    def words(k):
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [{"prompt": words(prompt_words), "chosen": " " + words(completion_words),
             "rejected": " " + words(completion_words)} for _ in range(n)]


def run(quick: bool) -> dict:
    import torch
    from datasets import Dataset
    from harness import trainer_kwargs
    from transformers import PreTrainedTokenizerFast

    import deg_hf
    from deg_hf.memory import batch as mb
    from deg_hf.memory.planner import Example

    layers, hidden = (4, 128) if quick else (6, 256)
    prompt_words, completion_words = (64, 16) if quick else (128, 32)
    path = tiny_checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden, vocab=512)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    rows = _prompt_heavy_rows(8, prompt_words, completion_words)
    steps, trainers = {}, {}
    for stream in (True, False):
        for share in (True, False):
            args = deg_hf.StreamedDPOConfig(**trainer_kwargs(
                tempfile.mkdtemp(), max_length=4 * (prompt_words + completion_words), stream_layers=stream,
                prefix_sharing=share, per_device_train_batch_size=4))
            tr = deg_hf.StreamedDPOTrainer(model=path, args=args, train_dataset=Dataset.from_list(rows),
                                           processing_class=tok, peft_config=lora_config())
            tr.create_optimizer_and_scheduler(num_training_steps=10)
            tr.current_gradient_accumulation_steps = 1
            batch = next(iter(tr.get_train_dataloader()))
            key = f"{'shared' if share else 'plain'}_{'streamed' if stream else 'resident'}"
            trainers[key] = (tr, batch)

            def step(tr=tr, batch=batch):
                tr.training_step(tr.model, batch)
                tr.model.zero_grad(set_to_none=True)

            steps[key] = step
    times = median_times(steps, repeats=2 if quick else 10)

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
