"""NF4 vs 16-bit streaming: store bytes, bytes moved, step time, the dequantization share."""

from __future__ import annotations

import tempfile

from benches.common import lora_config, median_times, tiny_checkpoint, train_step


def run(quick: bool) -> dict:
    """NF4 vs 16-bit streaming of one checkpoint: store bytes and bytes moved per training step (NF4 vs
    bf16), step time, and the share of the NF4 step spent dequantizing. Timed at bf16 on CUDA; on CPU,
    where bf16 matmuls have no fast kernel here (13x slower than fp32), timed at fp32 (NF4 dequantized
    to fp32 vs an fp32 store), and bitsandbytes' host dequantization is not the GPU's."""
    import torch
    from peft import get_peft_model

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters
    from deg_hf.streaming.quant import QuantSpec

    layers, hidden, seq, batch = (2, 256, 64, 2) if quick else (4, 512, 128, 2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timed_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = tiny_checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 1000, (batch, seq), generator=gen).to(device)
    nf4 = QuantSpec("nf4", 64, True)

    def arm(dtype, spec):
        model, runtime = build_streamed_model(path, device=device, dtype=dtype, quantization=spec, progress=False)
        model = get_peft_model(model, lora_config())
        materialize_adapters(model, device)

        return train_step(model, ids), runtime

    # bytes: one bf16 training step with each store
    moved, store = {}, {}
    for name, spec in (("bf16", None), ("nf4", nf4)):
        run, runtime = arm(torch.bfloat16, spec)
        runtime.reset_stats()
        run()
        moved[name], store[name] = runtime.stats()["bytes_moved"], runtime.stats()["store_bytes"]
        runtime.close()
    # time: the training dtype, arms interleaved
    runs, runtimes = {}, {}
    for name, spec in (("16bit" if device.type == "cuda" else "fp32", None), ("nf4", nf4)):
        runs[name], runtimes[name] = arm(timed_dtype, spec)
    repeats = 2 if quick else 5
    for runtime in runtimes.values():
        runtime.reset_stats()
    times = median_times(runs, repeats)
    nf4_stats = runtimes["nf4"].stats()
    plain = next(n for n in runs if n != "nf4")
    out = {
        "bench": "quant",
        "device": device.type,
        "model": {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch},
        "store_bytes": store,
        "store_ratio_nf4_bf16": round(store["nf4"] / store["bf16"], 4),
        "bytes_moved_per_step": moved,
        "moved_ratio_nf4_bf16": round(moved["nf4"] / moved["bf16"], 4),
        "timed_dtype": str(timed_dtype).replace("torch.", ""),
        "step_s": {name: round(t, 4) for name, t in times.items()},
        "step_ratio_nf4_vs_unquantized": round(times["nf4"] / times[plain], 3),
        "dequantize_share": round(nf4_stats["dequantize_s"] / (repeats + 1) / times["nf4"], 4),
    }
    for runtime in runtimes.values():
        runtime.close()
    return out
