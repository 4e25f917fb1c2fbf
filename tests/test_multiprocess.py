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
STEPS = 5
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


def _env(**extra_env) -> dict:
    env = dict(os.environ, **extra_env, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU",
                 "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "DEG_HF_SHARE_STORE"):
        env.pop(name, None)
    return env


def _run(cmd: list[str], check: bool = True, **extra_env) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(**extra_env), capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-6000:])
    return proc


def _two_nodes(cmd_tail: list[str], **extra_env) -> list[subprocess.CompletedProcess]:
    """Two torchrun "nodes" of one process each on this machine, meeting at a c10d rendezvous."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node),
         "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "deg-hf-two-nodes",
         *cmd_tail], cwd=REPO, env=_env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    done = [subprocess.CompletedProcess(p.args, 0, *p.communicate(timeout=300)) for p in procs]
    for p, result in zip(procs, done):
        result.returncode = p.returncode
        assert p.returncode == 0, (result.stdout[-2000:], result.stderr[-6000:])
    return done


def _records(records: Path) -> dict:
    from safetensors.torch import load_file

    ranks = {}
    for path in sorted(records.glob("rank*.json")):
        record = json.loads(path.read_text())
        record["adapter"] = load_file(str(records / f"rank{record['rank']}.safetensors"))
        ranks[record["rank"]] = record
    return ranks


@pytest.fixture(scope="module")
def shm(tmp_path_factory):
    """The shared-memory directory of this module's runs (DEG_HF_SHM_DIR): what they leave is seen."""
    import uuid

    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else tmp_path_factory.mktemp("shm")
    directory = base / f"deg-hf-mp-{uuid.uuid4().hex[:12]}"
    directory.mkdir()
    yield directory
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shm):
    """Every run, once: (root, {'two': (output_dir, {rank: record}), 'one': ...})."""
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
        # rank 1 raises inside its second step, after the store is shared
        ("raise", torchrun, 4, [], {"DEG_TEST_RANK1_RAISES_AT_STEP": "2"}),
        ("nodes", None, 4, [], {}),
    ):
        output_dir, records = root / name, root / f"{name}-records"
        tail = [str(WORKER), str(records), "dpo", *COMMON, "--per_device_train_batch_size", str(batch),
                "--output_dir", str(output_dir), *extra]
        env = {**env, "DEG_HF_SHM_DIR": str(shm)}
        if name == "nodes":
            procs = _two_nodes(tail, **env)
        else:
            procs = [_run([*launcher, *tail], check=name != "raise", **env)]
        out[name] = (output_dir, _records(records) if records.exists() else {}, procs,
                     sorted(p.name for p in shm.iterdir()))
    return root, out
@needs_torchrun
def test_two_processes_train_data_parallel(runs):
    _, out = runs
    _, ranks, *_ = out["two"]
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
    output_dir, ranks, *_ = out["two"]
    assert ranks[1]["writes"] == []  # no Python-level write from rank 1 under the output directory
    assert any(w.endswith("deg.json") for w in ranks[0]["writes"])
    # files rank 1 created (by any writer: Python, safetensors, torch) are group-writable (its umask);
    # the one such file is the Trainer's per-process RNG state, which a resumed run restores per rank.
    # (Directories are not counted: every rank runs the Trainer's makedirs(exist_ok=True) for the
    # checkpoint, and either may get there first; the directory listing is checked below.)
    by_rank1 = sorted(str(p.relative_to(output_dir)) for p in output_dir.rglob("*")
                      if p.is_file() and p.stat().st_mode & stat.S_IWGRP)
    assert by_rank1 == [f"checkpoint-{STEPS}/rng_state_1.pth"], by_rank1
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith("raise")) == [
        "nodes", "nodes-records", "one", "one-records", "split", "split-records", "two", "two-records"]
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


@needs_torchrun
def test_the_local_ranks_share_one_store(runs):
    """Both ranks of a node stream from one store: rank 0 built it in shared memory, rank 1 mapped it
    (tests/test_shared_store.py measures the memory); deg.json says so; no file is left behind."""
    _, out = runs
    output_dir, ranks, _, left = out["two"]
    assert ranks[0]["share"]["role"] == "built" and ranks[1]["share"]["role"] == "attached"
    assert ranks[0]["stores_constructed"] == ranks[1]["stores_constructed"] == 1  # rank 1's maps rank 0's
    assert ranks[0]["share"]["segment"] == ranks[1]["share"]["segment"]
    assert all(ranks[r]["share"]["shared"] and ranks[r]["share"]["ranks"] == 2 for r in (0, 1))
    assert ranks[0]["share"]["bytes"] > 0
    from deg_hf.checkpoint import read_deg_json

    recorded = read_deg_json(output_dir)["stream"]["store_shared"]
    assert recorded["shared"] is True and recorded["ranks"] == 2 and recorded["role"] == "built"
    assert left == []  # nothing named in shared memory after the run
    # the result is the single process's on the doubled batch (also asserted bit for bit above)
    one = out["one"][1][0]
    assert one["share"] == {"shared": False, "ranks": 1}


@needs_torchrun
def test_a_rank_that_raises_mid_step_stops_both_and_leaves_no_store(runs):
    _, out = runs
    _, ranks, (proc,), left = out["raise"]
    assert proc.returncode != 0
    assert "rank 1 fails in step 2 (test)" in proc.stderr
    assert ranks == {}  # neither rank finished: rank 0 was stopped by torchrun while waiting on rank 1
    # torchrun's report: rank 1 failed (exit code 1), rank 0 was terminated (SIGTERM), both non-zero
    import re

    codes = dict(re.findall(r"rank\s*:\s*(\d) \(local_rank: \d\)\s*\n\s*exitcode\s*:\s*(-?\d+)", proc.stderr))
    assert sorted(codes) == ["0", "1"] and all(int(c) != 0 for c in codes.values()), proc.stderr[-3000:]
    assert left == []  # the shared store's name went at setup; its memory went with the processes


@needs_torchrun
def test_two_nodes_each_build_their_store_and_match_one_process(runs):
    """``--nnodes 2`` with one process per node (c10d rendezvous on this machine): each node builds its
    own store (one rank per node: nothing to share) and the run is the single process's on the
    doubled batch."""
    _, out = runs
    _, ranks, procs, left = out["nodes"]
    assert sorted(ranks) == [0, 1] and len(procs) == 2
    one = out["one"][1][0]["adapter"]
    for r in (0, 1):
        assert ranks[r]["world_size"] == 2 and ranks[r]["global_step"] == STEPS
        assert ranks[r]["wrapper"] == "DistributedDataParallel"
        assert ranks[r]["share"] == {"shared": False, "ranks": 1}  # its own store, built once on its node
        assert ranks[r]["stores_constructed"] == 1
    for name in one:
        assert torch.equal(ranks[0]["adapter"][name], ranks[1]["adapter"][name]), name
        torch.testing.assert_close(ranks[0]["adapter"][name], one[name], rtol=1e-5, atol=1e-7, msg=name)
    assert left == []
