"""deg_hf's benchmarks, one module per benchmark, each with ``run(quick) -> dict``; run them with
``python scripts/bench.py NAME``."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# the tiny checkpoints and tokenizer come from the test harness
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
