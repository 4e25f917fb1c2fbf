"""Two processes over gloo train the DPO recipe data-parallel, streaming the embedded tiny model.

``torchrun --standalone --nproc_per_node 2 recipes/dpo.py --use_cpu true ...`` (accelerate sees
torchrun's environment and runs MULTI_CPU, DistributedDataParallel over gloo) is compared with one
process on the doubled per-device batch. Plain SGD (the update is ``-lr * grad``, so equal weights
mean equal gradients), no clipping, a constant learning rate and the sequential sampler: accelerate
gives rank r the r-th batch of per-device size B, so the two ranks together see exactly the
single process's batch of 2B, and DPO's loss is a mean over pairs (the mean of two equal-size rank
means is the mean over the doubled batch). Each process runs through tests/mp_recipe.py, which
records its adapter and every file it writes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "mp_recipe.py"
STEPS = 2
# GiB, with max_length 40 (the rows of the first 16 pairs are ~34 tokens, so nothing is cut): the
# pre-flight's worst-case pair fits, two packed pairs fit, four do not
SPLIT_TARGET_GB = 0.068
COMMON = ["--use_cpu", "true", "--max_steps", str(STEPS), "--report_to", "none", "--disable_tqdm", "true",
          "--logging_steps", "1", "--optim", "sgd", "--learning_rate", "1.0", "--lr_scheduler_type", "constant",
          "--max_grad_norm", "0", "--train_sampling_strategy", "sequential", "--seed", "0", "--max_length", "64"]


def _torchrun_available() -> bool:
    import torch.distributed as dist

    return (importlib.util.find_spec("torch.distributed.run") is not None and dist.is_available()
            and dist.is_gloo_available())


needs_torchrun = pytest.mark.skipif(not _torchrun_available(), reason="torchrun / gloo not available")


def _run(cmd: list[str], **extra_env) -> subprocess.CompletedProcess:
    env = dict(os.environ, **extra_env, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU"):
        env.pop(name, None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-6000:])
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs, once: (root, {'two': (output_dir, {rank: record}), 'one': ...})."""
    root = tmp_path_factory.mktemp("mp")
    out = {}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    for name, launcher, batch, extra, env in (
        ("two", torchrun, 4, [], {}),
        ("one", [sys.executable], 8, [], {}),
        # a memory target small enough that the planner splits micro-batches, and rank 1 planning
        # every example apart: the ranks plan different numbers of parts unless they agree
        ("split", torchrun, 4, ["--mem_target_gb", str(SPLIT_TARGET_GB), "--max_length", "40"],
         {"DEG_TEST_RANK1_SINGLES": "1"}),
    ):
        output_dir, records = root / name, root / f"{name}-records"
        _run([*launcher, str(WORKER), str(records), "dpo", *COMMON, "--per_device_train_batch_size", str(batch),
              "--output_dir", str(output_dir), *extra], **env)
        ranks = {}
        for path in sorted(records.glob("rank*.json")):
            record = json.loads(path.read_text())
            from safetensors.torch import load_file

            record["adapter"] = load_file(str(records / f"rank{record['rank']}.safetensors"))
            ranks[record["rank"]] = record
        out[name] = (output_dir, ranks)
    return root, out


@needs_torchrun
def test_two_processes_train_data_parallel(runs):
    _, out = runs
    _, ranks = out["two"]
    assert sorted(ranks) == [0, 1]
    for record in ranks.values():
        assert record["world_size"] == 2 and record["global_step"] == STEPS
        assert record["wrapper"] == "DistributedDataParallel"
        # DDP broadcasts and all-reduces the LoRA adapter only: the frozen base (streamed layers on
        # `meta`, resident embeddings and norm) and the buffers are ignored
        assert record["ddp_params"] == record["trainable"]
        assert record["trainable"] and all("lora_" in n for n in record["trainable"])
        assert record["ddp_buffers"] == []
    assert out["one"][1][0]["wrapper"] != "DistributedDataParallel"


