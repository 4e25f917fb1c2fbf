"""Training-step time of a streamed model vs the same model resident."""

from __future__ import annotations

import tempfile
import time

from benches.common import lora_config, median_times, tiny_checkpoint, train_step


def run(quick: bool) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    layers, hidden, seq, batch = (4, 256, 128, 2) if quick else (8, 512, 256, 4)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = tiny_checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden)
    streamed, runtime = build_streamed_model(path, device=device, dtype=torch.float32 if device.type == "cpu" else None)
    streamed = get_peft_model(streamed, lora_config())
    materialize_adapters(streamed, device)
    dtype = next(p.dtype for p in streamed.parameters() if not p.is_meta and p.is_floating_point())
    resident = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device), lora_config())
    resident_ckpt = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device), lora_config())
    resident_ckpt.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (batch, seq), generator=gen).to(device)

    def step(model):
        return train_step(model, ids)

    runtime.reset_stats()
    times = median_times({"streamed": step(streamed), "resident_ckpt": step(resident_ckpt),
                           "resident": step(resident)}, repeats=2 if quick else 4)
    steps_run = (2 if quick else 4) + 1
    stats = runtime.stats()
    out = {
        "bench": "stream",
        "device": device.type,
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "dtype": str(dtype)},
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "ratio_vs_resident_ckpt": round(times["streamed"] / times["resident_ckpt"], 3),
        "ratio_vs_resident": round(times["streamed"] / times["resident"], 3),
        "loads_per_step": round(stats["loads"] / steps_run, 2),
        "fetches_per_step": round((stats["loads"] + stats["hits"]) / steps_run, 2),
        "n_layers": layers,
        "store_bytes": stats["store_bytes"],
        "buffer_bytes": stats["buffer_bytes"],
    }
    if device.type == "cuda":
        src = runtime.store.block(0)
        dst = runtime.buffers[0][: src.numel()]
        t0 = time.perf_counter()
        for _ in range(20):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out["h2d_gb_per_s"] = round(20 * src.numel() / (time.perf_counter() - t0) / 1e9, 2)
    runtime.close()
    return out
