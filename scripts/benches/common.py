"""What the benchmarks share: a tiny Llama checkpoint on disk, a LoRA config, interleaved timing."""

from __future__ import annotations

import statistics
import time


def tiny_checkpoint(directory, *, layers, hidden, vocab=1024, heads=8):
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


def lora_config():
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear")


def median_times(arms: dict, repeats: int) -> dict:
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


def train_step(model, ids):
    """One training step's work on ``ids`` (forward with labels, backward, gradients dropped), as a
    callable for :func:`median_times`; waits for the device on CUDA so the time is the step's."""

    def run():
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        if ids.device.type == "cuda":
            import torch

            torch.cuda.synchronize()

    return run
