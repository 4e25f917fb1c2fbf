"""One layer store per node, shared by its local ranks (deg_hf.streaming.shared), without a launcher.

Each process is tests/shared_worker.py with torchrun's environment (LOCAL_RANK, LOCAL_WORLD_SIZE, a
MASTER_PORT naming the run), building the streamed model as a trainer does. The store is an 18 MiB
Llama (two layers of hidden size 512), large enough for its proportional set size to be measured
apart from the rest of the process. DEG_HF_SHM_DIR points every run at its own directory, so the
tests see exactly the files a run leaves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import requires_cuda

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "shared_worker.py"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from harness import write_checkpoint

    return write_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "llama"), "llama", n_layers=2, hidden=512)


@pytest.fixture
def shm(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    directory = Path(base) / f"deg-hf-test-{uuid.uuid4().hex[:12]}"
    directory.mkdir()
    yield directory
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()


def _env(shm, rank, world=2, port="29555", **extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DEG_HF_SHM_DIR=str(shm),
               LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
               TORCHELASTIC_RUN_ID="test", **extra)
    env.pop("DEG_HF_SHARE_STORE", None)
    env.update(extra)
    return env


def _start(checkpoint, out, shm, rank, *mode, **extra):
    return subprocess.Popen([sys.executable, str(WORKER), checkpoint, str(out), *mode], cwd=REPO,
                            env=_env(shm, rank, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _node(checkpoint, out, shm, **extra):
    """Both local ranks of one run; their records and stderr."""
    procs = [_start(checkpoint, out, shm, r, **extra) for r in (0, 1)]
    results = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-4000:]
    records = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    return records, [err for _, err in results]


def test_local_ranks_map_one_store(checkpoint, shm, tmp_path):
    shared, _ = _node(checkpoint, tmp_path / "shared", shm)
    own, _ = _node(checkpoint, tmp_path / "own", shm, DEG_HF_SHARE_STORE="0")
    store = shared[0]["bytes"]
    assert store > 16 * 2**20
    # built once on the node: rank 0 built, rank 1 mapped what it built
    assert [shared[r]["share"]["role"] for r in (0, 1)] == ["built", "attached"]
    assert all(shared[r]["share"]["shared"] and shared[r]["share"]["ranks"] == 2 for r in (0, 1))
    assert shared[0]["share"]["segment"] == shared[1]["share"]["segment"]
    # every rank reads the same bytes, and they are the bytes of a store built alone
    assert shared[0]["digest"] == shared[1]["digest"] == own[0]["digest"] == own[1]["digest"]
    # proportional set size summed over the ranks: one store, every page counted (rank 1 read them all)
    pss = shared[0]["pss"] + shared[1]["pss"]
    assert 0.95 * store <= pss <= 1.1 * store, (pss, store)
    assert abs(shared[0]["pss"] - shared[1]["pss"]) <= 0.05 * store
    # control: without sharing each rank holds its own copy
    assert [own[r]["share"] for r in (0, 1)] == [{"shared": False, "ranks": 1}] * 2
    pss_own = own[0]["pss"] + own[1]["pss"]
    assert pss_own >= 1.8 * store, (pss_own, store)
    # nothing named is left in shared memory once both ranks have mapped it
    assert list(shm.iterdir()) == []


def test_a_4bit_store_split_between_ram_and_disk_is_shared(checkpoint, shm, tmp_path):
    """NF4 blocks and the disk tier: the builder quantizes and writes the cache; the other rank maps
    the RAM layer and reads the disk layer from the builder's cache. Every layer computes with the
    same weights on both ranks and as in a store built alone."""
    import hashlib

    import torch

    from deg_hf.streaming.build import build_streamed_model
    from deg_hf.streaming.quant import QuantSpec

    budget_gb = 1.5 / 1024  # one 4-bit layer (~1.2 MiB) fits, two do not
    env = {"DEG_TEST_QUANT": "nf4", "DEG_TEST_TIER": "auto", "DEG_TEST_HOST_MEM_GB": str(budget_gb),
           "DEG_TEST_CACHE_DIR": str(tmp_path / "cache")}
    shared, _ = _node(checkpoint, tmp_path / "shared", shm, **env)
    for r in (0, 1):
        assert shared[r]["quantized"] and shared[r]["placement"] == ["ram", "disk"]
    assert [shared[r]["share"]["role"] for r in (0, 1)] == ["built", "attached"]
    assert shared[0]["share"]["bytes"] == shared[0]["bytes"] < 1.5 * 2**20  # only the RAM layer is shared
    assert list(shm.iterdir()) == []
    # a store built alone, in this process (no launcher: nothing shared), all in RAM
    _, alone = build_streamed_model(checkpoint, device="cpu", progress=False, tier="ram", quantization=QuantSpec("nf4"))
    try:
        assert alone.store.share_stats() == {"shared": False, "ranks": 1}
        fetched = hashlib.sha256()
        for i in range(alone.store.n_layers):
            for name, tensor in sorted(alone.fetch(i).items()):
                fetched.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
    finally:
        alone.close()
    assert shared[0]["fetched"] == shared[1]["fetched"] == fetched.hexdigest()


def test_a_killed_run_leaves_a_store_the_next_run_replaces(checkpoint, shm, tmp_path):
    # rank 0 alone publishes the store and waits for rank 1 to map it: killed there, the file stays
    lone = _start(checkpoint, tmp_path / "killed", shm, 0)
    name = shm / "deg-hf-store-"
    deadline = time.monotonic() + 120
    while not [p for p in shm.iterdir() if p.name.startswith(name.name) and "." not in p.name]:
        assert lone.poll() is None and time.monotonic() < deadline, lone.stderr.read()[-3000:]
        time.sleep(0.05)
    lone.send_signal(signal.SIGKILL)
    lone.wait()
    (left,) = [p for p in shm.iterdir() if "." not in p.name]
    from deg_hf.streaming.shared import owner_alive, read_owner

    killed_owner = read_owner(str(left))
    assert killed_owner["pid"] == lone.pid and owner_alive(killed_owner) is False
    # the next run of the same identity: rank 1 does not read the dead run's file, rank 0 replaces it
    records, errs = _node(checkpoint, tmp_path / "next", shm)
    assert [records[r]["share"]["role"] for r in (0, 1)] == ["built", "attached"]
    assert "left by runs that no longer run" in errs[0] and str(left) in errs[0]
    assert records[0]["digest"] == records[1]["digest"]
    assert list(shm.iterdir()) == []


def test_the_builders_failure_reaches_the_other_ranks(checkpoint, shm, tmp_path):
    procs = [_start(checkpoint, tmp_path / "out", shm, r, DEG_TEST_BUILDER_HOST_MEM_GB="0.001") for r in (0, 1)]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] != [0, 0]
    assert procs[0].returncode != 0 and "stream_tier='ram' allows" in errs[0]
    # rank 1 did not wait out its timeout: it raised rank 0's reason
    assert procs[1].returncode != 0
    assert "local rank 0 failed to build the node's shared layer store" in errs[1]
    assert "stream_tier='ram' allows" in errs[1]
    assert not [p for p in shm.iterdir() if not p.name.endswith(".error")]


def test_a_rank_without_its_builder_times_out_naming_the_problem(checkpoint, shm, tmp_path):
    proc = _start(checkpoint, tmp_path / "out", shm, 1, DEG_HF_SHARE_TIMEOUT="1")
    _, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "waited 1 s for local rank 0 to build the node's shared layer store" in err
    assert "DEG_HF_SHARE_TIMEOUT" in err and "stream_share_store=False" in err


def test_node_ranks_from_the_launchers_environment(monkeypatch):
    from deg_hf.streaming.shared import node_ranks

    monkeypatch.delenv("DEG_HF_SHARE_STORE", raising=False)
    base = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "a"}
    ranks = node_ranks(base)
    assert ranks.local_rank == 1 and ranks.local_world_size == 2 and not ranks.builder
    # the run's identity names the file: another node or another run is another store
    assert node_ranks({**base, "GROUP_RANK": "1"}).run != ranks.run
    assert node_ranks({**base, "MASTER_PORT": "2"}).run != ranks.run
    assert node_ranks({**base, "LOCAL_RANK": "0"}).run == ranks.run
    assert node_ranks({**base, "LOCAL_WORLD_SIZE": "1"}) is None  # one process on the node: nothing to share
    assert node_ranks({}) is None  # not launched by torchrun / accelerate
    monkeypatch.setenv("DEG_HF_SHARE_STORE", "0")
    assert node_ranks(base) is None


def _segment_pair(shm, monkeypatch, nbytes=1 << 16):
    """A builder's segment filled and published, and a second rank's read-only mapping of it (one process)."""
    import torch

    from deg_hf.streaming.shared import NodeRanks, SharedSegment, SharedStoreError

    monkeypatch.setenv("DEG_HF_SHM_DIR", str(shm))
    builder, other = NodeRanks(0, 2, 0, "t" * 16), NodeRanks(1, 2, 0, "t" * 16)
    segment = SharedSegment.create(builder, "key", {0: 0}, nbytes, {})
    segment.data.copy_(torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8))
    # while it is being written the file has another name: never read half-written
    (building,) = shm.iterdir()
    assert building.name.startswith("deg-hf-store-" + "t" * 16 + "-") and building.name.endswith(".building")
    with pytest.raises(SharedStoreError, match="waited 0 s for local rank 0"):
        SharedSegment.attach(other, "key", timeout=0.2)
    segment.publish()
    with pytest.raises(SharedStoreError, match="waited 0 s"):  # another store is another file
        SharedSegment.attach(other, "another key", timeout=0.2)
    mapped = SharedSegment.attach(other, "key", timeout=5)
    return segment, mapped


def test_a_segment_is_read_only_and_outlives_its_name(shm, monkeypatch):
    import torch

    segment, mapped = _segment_pair(shm, monkeypatch)
    assert torch.equal(mapped.data, segment.data) and mapped.data.data_ptr() != segment.data.data_ptr()
    with pytest.raises(TypeError, match="readonly"):  # both mappings are read-only once published
        mapped._mm[0] = 1
    with pytest.raises(TypeError, match="readonly"):
        segment._mm[0] = 1
    segment.wait_for_ranks(timeout=5)  # rank 1 has attached: the name goes
    assert list(shm.iterdir()) == []
    assert int(mapped.data[1000]) == 1000 % 251  # the memory lives while mapped
    mapped.close()
    segment.close()


@pytest.mark.cuda
@requires_cuda
def test_the_shared_pages_are_pinned_for_asynchronous_copies(shm, monkeypatch):
    import torch

    segment, mapped = _segment_pair(shm, monkeypatch, nbytes=64 << 20)
    try:
        assert mapped.pin() and mapped.pinned and mapped.data.is_pinned()
        assert segment.pin() and segment.data.is_pinned()
        device = torch.empty_like(mapped.data, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            device.copy_(mapped.data, non_blocking=True)
        stream.synchronize()
        assert torch.equal(device.cpu(), segment.data)
        segment.wait_for_ranks(timeout=5)
    finally:
        mapped.close()  # unregisters
        segment.close()
    assert not mapped.pinned


def test_stream_share_store_false_builds_this_ranks_own_store(monkeypatch, tmp_path):
    """Under a launcher's environment (local rank 1 of 2) the setting turns sharing off: the store is
    built here at once, with nobody to wait for; a value that is not a flag is refused by name."""
    from deg_hf import assets
    from deg_hf.config import SettingError, StreamConfig
    from deg_hf.streaming.build import build_streamed_model

    monkeypatch.delenv("DEG_HF_SHARE_STORE", raising=False)
    for name, value in {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1", "DEG_HF_SHM_DIR": str(tmp_path),
                        "DEG_HF_SHARE_TIMEOUT": "0.5"}.items():
        monkeypatch.setenv(name, value)
    _, runtime = build_streamed_model(assets.tiny_model_path(), device="cpu", progress=False, share_store=False)
    try:
        assert runtime.stats()["store_shared"] == {"shared": False, "ranks": 1}
    finally:
        runtime.close()
    # the control: shared, rank 1 waits for a builder that never comes and says so
    from deg_hf.streaming.shared import SharedStoreError

    with pytest.raises(SharedStoreError, match="waited 0 s for local rank 0"):
        build_streamed_model(assets.tiny_model_path(), device="cpu", progress=False)
    with pytest.raises(SettingError, match="stream_share_store"):
        StreamConfig(stream_share_store="sometimes")