@needs_torchrun
def test_gradients_match_one_process_on_the_doubled_batch(runs):
    _, out = runs
    two, one = out["two"][1], out["one"][1][0]["adapter"]
    rank0, rank1 = two[0]["adapter"], two[1]["adapter"]
    assert rank0.keys() == rank1.keys() == one.keys()
    for name in rank0:  # the ranks hold one adapter
        assert torch.equal(rank0[name], rank1[name]), name
    # LoRA B starts at zero: every one moved, so the comparison below compares gradients
    assert all(one[n].abs().max() > 0 for n in one if "lora_B" in n)
    assert max(one[n].abs().max() for n in one if "lora_B" in n) > 1e-2
    for name in one:
        torch.testing.assert_close(rank0[name], one[name], rtol=1e-5, atol=1e-7, msg=name)
    # what rank 0 saved is what it trained
    from safetensors.torch import load_file

    saved = load_file(str(out["two"][0] / "adapter_model.safetensors"))
    assert len(saved) == len(rank0)
    for name, value in saved.items():
        assert torch.equal(value, rank0[name.replace(".weight", ".default.weight")]), name


@needs_torchrun
def test_only_rank_zero_writes_one_checkpoint(runs):
    root, out = runs
    output_dir, ranks = out["two"]
    assert ranks[1]["writes"] == []  # no Python-level write from rank 1 under the output directory
    assert any(w.endswith("deg.json") for w in ranks[0]["writes"])
    # files rank 1 created (by any writer: Python, safetensors, torch) are group-writable (its umask);
    # the one such file is the Trainer's per-process RNG state, which a resumed run restores per rank.
    # (Directories are not counted: every rank runs the Trainer's makedirs(exist_ok=True) for the
    # checkpoint, and either may get there first; the directory listing is checked below.)
    by_rank1 = sorted(str(p.relative_to(output_dir)) for p in output_dir.rglob("*")
                      if p.is_file() and p.stat().st_mode & stat.S_IWGRP)
    assert by_rank1 == [f"checkpoint-{STEPS}/rng_state_1.pth"], by_rank1
    assert sorted(p.name for p in root.iterdir()) == ["one", "one-records", "split", "split-records", "two",
                                                      "two-records"]
    checkpoints = sorted(p.name for p in output_dir.iterdir() if p.is_dir())
    assert checkpoints == [f"checkpoint-{STEPS}"]

    from deg_hf.checkpoint import read_deg_json

    for directory in (output_dir, output_dir / checkpoints[0]):
        record = read_deg_json(directory)
        assert record["task"] == "dpo" and record["stream"]["enabled"] is True
        assert record["metrics"]["global_step"] == STEPS
        assert record["memory"]["totals"]["parts"] >= STEPS and record["memory"]["totals"]["oom_skip"] == 0
    log = [json.loads(line) for line in (output_dir / "train.log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in log if "loss" in row] == list(range(1, STEPS + 1))  # logged once, by rank 0


def test_streamed_build_on_an_indexed_cpu_device():
    """accelerate names a multi-process CPU run's device ``cpu:0``; the resident weights stay
    Parameters (the cause of 'model.embed_tokens.weight is neither a parameter, buffer, nor extra
    state' in tie_weights) and the tied LM head is the embedding."""
    from deg_hf import assets
    from deg_hf.streaming.build import build_streamed_model

    model, runtime = build_streamed_model(assets.tiny_model_path(), device=torch.device("cpu", 0), progress=False)
    try:
        assert runtime.device == torch.device("cpu")
        assert isinstance(model.model.embed_tokens.weight, torch.nn.Parameter)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    finally:
        runtime.close()


@needs_torchrun
def test_planned_splits_agree_across_processes(runs):
    """The ranks split their micro-batches into the same number of parts (TRL gathers metrics in
    every part, and DDP synchronises once, on the last part's backward): the run completes and the
    result is still the single process's on the doubled batch."""
    _, out = runs
    ranks, one = out["split"][1], out["one"][1][0]["adapter"]
    assert sorted(ranks) == [0, 1]
    parts = [ranks[r]["counters"]["parts"] for r in (0, 1)]
    assert parts[0] == parts[1] == 4 * STEPS  # rank 1's four singles; rank 0 split its plan to match
    assert ranks[0]["counters"]["oom_retry"] == 0
    for name in one:
        assert torch.equal(ranks[0]["adapter"][name], ranks[1]["adapter"][name]), name
        torch.testing.assert_close(ranks[0]["adapter"][name], one[name], rtol=1e-4, atol=1e-6, msg=name)
