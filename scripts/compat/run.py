"""Run TRL's own DPO and KTO test files against plain TRL, then against deg_hf resident and streamed.

    python scripts/compat/run.py --trl-tests /path/to/trl/tests [--modes plain,resident,streamed]

``--trl-tests`` is the ``tests`` directory of a TRL checkout at the installed version's tag (the
files are run unchanged, from where they are; nothing of them is copied here). Each mode is one
pytest run with the :mod:`trl_compat` plugin, offline, on the stand-ins of :mod:`standins`.

The baseline is what passes with plain TRL. Targets: resident, every baseline test passes;
streamed, every one except those that assert full fine-tuning: that every parameter changed (a
streamed base stays frozen), or what a full fine-tune does with its separate reference model
(listed in ``SEPARATE_REFERENCE`` with the reason). The report lists each miss with its reason, and
ends with one JSON line of the counts. Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FILES = ("test_dpo_trainer.py", "test_kto_trainer.py")
MODES = ("plain", "resident", "streamed")
# TRL's own assertion when a parameter kept its value after training (with or without its message)
_UNCHANGED = re.compile(r"Parameter (\S+) has not changed")
_UNCHANGED_LINE = re.compile(r"assert not torch\.equal\(param, new_param\)")
#: tests that assert what only a full fine-tune does with its reference model, and why streaming differs
SEPARATE_REFERENCE = {
    "test_train_with_sync_ref_model":
        "sync_ref_model mixes the policy into a separate reference model; TRL refuses it with a PEFT "
        "model, and a streamed base always trains an adapter",
    "test_evaluate_precompute_ref_log_probs_after_training_raises":
        "expects TRL to refuse new reference log-probs after training, because a full fine-tune has "
        "overwritten its reference; a streamed base is never trained, so the reference stays available",
}


def run_mode(mode: str, trl_tests: str, work: str, select: str | None) -> dict:
    results = os.path.join(work, f"{mode}.json")
    env = dict(os.environ)
    env.update({
        "DEG_COMPAT_MODE": mode,
        "DEG_COMPAT_STANDINS": os.path.join(work, "standins"),
        "DEG_COMPAT_RESULTS": results,
        "PYTHONPATH": os.pathsep.join([HERE, REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),  # tiny models: threads only contend
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
    })
    cmd = [sys.executable, "-m", "pytest", "-p", "trl_compat", "-p", "no:cacheprovider", "-q", "-o", "addopts=",
           "--rootdir", os.path.dirname(os.path.abspath(trl_tests)), "-W", "ignore"]
    cmd += [os.path.join(trl_tests, name) for name in FILES]
    if select:
        cmd += ["-k", select]
    start = time.time()
    proc = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True)
    tail = (proc.stdout or "").strip().splitlines()[-1:] or [""]
    print(f"[{mode}] {tail[0]} ({time.time() - start:.0f} s)", flush=True)
    if not os.path.exists(results):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"the {mode} run wrote no results (pytest exit {proc.returncode})")
    with open(results, encoding="utf-8") as fh:
        return json.load(fh)["results"]


def full_fine_tune_assertion(entry: dict) -> bool:
    """A failure of TRL's "every parameter changed" check on a base (non-adapter) weight."""
    match = _UNCHANGED.search(entry.get("reason", ""))
    if match:
        return "lora_" not in match.group(1)
    return bool(_UNCHANGED_LINE.search(entry.get("line", "")))


def test_name(key: str) -> str:
    return key.split("::")[-1].split("[")[0]


def report(runs: dict[str, dict], trl_tests: str) -> int:
    def names(mode, outcome):
        return {k for k, v in runs.get(mode, {}).items() if v["outcome"] == outcome}

    baseline = names("plain", "passed")
    summary = {"trl_tests": trl_tests}
    for mode in MODES:
        if mode in runs:
            summary[f"{mode}_passed"] = len(names(mode, "passed"))
            summary[f"{mode}_failed"] = len(names(mode, "failed"))
            summary[f"{mode}_skipped"] = len(names(mode, "skipped"))
    status = 0
    for mode in ("resident", "streamed"):
        if mode not in runs or "plain" not in runs:
            continue
        missed = sorted(baseline - names(mode, "passed"))
        streamed = mode == "streamed"
        frozen = [k for k in missed if streamed and full_fine_tune_assertion(runs[mode].get(k, {}))]
        reference = [k for k in missed if streamed and k not in frozen and test_name(k) in SEPARATE_REFERENCE]
        other = [k for k in missed if k not in frozen and k not in reference]
        summary[f"{mode}_missed"] = len(missed)
        if streamed:
            summary["streamed_missed_every_parameter_changed"] = len(frozen)
            summary["streamed_missed_separate_reference"] = len(reference)
        summary[f"{mode}_missed_other"] = len(other)
        print(f"\n{mode}: {len(baseline) - len(missed)} of the {len(baseline)} tests that pass with plain TRL pass")
        for label, keys in (("assert that every parameter changed (full fine-tuning; a streamed base is frozen)",
                             frozen),
                            ("assert a full fine-tune's separate reference model", reference),
                            ("other causes", other)):
            if keys:
                print(f"  {label}: {len(keys)}")
                for key in keys:
                    entry = runs[mode].get(key, {"outcome": "not run"})
                    why = SEPARATE_REFERENCE.get(test_name(key)) if key in reference else None
                    print(f"    {key.split('::', 1)[-1]}: {entry['outcome']}: {entry.get('reason', '')}"
                          + (f"\n      ({why})" if why else ""))
        if other:
            status = 1
    skipped_reasons: dict[str, int] = {}
    for entry in runs.get("plain", {}).values():
        if entry["outcome"] == "skipped":
            skipped_reasons[entry.get("reason", "")] = skipped_reasons.get(entry.get("reason", ""), 0) + 1
    if skipped_reasons:
        print("\nskipped (plain TRL too), by reason:")
        for reason, count in sorted(skipped_reasons.items(), key=lambda kv: -kv[1]):
            print(f"  {count:4d}  {reason}")
    print(json.dumps(summary))
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-tests", required=True, help="the tests/ directory of a TRL checkout")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: plain, resident, streamed")
    parser.add_argument("--work", default=None,
                        help="working directory (stand-ins, results; a mode not in --modes reports its earlier "
                             "results from here); default: a new temp dir")
    parser.add_argument("-k", dest="select", default=None, help="pytest -k expression, to run a subset")
    args = parser.parse_args(argv)
    trl_tests = os.path.abspath(args.trl_tests)
    missing = [name for name in FILES if not os.path.isfile(os.path.join(trl_tests, name))]
    if missing:
        parser.error(f"{trl_tests} has no {', '.join(missing)}: pass the tests/ directory of a TRL checkout")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    work = args.work or tempfile.mkdtemp(prefix="deg-compat-")
    os.makedirs(work, exist_ok=True)
    print(f"TRL tests: {trl_tests}; stand-ins and results in {work}", flush=True)
    runs = {mode: run_mode(mode, trl_tests, work, args.select) for mode in modes}
    for mode in MODES:  # a mode not rerun reports from its earlier results in the same --work
        earlier = os.path.join(work, f"{mode}.json")
        if mode not in runs and os.path.exists(earlier):
            with open(earlier, encoding="utf-8") as fh:
                runs[mode] = json.load(fh)["results"]
            print(f"[{mode}] earlier results from {earlier}")
    return report(runs, trl_tests)


if __name__ == "__main__":
    sys.exit(main())
