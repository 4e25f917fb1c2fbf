"""The reference forward's cost: fetches and step time of DPO and KTO vs SFT."""

from __future__ import annotations

import tempfile

from benches.common import lora_config, median_times, tiny_checkpoint


def run(quick: bool) -> dict:
    import torch
    from datasets import Dataset
    from harness import kto_rows, pref_rows, sft_rows, trainer_kwargs
    from transformers import AutoTokenizer

    import deg_hf

    layers, hidden = (4, 128) if quick else (6, 256)
    path = tiny_checkpoint(tempfile.mkdtemp(), layers=layers, hidden=hidden, vocab=512)
    tok = AutoTokenizer.from_pretrained(path)
    tasks = {
        "sft": ("StreamedSFTTrainer", "StreamedSFTConfig", sft_rows),
        "dpo": ("StreamedDPOTrainer", "StreamedDPOConfig", pref_rows),
        "kto": ("StreamedKTOTrainer", "StreamedKTOConfig", kto_rows),
    }
    trainers, steps = {}, {}
    for stream in (True, False):
        for task, (t_name, c_name, rows) in tasks.items():
            args = getattr(deg_hf, c_name)(**trainer_kwargs(tempfile.mkdtemp(), max_length=64, stream_layers=stream,
                                                           per_device_train_batch_size=8))
            tr = getattr(deg_hf, t_name)(model=path, args=args, train_dataset=Dataset.from_list(rows(16)),
                                         processing_class=tok, peft_config=lora_config())
            tr.create_optimizer_and_scheduler(num_training_steps=10)
            tr.current_gradient_accumulation_steps = 1
            batch = next(iter(tr.get_train_dataloader()))
            key = f"{task}_{'streamed' if stream else 'resident'}"
            trainers[key] = tr

            def step(tr=tr, batch=batch):
                tr.training_step(tr.model, batch)
                tr.model.zero_grad(set_to_none=True)

            steps[key] = step
    fetches = {}
    for task in tasks:
        runtime = trainers[f"{task}_streamed"].stream_runtime
        runtime.reset_stats()
        steps[f"{task}_streamed"]()
        fetches[task] = runtime.loads + runtime.hits
    times = median_times(steps, repeats=2 if quick else 4)
    return {
        "bench": "reference",
        "n_layers": layers,
        "fetches_per_step": fetches,
        "fetch_ratio_dpo_vs_sft": round(fetches["dpo"] / fetches["sft"], 3),
        "fetch_ratio_kto_vs_sft": round(fetches["kto"] / fetches["sft"], 3),
        "step_s": {k: round(v, 4) for k, v in times.items()},
        "time_ratio_dpo_vs_sft_streamed": round(times["dpo_streamed"] / times["sft_streamed"], 3),
        "time_ratio_dpo_vs_sft_resident": round(times["dpo_resident"] / times["sft_resident"], 3),
        "time_ratio_kto_vs_sft_streamed": round(times["kto_streamed"] / times["sft_streamed"], 3),
        "time_ratio_kto_vs_sft_resident": round(times["kto_resident"] / times["sft_resident"], 3),
        "torch_threads": torch.get_num_threads(),
    }
