"""The resident DPO trainer (``StreamedDPOTrainer`` with ``stream_layers=False``) on a model sharded by
torch's FSDP2 (``fully_shard``) over gloo; or, as a plain process, the same run unsharded on the
doubled batch. Used by tests/test_fsdp.py; not a test itself.

    torchrun --standalone --nproc_per_node 2 tests/fsdp_worker.py CHECKPOINT OUT_DIR
    python tests/fsdp_worker.py CHECKPOINT OUT_DIR

accelerate does not run FSDP on CPU: with ``use_cpu`` its state is MULTI_CPU whatever the FSDP
settings say, and the Trainer would wrap the model in DDP. So each process shards the model itself
and shows the Trainer a single process (the launcher's rank variables are hidden from accelerate
once the process group is up); the collectives are FSDP2's own (all-gather of the shards before a
layer runs, reduce-scatter averaging the gradients after its backward). Rank r trains on the r-th
half of each of the single process's batches (sequential sampler), so the ranks' mean gradient is
the single process's.
"""

from __future__ import annotations

import json
import os
import sys

BATCH, STEPS = 2, 5
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                 "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def main() -> None:
    checkpoint, out = sys.argv[1:3]
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    import torch

    mesh = None
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,))
        for name in LAUNCHER_VARS:
            os.environ.pop(name, None)
    from datasets import Dataset
    from harness import pref_rows, trainer_kwargs
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deg_hf import StreamedDPOConfig, StreamedDPOTrainer

    rows = pref_rows(2 * BATCH * STEPS)
    if world > 1:  # this rank's half of every doubled batch
        rows = [row for i in range(STEPS) for row in rows[2 * BATCH * i + rank * BATCH : 2 * BATCH * i + (rank + 1) * BATCH]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    args = StreamedDPOConfig(**trainer_kwargs(
        os.path.join(out, "run"), stream_layers=False, per_device_train_batch_size=BATCH * (1 if world > 1 else 2),
        max_steps=STEPS, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=0.0,
        train_sampling_strategy="sequential", max_length=64, prefix_sharing=False))
    trainer = StreamedDPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                 processing_class=AutoTokenizer.from_pretrained(checkpoint),
                                 peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    if mesh is not None:  # the trainer's PEFT model, sharded before train() builds the optimizer over its parameters
        from torch.distributed.fsdp import fully_shard

        for layer in trainer.model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(trainer.model, mesh=mesh)
    trainer.train()
    from torch.distributed.tensor import DTensor

    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    adapter = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous() for n, p in params.items()}
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    save_file(adapter, os.path.join(out, f"rank{rank}.safetensors"))
    record = {"rank": rank, "world": world, "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
              "sharded": sorted(n for n, p in trainer.model.named_parameters() if isinstance(p, DTensor))[:3],
              "n_sharded": sum(isinstance(p, DTensor) for p in trainer.model.parameters()),
              "wrapper": type(trainer.model_wrapped).__name__, "streamed": trainer.stream_runtime is not None}
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    if mesh is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
