#!/usr/bin/env python
"""Fit the memory-estimate coefficients (``MemCoef``) to measured peaks.

    python scripts/calibrate_memory.py --out coef.json [--device cpu|cuda] [--quick]

Trains every deg_hf trainer (SFT, DPO and ORPO and SimPO with prefix sharing on and off, KTO) for
three micro-batches (short, long, length-skewed) on a grid of tiny real checkpoints (the test
harness's Llama, Qwen2, Qwen3, Mistral and Gemma2, and four more with other widths, depths and
vocabularies), measuring every part's
peak device memory: on CPU with the tensor meter, on CUDA with the allocator's counters. It then
fits non-negative coefficients that minimise the squared relative error of the estimate
(``deg_hf.memory.calibrate.fit``), prints how close the fit comes, and writes the JSON that
``mem_coef_file`` reads. ``boundary`` is pinned to 1 (checkpointing saves each layer's input once:
at these depths the data cannot tell it from the per-token terms). With every sample in float32
the estimate's bf16-scaled terms and their fp32 twins cannot be told apart; the fp32 twins take
the weight (the larger choice in bf16).
``deg_hf.memory.coef.MemCoef``'s defaults are this script's CPU fit (see its docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

#: (arch, config overrides) of the grid: the test harness's five checkpoints, then wider and
#: deeper ones with the vocabulary and the hidden size varied apart (so the LM head's terms and the
#: layers' can be told apart) and an eager-attention one
GRID = [
    ("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {}), ("gemma2", {}),
    ("llama", {"hidden": 128, "n_layers": 4, "vocab": 1024}),
    ("llama", {"hidden": 32, "n_layers": 2, "vocab": 2048}),
    ("llama", {"hidden": 128, "n_layers": 6, "vocab": 64}),
    ("gemma2", {"hidden": 64, "n_layers": 3, "vocab": 512}),
]
QUICK_GRID = [GRID[0], GRID[4], GRID[5]]
#: the terms whose size is the same in float32 whichever twin carries it
BF16_TWINS = ("layer_hidden", "layer_inter", "logits")
#: coefficients the mechanism fixes: non-reentrant checkpointing saves each layer's input once
KNOWN = {"boundary": 1.0}


def runs(tasks):
    from memory_runs import PAIRED

    for task in tasks:
        for prefix in ((True, False) if task in PAIRED else (True,)):
            yield task, prefix


def collect(grid, tasks, device: str, log=print) -> list:
    from memory_runs import checkpoint, measure

    samples = []
    for arch, config in grid:
        path = checkpoint(arch, **config)
        for task, prefix in runs(tasks):
            t0 = time.perf_counter()
            got = measure(path, task, prefix=prefix, device=device, tags={"arch": arch, **config})
            samples += got
            log(f"{arch} {config or ''} {task} prefix={prefix}: {[s.peak_bytes for s in got]} "
                f"({time.perf_counter() - t0:.1f} s)")
    return samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the coefficients' JSON file (mem_coef_file)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when present")
    parser.add_argument("--tasks", nargs="+", default=["sft", "dpo", "kto", "orpo", "simpo"])
    parser.add_argument("--quick", action="store_true", help="three checkpoints instead of seven")
    parser.add_argument("--samples", help="also write every measured sample here (JSON lines)")
    args = parser.parse_args(argv)

    import torch
    from memory_runs import quiet

    from deg_hf.memory.calibrate import accuracy, errors, fit

    quiet()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    samples = collect(QUICK_GRID if args.quick else GRID, args.tasks, device)
    if not samples:
        print("no part was measured", file=sys.stderr)
        return 1
    fixed = dict(KNOWN)
    if all(s.features.dtype_bytes == 4 for s in samples):
        fixed.update({name: 0.0 for name in BF16_TWINS})
    coef = fit(samples, fixed=fixed)
    coef.save(args.out)
    if args.samples:
        with open(args.samples, "w", encoding="utf-8") as fh:
            for s in samples:
                fh.write(json.dumps({"features": s.features.to_dict(), "peak_bytes": s.peak_bytes, "tags": s.tags}) + "\n")
    result = {"out": args.out, "device": device, "samples": len(samples),
              "fit": accuracy(errors(samples, coef)), "coefficients": {k: round(v, 6) for k, v in coef.to_dict().items()}}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
