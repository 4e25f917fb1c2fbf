"""Plot a deg_hf training run: loss, reward margin and estimated vs measured peak memory per step.

    python scripts/plot_run.py outputs/dpo                  # writes outputs/dpo/run.png
    python scripts/plot_run.py outputs/dpo --out dpo.png
    deg_hf.plot.plot_run("outputs/dpo")                     # from Python

Reads OUTPUT_DIR/train.log.jsonl (one JSON object per logged step; event rows are skipped), or,
when that file is missing, the ``log_history`` of OUTPUT_DIR/trainer_state.json. Measured peaks are
logged on CUDA only. Needs matplotlib (``pip install deg_hf[plot]``), imported when a plot is drawn.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

PANELS = (
    ("loss", "loss", [("loss", "train loss"), ("eval_loss", "eval loss")]),
    ("reward margin", "rewards/margins", [("rewards/margins", "train"), ("eval_rewards/margins", "eval")]),
    ("peak memory (GiB)", "GiB", [("est_peak_gib", "estimated"), ("peak_gib", "measured")]),
)


def read_rows(output_dir: str) -> list[dict]:
    """The step rows of a run: train.log.jsonl without its event rows, else trainer_state.json's log."""
    log = os.path.join(output_dir, "train.log.jsonl")
    if os.path.exists(log):
        with open(log, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    else:
        state = os.path.join(output_dir, "trainer_state.json")
        if not os.path.exists(state):
            raise FileNotFoundError(f"neither {log} nor {state} exists")
        with open(state, encoding="utf-8") as fh:
            rows = json.load(fh).get("log_history", [])
    return [r for r in rows if "event" not in r and "step" in r]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        steps.append(int(row["step"]))
        values.append(value)
    return steps, values


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(7, 9), sharex=True)
    for ax, (name, ylabel, keys) in zip(axes, PANELS):
        drawn = False
        for key, label in keys:
            steps, values = series(rows, key)
            if steps:
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=label)
                drawn = True
        ax.set_title(name)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="best", fontsize="small")
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    axes[-1].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def plot_run(output_dir: str, out: str | None = None, rows: list[dict] | None = None) -> str:
    """Draw ``output_dir``'s run to ``out`` (default ``OUTPUT_DIR/run.png``); returns the PNG's path."""
    out = out or os.path.join(output_dir, "run.png")
    rows = read_rows(output_dir) if rows is None else rows
    plot(rows, out, title=os.path.basename(os.path.normpath(output_dir)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="the run's output directory")
    parser.add_argument("--out", default=None, help="PNG to write (default: OUTPUT_DIR/run.png)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_run.py needs matplotlib: pip install matplotlib (or deg_hf[plot])", file=sys.stderr)
        return 2
    try:
        rows = read_rows(args.output_dir)
    except (FileNotFoundError, json.JSONDecodeError) as exc:
        print(f"plot_run.py: {exc}", file=sys.stderr)
        return 1
    if not rows:
        print(f"plot_run.py: no logged steps in {args.output_dir}", file=sys.stderr)
        return 1
    print(plot_run(args.output_dir, args.out, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
