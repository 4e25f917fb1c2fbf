"""FSDP2, resident, on CPU: the DPO trainer with ``stream_layers=False`` on a model sharded by torch's
``fully_shard`` over two gloo processes equals one unsharded process on the doubled batch.

accelerate does not run FSDP on CPU (``use_cpu`` makes its state MULTI_CPU, whatever the FSDP
settings say), so tests/fsdp_worker.py shards the trainer's model with ``fully_shard`` itself; see
its docstring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "fsdp_worker.py"


def _fsdp2_available() -> bool:
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from harness import write_checkpoint

    root = tmp_path_factory.mktemp("fsdp")
    ckpt = write_checkpoint(str(root / "ckpt"), "llama", n_layers=2, hidden=32)
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    out = {}
    for name, launcher in (("two", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]),
                           ("one", [sys.executable])):
        proc = subprocess.run([*launcher, str(WORKER), ckpt, str(root / name)], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-6000:]
        from safetensors.torch import load_file

        out[name] = {}
        for path in sorted((root / name).glob("rank*.json")):
            record = json.loads(path.read_text())
            record["adapter"] = load_file(str(path.with_suffix(".safetensors")))
            out[name][record["rank"]] = record
    return out


@pytest.mark.skipif(not _fsdp2_available(), reason="torch FSDP2 / gloo not available")
def test_fsdp2_resident_equals_one_process_on_the_doubled_batch(runs):
    two, one = runs["two"], runs["one"][0]
    assert sorted(two) == [0, 1]
    for record in two.values():
        # the model was sharded: every parameter a DTensor of the 2-process mesh, the wrapper FSDP2's
        assert record["n_sharded"] > 0 and record["wrapper"].startswith("FSDP") and not record["streamed"]
    assert one["n_sharded"] == 0 and not one["wrapper"].startswith("FSDP")
    # DPO's loss is a mean over pairs: the mean of the ranks' losses is the doubled batch's
    for step, (a, b, single) in enumerate(zip(two[0]["losses"], two[1]["losses"], one["losses"]), 1):
        assert (a + b) / 2 == pytest.approx(single, rel=1e-5, abs=1e-7), step
    assert len(one["losses"]) == 5 and two[0]["losses"] != two[1]["losses"]  # the ranks saw different pairs
    adapter, single = two[0]["adapter"], one["adapter"]
    assert adapter.keys() == single.keys() == two[1]["adapter"].keys()
    assert max(single[n].abs().max() for n in single if "lora_B" in n) > 1e-3  # LoRA B moved from zero
    diff = {n: (adapter[n] - single[n]).norm() for n in single}
    total = torch.stack([single[n].norm() for n in single]).norm()
    for name in single:
        assert torch.equal(adapter[name], two[1]["adapter"][name]), name  # one adapter, gathered on both ranks
        assert diff[name] <= 1e-4 * single[name].norm() + 1e-6 * total, name
