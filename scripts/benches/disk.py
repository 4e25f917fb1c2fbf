"""The disk tier: step time from RAM, disk and both, and the loader against a plain cold read."""

from __future__ import annotations

import os
import tempfile
import time

from benches.common import lora_config, median_times, tiny_checkpoint, train_step


def _plain_read_gb_per_s(paths: list[str]) -> float:
    """The drive's limit for these files: one cold-cache sequential read of each, straight into a
    buffer (no loader, no compute)."""
    import torch

    from deg_hf.streaming.cache import drop_page_cache, read_file_into
    from deg_hf.streaming.sources import bytes_of

    buf = torch.empty(max(os.path.getsize(p) for p in paths), dtype=torch.uint8)
    total, elapsed = 0, 0.0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            drop_page_cache(fd)
            size = os.path.getsize(path)
            t0 = time.perf_counter()
            read_file_into(fd, bytes_of(buf)[:size], path)
            elapsed += time.perf_counter() - t0
            total += size
        finally:
            os.close(fd)
    return total / elapsed / 1e9


def _loader_alone_gb_per_s(disk, paths: list[str]) -> float:
    """One cold sweep of every disk layer through the loader (acquire, release, the next two read
    ahead), nothing else running: bytes over wall time."""
    from deg_hf.streaming.cache import drop_page_cache

    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            drop_page_cache(fd)
        finally:
            os.close(fd)
    order = sorted(disk.layers)
    t0 = time.perf_counter()
    for k, i in enumerate(order):
        disk.acquire(i, order[k + 1 : k + 3])
        disk.release(i)
    return sum(disk.sizes.values()) / (time.perf_counter() - t0) / 1e9


def run(quick: bool) -> dict:
    """Training steps with the store in RAM, on disk, and half and half (cold cache: the loader drops
    the pages behind each read), and a plain cold read of the same cache files. The shape is chosen so
    a layer's compute takes longer than its read, where the loader can hide the disk entirely."""
    import torch
    from peft import get_peft_model

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    layers, hidden, seq, batch = (4, 512, 256, 2) if quick else (8, 1024, 512, 2)
    path = tiny_checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden)
    cache = tempfile.mkdtemp()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (batch, seq), generator=gen)
    arms, runtimes = {}, {}
    layer_bytes = None
    for name in ("ram", "disk", "mixed"):
        kwargs = {"tier": "ram"} if name == "ram" else {"tier": "disk"} if name == "disk" else \
            {"tier": "auto", "host_mem_gb": layer_bytes * (layers // 2) / 2**30}
        model, runtime = build_streamed_model(path, device="cpu", dtype=torch.float32, cache_dir=cache,
                                              progress=False, **kwargs)
        layer_bytes = runtime.store.max_layer_bytes
        model = get_peft_model(model, lora_config())
        materialize_adapters(model, "cpu")

        arms[name], runtimes[name] = train_step(model, ids), runtime
    for runtime in runtimes.values():
        runtime.reset_stats()
    repeats = 2 if quick else 4
    times = median_times(arms, repeats)
    files = [runtimes["disk"].store.cache.layer_path(i) for i in range(layers)]
    disk = runtimes["disk"].stats()["tiers"]["disk"]
    alone = _loader_alone_gb_per_s(runtimes["disk"].store.disk, files)
    plain = _plain_read_gb_per_s(files)
    mixed = runtimes["mixed"].stats()["tiers"]
    steps = repeats + 1
    per_layer_read_s = disk["read_s"] / max(disk["reads"], 1)
    out = {
        "bench": "disk",
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "dtype": "float32",
                  "layer_mib": round(layer_bytes / 2**20, 1)},
        "plain_read_gb_per_s": round(plain, 3),
        "loader_read_gb_per_s": disk["read_gb_per_s"],
        "loader_share_of_plain": round(disk["read_gb_per_s"] / plain, 3),
        # the loader with nothing computing beside it: its own cost, apart from sharing the cores
        "loader_alone_gb_per_s": round(alone, 3),
        "loader_alone_share_of_plain": round(alone / plain, 3),
        "disk_bytes_per_step": int(disk["bytes_read"] / steps),
        "loader_wait_s_per_step": round(disk["wait_s"] / steps, 4),
        "read_s_per_layer": round(per_layer_read_s, 4),
        "compute_s_per_layer_ram": round(times["ram"] / (4 * layers), 4),  # forward, recompute, two backward matmuls
        "mixed_placement": mixed["placement"],
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "disk_vs_ram": round(times["disk"] / times["ram"], 3),
        "mixed_vs_ram": round(times["mixed"] / times["ram"], 3),
    }
    for runtime in runtimes.values():
        runtime.close()
    return out
