"""The tensor meter's cost on a training step."""

from __future__ import annotations

import tempfile

from benches.common import lora_config, median_times, tiny_checkpoint


def run(quick: bool) -> dict:
    """A streamed SFT training step with the tensor meter measuring (what a CPU target costs) and
    without it, interleaved; two model sizes, since the meter costs per operation, not per byte."""
    from datasets import Dataset
    from harness import sft_rows, trainer_kwargs
    from transformers import AutoTokenizer

    import deg_hf
    from deg_hf.memory.meter import DeviceMemory

    out = {"bench": "meter", "sizes": {}}
    for layers, hidden, max_length in ((2, 64, 64), (4, 256, 256)) if not quick else ((2, 64, 64),):
        path = tiny_checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden, vocab=512)
        tok = AutoTokenizer.from_pretrained(path)
        rows = [{"messages": [m[0], {"role": "assistant", "content": " ".join([m[1]["content"]] * (max_length // 8))}]}
                for m in (r["messages"] for r in sft_rows(8))]
        tr = deg_hf.StreamedSFTTrainer(
            model=path, args=deg_hf.StreamedSFTConfig(**trainer_kwargs(tempfile.mkdtemp(), max_length=max_length,
                                                                       per_device_train_batch_size=4)),
            train_dataset=Dataset.from_list(rows), processing_class=tok, peft_config=lora_config())
        tr.create_optimizer_and_scheduler(num_training_steps=10)
        tr.current_gradient_accumulation_steps = 1
        batch = next(iter(tr.get_train_dataloader()))
        off = DeviceMemory("cpu", resident=tr._deg_resident_tensors)
        on = DeviceMemory("cpu", resident=tr._deg_resident_tensors, measure=True)

        def step(memory, tr=tr, batch=batch):
            def run():
                tr.deg_memory = memory
                tr.training_step(tr.model, batch)
                tr.model.zero_grad(set_to_none=True)
            return run

        times = median_times({"off": step(off), "metered": step(on)}, repeats=3 if quick else 7)
        ops = on.meter.allocations
        out["sizes"][f"{layers}x{hidden}x{max_length}"] = {
            "step_s": {k: round(v, 4) for k, v in times.items()},
            "overhead": round(times["metered"] / times["off"] - 1, 3),
            "storages_counted_per_step": ops // ((3 if quick else 7) + 1),
        }
        tr.release_stream()
    return out
