"""Host memory per node with 1 and 2 local ranks, and rank 1's readiness after rank 0 publishes."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from benches.common import tiny_checkpoint


def run(quick: bool) -> dict:
    """Local ranks as torchrun starts them (LOCAL_RANK, LOCAL_WORLD_SIZE, one MASTER_PORT per run),
    each building the streamed model as a trainer does (tests/shared_worker.py), measured once every
    rank of the run holds its store: the store's PSS (``/proc/<pid>/smaps``, the mapping's share) and
    the whole process's (``smaps_rollup``), summed over the node's ranks."""
    import subprocess

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "shared_worker.py")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(worker)))
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        # hidden 2048: one layer is 46M parameters, 176 MiB at fp32
        ckpt = tiny_checkpoint(os.path.join(tmp, "ckpt"), layers=1 if quick else 6, hidden=1024 if quick else 2048)

        def node(name, world, share=True):
            out = os.path.join(tmp, name)
            env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1", DEG_HF_SHM_DIR=shm, LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(abs(hash(name)) % 50000), TORCHELASTIC_RUN_ID=name,
                       DEG_HF_SHARE_STORE="1" if share else "0")
            procs = [subprocess.Popen([sys.executable, worker, ckpt, out], env={**env, "LOCAL_RANK": str(r)},
                                      stderr=subprocess.PIPE, text=True) for r in range(world)]
            for p in procs:
                err = p.communicate(timeout=1200)[1]
                if p.returncode:
                    raise RuntimeError(err[-3000:])
            return [json.load(open(os.path.join(out, f"rank{r}.json"), encoding="utf-8")) for r in range(world)]

        one, two, own = node("one", 1), node("two", 2), node("own", 2, share=False)
    store = one[0]["bytes"]

    def total(records, key):
        return sum(r[key] for r in records)

    return {
        "bench": "ranks",
        "store_bytes": store,
        "store_pss_1_rank": total(one, "pss"),
        "store_pss_2_ranks_shared": total(two, "pss"),
        "store_pss_2_ranks_own": total(own, "pss"),
        "store_ratio_2_over_1_shared": round(total(two, "pss") / total(one, "pss"), 3),
        "store_ratio_2_over_1_own": round(total(own, "pss") / total(one, "pss"), 3),
        "node_pss_1_rank": total(one, "process_pss"),
        "node_pss_2_ranks_shared": total(two, "process_pss"),
        "node_pss_2_ranks_own": total(own, "process_pss"),
        "node_ratio_2_over_1_shared": round(total(two, "process_pss") / total(one, "process_pss"), 3),
        "roles": [r["share"].get("role") for r in two],
        "build_s": round(two[0]["built_s"], 3),
        "rank1_ready_after_publish_s": round(two[1]["store_ready_at"] - two[0]["store_ready_at"], 4),
    }
