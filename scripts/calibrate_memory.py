#!/usr/bin/env python
"""Fit memory-estimate coefficients to measured peaks on a CUDA device.

    python scripts/calibrate_memory.py MODEL --out coef.json [--streamed] [--rows 1 2 4] [--lengths 256 1024]

Runs one LoRA training step (forward + backward) for every (rows, length) of the grid, measures the
peak device memory the step adds (max allocated minus allocated before it), and fits ``MemCoef`` so
that the estimate never under-predicts any measured peak: the default per-component coefficients
are scaled by the largest measured/estimated ratio of the activation part (the constant workspace
is kept). Pass the file as ``mem_coef_file`` in any Streamed*Config.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--streamed", action="store_true", help="measure the streamed model (default: resident)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--lora-r", type=int, default=16)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("calibrate_memory.py measures device memory and needs a CUDA device", file=sys.stderr)
        return 2
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from deg_hf.memory.coef import MemCoef, breakdown, features
    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules="all-linear")
    if args.streamed:
        base, _ = build_streamed_model(args.model, device="cuda")
        model = get_peft_model(base, lora)
        materialize_adapters(model, "cuda")
    else:
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda()
        base.gradient_checkpointing_enable({"use_reentrant": False})
        model = get_peft_model(base, lora)
    model.train()
    config = base.config.to_dict()
    dtype_bytes = next(p.dtype for p in base.parameters() if not p.is_meta).itemsize
    vocab = base.config.get_text_config().vocab_size
    coef = MemCoef()
    samples, worst = [], 0.0
    for rows in args.rows:
        for length in args.lengths:
            ids = torch.randint(0, vocab, (rows, length), device="cuda")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            try:
                model(input_ids=ids, labels=ids).loss.backward()
            except torch.OutOfMemoryError:
                print(f"rows={rows} length={length}: out of memory, left out")
                continue
            finally:
                model.zero_grad(set_to_none=True)
            measured = torch.cuda.max_memory_allocated() - before
            feats = features(config, rows=rows, padded_len=length, streaming=args.streamed,
                             checkpointing=True, dtype_bytes=dtype_bytes)
            parts = breakdown(feats, coef)
            workspace = parts.pop("workspace")
            ratio = max(0.0, measured - workspace) / max(1, sum(parts.values()))
            worst = max(worst, ratio)
            samples.append({"rows": rows, "length": length, "measured": measured, "ratio": round(ratio, 4)})
            print(json.dumps(samples[-1]))
    if not samples:
        print("no grid point ran", file=sys.stderr)
        return 1
    fitted = {k: (v if k == "workspace" else v * worst) for k, v in coef.to_dict().items()}
    MemCoef.from_dict(fitted).save(args.out)
    print(json.dumps({"out": args.out, "scale_applied": round(worst, 4), "samples": len(samples)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
