"""One local rank of a node sharing its layer store, without a process group (tests/test_shared_store.py).

    LOCAL_RANK=r LOCAL_WORLD_SIZE=n MASTER_PORT=... python tests/shared_worker.py CHECKPOINT OUT_DIR [hold]

Builds the streamed model as a trainer would, reads every block once, and, once every rank of the
run has got this far (files OUT_DIR/ready-<r>), measures the proportional set size of its store and
writes OUT_DIR/rank<r>.json. With ``hold`` it then sleeps (the test kills it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time


def wait_for(paths, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited for {paths}")
        time.sleep(0.01)


def main() -> None:
    checkpoint, out, *mode = sys.argv[1:]
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    import torch

    from deg_hf.streaming.build import build_streamed_model
    from deg_hf.streaming.shared import store_pss_bytes

    t0 = time.perf_counter()
    from deg_hf.streaming.quant import QuantSpec

    budget = os.environ.get("DEG_TEST_BUILDER_HOST_MEM_GB") if rank == 0 else None  # only the builder refuses
    budget = budget or os.environ.get("DEG_TEST_HOST_MEM_GB")
    quant = os.environ.get("DEG_TEST_QUANT")
    _, runtime = build_streamed_model(
        checkpoint, device=torch.device("cpu"), progress=False, tier=os.environ.get("DEG_TEST_TIER", "ram"),
        host_mem_gb=float(budget) if budget else None, cache_dir=os.environ.get("DEG_TEST_CACHE_DIR"),
        quantization=QuantSpec(quant) if quant else None)
    built_s = time.perf_counter() - t0
    store = runtime.store
    digest = hashlib.sha256()
    for block in store.flat:
        if block is not None:
            digest.update(block.numpy().tobytes())
    # what the layers compute with: every layer fetched (RAM or disk; 4-bit ones dequantized)
    fetched = hashlib.sha256()
    for i in range(store.n_layers):
        for name, tensor in sorted(runtime.fetch(i).items()):
            fetched.update(name.encode() + tensor.contiguous().view(torch.uint8).numpy().tobytes())
    if "hold" in mode:
        time.sleep(3600)
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, f"ready-{rank}"), "w").close()
    wait_for([os.path.join(out, f"ready-{r}") for r in range(world)])
    with open("/proc/self/smaps_rollup", encoding="ascii") as fh:
        process_pss = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("Pss:"))
    record = {"rank": rank, "share": store.share_stats(), "pss": store_pss_bytes(store), "bytes": store.ram_bytes,
              "process_pss": process_pss, "store_ready_at": store.shared.ready_at if store.shared else None,
              "digest": digest.hexdigest(), "fetched": fetched.hexdigest(),
              "placement": store.placement, "quantized": store.quantized, "built_s": built_s, "ready_at": time.time()}
    open(os.path.join(out, f"measured-{rank}"), "w").close()
    wait_for([os.path.join(out, f"measured-{r}") for r in range(world)])  # nobody unmaps while another measures
    runtime.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main()
