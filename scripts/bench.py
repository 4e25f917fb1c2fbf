#!/usr/bin/env python
"""deg_hf benchmarks. ``python scripts/bench.py NAME [--quick]`` runs one and ends with one JSON line.
Each lives in ``scripts/benches/NAME.py`` as ``run(quick) -> dict``.

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
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/benches

BENCHES = ("stream", "reference", "planner", "prefix", "estimate", "meter", "quant", "disk", "ranks")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(BENCHES))
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    result = importlib.import_module(f"benches.{args.name}").run(args.quick)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
