#!/usr/bin/env python
"""`make demo`: DPO with layer streaming on the embedded tiny model and data, on CPU, offline.

Prints the losses as it trains, then a summary: held-out reward accuracy before -> after, the
streaming counters, the memory plan, and where the checkpoint (adapter, deg.json, model card) went.

Held-out reward accuracy: the fraction of held-out pairs whose implicit DPO reward
beta * (log pi(y|x) - log pi_ref(y|x)) is higher for the chosen completion, a tie counting one half.
Before training the adapter is zero, policy == reference, every pair ties, so it starts at 0.5.
(TRL's own `rewards/accuracies` counts ties as wrong and so starts at 0.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def held_out_reward_accuracy(trainer, dataset) -> tuple[float, float]:
    """(accuracy with ties as 1/2, mean reward margin) over ``dataset`` through TRL's own reference path."""
    import torch

    loader = trainer.get_eval_dataloader(dataset)
    scores, margins = [], []
    trainer.model.eval()
    for batch in loader:
        batch = trainer._prepare_inputs(batch)
        ref_chosen, ref_rejected = trainer.compute_ref_log_probs(trainer.model, batch)
        kwargs = {k: v for k, v in batch.items() if k not in {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}}
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        with torch.no_grad():
            logps = trainer.model(**kwargs, use_cache=False, labels=labels, fused_lm_head=True).log_probs
        chosen, rejected = logps[:, -(batch["completion_mask"].size(1) - 1):].sum(1).chunk(2)
        margin = trainer.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
        scores += [1.0 if m > 0 else 0.5 if m == 0 else 0.0 for m in margin.tolist()]
        margins += margin.tolist()
    trainer.model.train()
    return sum(scores) / len(scores), sum(margins) / len(margins)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="demo_output")
    parser.add_argument("--max-steps", type=int, default=100)
    args = parser.parse_args(argv)

    import torch
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    import deg_hf
    from deg_hf import StreamedDPOConfig, StreamedDPOTrainer

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    start = time.perf_counter()
    model = deg_hf.assets.tiny_model_path()
    config = StreamedDPOConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        per_device_eval_batch_size=32,
        learning_rate=1e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        beta=0.1,
        max_length=64,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=0,
        stream_layers=True,
        # one layer on the device at a time: every layer change is a host-to-device load, as for
        # a model much larger than the device (the tiny model would otherwise sit in 2 buffers)
        stream_buffers=1,
    )
    trainer = StreamedDPOTrainer(
        model=model,
        args=config,
        train_dataset=deg_hf.assets.tiny_dataset("preference", "train"),
        eval_dataset=deg_hf.assets.tiny_dataset("preference", "test"),
        processing_class=AutoTokenizer.from_pretrained(model),
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    before, margin_before = held_out_reward_accuracy(trainer, trainer.eval_dataset)
    trainer.stream_runtime.reset_stats()
    result = trainer.train()
    stream = trainer.stream_runtime.stats()
    after, margin_after = held_out_reward_accuracy(trainer, trainer.eval_dataset)
    trainer.save_model()
    plot = None
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import plot_run

        plot = os.path.join(args.output_dir, "run.png")
        if plot_run.main([args.output_dir, "--out", plot]) != 0:
            plot = None
    except Exception as exc:  # the plot is a nicety: say why it is missing, keep the run
        print(f"(no plot: {exc})")
    counters = trainer.deg_counters
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rows = [
        ("held-out reward accuracy", f"{before:.3f} -> {after:.3f}"),
        ("held-out reward margin", f"{margin_before:+.3f} -> {margin_after:+.3f}"),
        ("train loss (first -> last log)", f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"),
        ("steps", f"{trainer.state.global_step} ({result.metrics.get('train_runtime', 0):.1f} s)"),
        ("layer fetches (loads + buffer hits)", f"{stream['loads'] + stream['hits']} ({stream['loads']} loads)"),
        ("bytes moved host -> device", f"{stream['bytes_moved'] / 2**20:.1f} MiB"),
        ("store / device buffers", f"{stream['store_bytes'] / 2**20:.2f} MiB / {stream['buffer_bytes'] / 2**20:.2f} MiB"),
        ("memory plan: parts / oom_retry / oom_skip",
         f"{counters['parts']} / {counters['oom_retry']} / {counters['oom_skip']}"),
        ("reference model", "same streamed base, adapter disabled (ref_model is None: "
                            f"{trainer.ref_model is None})"),
        ("checkpoint", os.path.abspath(args.output_dir) + " (adapter, deg.json, README.md)"),
        ("plot", plot or "-"),
        ("wall time", f"{time.perf_counter() - start:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n deg_hf demo: streamed DPO on the embedded tiny model")
    print(" " + "-" * (width + 40))
    for key, value in rows:
        print(f" {key:<{width}}  {value}")
    print(" " + "-" * (width + 40))
    trainer.release_stream()
    return 0 if after >= 0.8 else 1


if __name__ == "__main__":
    raise SystemExit(main())
