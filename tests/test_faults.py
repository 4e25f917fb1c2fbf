"""Fault tests, run as child processes (tests/fault_runner.py forks one per job after importing once):
a run that saves every step is killed with SIGKILL at 10 random moments, interrupted by a double
Ctrl-C and by SIGKILL inside a save, and stopped by a file-size limit part way through a save. After
each, no ``checkpoint-N`` that is not a complete checkpoint exists, and ``resume_from_checkpoint=True``
finishes with exactly the uninterrupted run's adapter (max diff 0.0 on CPU)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MAX_STEPS = 5  # fault_runner.MAX_STEPS: saves checkpoint-1 .. checkpoint-5
KILLS = 10
SEED = 15


def assert_only_complete_checkpoints(output_dir: Path) -> list[int]:
    """Every checkpoint-N directory loads whole, read independently of deg_hf's own check; returns
    their steps."""
    from deg_hf.checkpoint import read_deg_json

    steps = []
    for path in sorted(output_dir.glob("checkpoint-*")):
        state = json.loads((path / "trainer_state.json").read_text())
        assert state["global_step"] == int(path.name.split("-")[1]), path
        assert load_file(path / "adapter_model.safetensors"), path
        for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
            torch.load(path / name, weights_only=False)
        read_deg_json(path)
        assert (path / "README.md").is_file()
        steps.append(state["global_step"])
    return steps


def after_fault(out: Path) -> Path:
    return out.with_name(out.name + ".after-fault")


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def faults(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    rng = random.Random(SEED)
    # two uninterrupted runs: the second times the run (the first warms the caches) and must agree
    jobs = [{"output_dir": str(root / "first")}, {"output_dir": str(root / "reference"), "timing": True}]

    def interrupted(name: str, **fault):
        jobs.append({"output_dir": str(root / name), **fault})
        jobs.append({"output_dir": str(root / name), "resume": True})

    for i in range(KILLS):
        interrupted(f"kill-{i}", kill_at=round(rng.uniform(0.02, 0.95), 3))
    interrupted("kill-in-save", in_save=[3, "kill"])
    interrupted("double-ctrl-c-in-save", in_save=[2, "double_sigint"])
    for i in range(3):  # the disk fills after a random step: the next save fails at a random file
        interrupted(f"fsize-{i}", fsize=[rng.randint(1, MAX_STEPS - 1), rng.randint(4_000, 50_000)])
    plan = root / "plan.json"
    plan.write_text(json.dumps({"model": checkpoint("llama"), "jobs": jobs}))
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", TRL_EXPERIMENTAL_SILENCE="1")
    proc = subprocess.run([sys.executable, str(HERE / "fault_runner.py"), str(plan), str(root / "results.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())["jobs"]
    return root, list(zip(jobs, results))


def runs(faults, prefix):
    root, pairs = faults
    out = []
    for (job, result), (resume, resumed) in zip(pairs[2::2], pairs[3::2]):
        if Path(job["output_dir"]).name.startswith(prefix):
            assert resume.get("resume") and resume["output_dir"] == job["output_dir"]
            out.append((Path(job["output_dir"]), job, result, resumed))
    return out


def reference(faults):
    root, pairs = faults
    assert pairs[0][1]["exit"] == pairs[1][1]["exit"] == 0, (pairs[0][1].get("error"), pairs[1][1].get("error"))
    out = root / "reference"
    assert assert_only_complete_checkpoints(out) == list(range(1, MAX_STEPS + 1))
    final = load_file(out / "adapter_model.safetensors")
    assert max_diff(load_file(root / "first" / "adapter_model.safetensors"), final) == 0.0  # deterministic
    # control: training moved the adapter, so equal adapters below are not two untrained ones
    assert max_diff(final, load_file(out / "checkpoint-1" / "adapter_model.safetensors")) > 0
    return final


def check_resumed(out: Path, resumed: dict, want: dict) -> None:
    assert resumed["exit"] == 0, resumed.get("error")
    assert assert_only_complete_checkpoints(out) == list(range(1, MAX_STEPS + 1))
    assert max_diff(load_file(out / "adapter_model.safetensors"), want) == 0.0
    assert max_diff(load_file(out / f"checkpoint-{MAX_STEPS}" / "adapter_model.safetensors"), want) == 0.0
    assert not (out / ".deg-staging").exists()


def test_kill_9_at_random_moments_leaves_only_complete_checkpoints_and_resumes_exactly(faults):
    want = reference(faults)
    kills = runs(faults, "kill-")
    kills = [k for k in kills if k[0].name != "kill-in-save"]
    assert len(kills) == KILLS
    left = []
    for out, _job, result, resumed in kills:
        assert result["exit"] == -9, result.get("error")  # the control: every kill landed inside its run
        left.append(assert_only_complete_checkpoints(after_fault(out)))
        check_resumed(out, resumed, want)
    assert len({len(steps) for steps in left}) >= 3, left  # the moments spread over the run


def test_kill_9_inside_a_save_leaves_no_checkpoint_of_that_step(faults):
    want = reference(faults)
    ((out, job, result, resumed),) = runs(faults, "kill-in-save")
    assert result["exit"] == -9
    # the save of checkpoint-3 was in flight: staged, never renamed (the control that the kill hit a save)
    assert assert_only_complete_checkpoints(after_fault(out)) == [1, 2]
    assert (after_fault(out) / ".deg-staging" / "checkpoint-3" / "optimizer.pt").is_file()
    check_resumed(out, resumed, want)
    log = [json.loads(line) for line in (out / "train.log.jsonl").read_text().splitlines()]
    # the interrupted run logged step 3 before dying in its save; the resumed run started after step 2
    plans = [row["step"] for row in log if row.get("event") == "mem_plan"]
    assert plans == [0, 2]


def test_double_ctrl_c_inside_a_save(faults):
    want = reference(faults)
    ((out, job, result, resumed),) = runs(faults, "double-ctrl-c")
    assert result["exit"] == 1 and result["error"].startswith("KeyboardInterrupt")
    assert assert_only_complete_checkpoints(after_fault(out)) == [1]
    check_resumed(out, resumed, want)


def test_a_full_disk_during_a_save_leaves_no_partial_checkpoint(faults):
    want = reference(faults)
    for out, job, result, resumed in runs(faults, "fsize-"):
        step = job["fsize"][0]
        assert result["exit"] == 1, result
        assert "Error" in result["error"].splitlines()[0]
        # the run stopped in the save of checkpoint-`step`: the checkpoints before it are there and whole
        assert assert_only_complete_checkpoints(after_fault(out)) == list(range(1, step))
        assert not (after_fault(out) / ".deg-staging").exists()  # the failed save cleaned up after itself
        log = [json.loads(line) for line in (out / "train.log.jsonl").read_text().splitlines()]
        plans = [row["step"] for row in log if row.get("event") == "mem_plan"]
        assert plans == [0, step - 1], (job, plans)
        check_resumed(out, resumed, want)
