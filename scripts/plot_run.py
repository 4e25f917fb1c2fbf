"""Plot a deg_hf training run: loss, reward margin and estimated vs measured peak memory per step.

    python scripts/plot_run.py outputs/dpo                  # writes outputs/dpo/run.png
    python scripts/plot_run.py outputs/dpo --out dpo.png

Reads OUTPUT_DIR/train.log.jsonl (one JSON object per logged step; event rows are skipped), or,
when that file is missing, the ``log_history`` of OUTPUT_DIR/trainer_state.json. Needs matplotlib
(``pip install deg_hf[plot]``). The code is :mod:`deg_hf.plot` (the recipes' ``--summary`` uses it).
"""

from __future__ import annotations

import sys

from deg_hf.plot import main, plot, plot_run, read_rows, series  # noqa: F401  (this script's API)

if __name__ == "__main__":
    sys.exit(main())
