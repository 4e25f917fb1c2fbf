"""Run one recipe in this process (a torchrun rank, or a plain single process) and record what it did.

    torchrun --nproc_per_node 2 tests/mp_recipe.py RECORD_DIR dpo --use_cpu true ...

Used by tests/test_multiprocess.py; not a test itself. Writes RECORD_DIR/rank<N>.json and
RECORD_DIR/rank<N>.safetensors (this rank's trained adapter). Every rank creates files with its own
umask (rank 0 clears group-write, the others set it), so a file under the output directory created by
a rank other than 0 (by Python, safetensors or torch alike) shows up as group-writable; an audit hook
also records every Python-level write this rank makes under the output directory.
"""

from __future__ import annotations

import json
import os
import runpy
import sys


def main() -> None:
    record_dir, recipe, *argv = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    os.umask(0o022 if rank == 0 else 0o002)
    output_dir = os.path.abspath(argv[argv.index("--output_dir") + 1])
    writes: list[str] = []

    def audit(event: str, args: tuple) -> None:
        path = None
        if event == "open" and len(args) >= 3:
            mode, flags = args[1], args[2]
            writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            path = args[0] if writing else None
        elif event in ("os.rename", "os.remove", "tempfile.mkstemp"):
            path = args[1] if event == "os.rename" else args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
            if path.startswith(output_dir + os.sep) or path == output_dir:
                writes.append(f"{event} {os.path.relpath(path, output_dir)}")

    from deg_hf.streaming import store
    from deg_hf.trainers.dpo import StreamedDPOTrainer  # noqa: F401  (the recipe's trainer classes)
    from deg_hf.trainers.mixin import StreamingSetupMixin

    trainers = []
    train = StreamingSetupMixin.train

    def train_and_keep(self, *args, **kwargs):
        trainers.append(self)
        return train(self, *args, **kwargs)

    StreamingSetupMixin.train = train_and_keep
    if os.environ.get("DEG_TEST_RANK1_SINGLES") and rank == 1:
        # this rank plans every example as its own part, so the ranks plan different part counts
        from deg_hf.memory.split_retry import SplitRetryEngine

        SplitRetryEngine._plan = lambda self, inputs, active, lengths=None: [[i] for i in active]
    raise_at = os.environ.get("DEG_TEST_RANK1_RAISES_AT_STEP")
    if raise_at and rank == 1:
        # this rank fails inside a training step (after the store is shared and training has begun)
        step = StreamingSetupMixin.training_step

        def failing_step(self, *args, **kwargs):
            if self.state.global_step + 1 == int(raise_at):
                raise RuntimeError(f"rank 1 fails in step {raise_at} (test)")
            return step(self, *args, **kwargs)

        StreamingSetupMixin.training_step = failing_step
    sys.addaudithook(audit)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.argv = [os.path.join(repo, "recipes", f"{recipe}.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")

    from safetensors.torch import save_file

    os.makedirs(record_dir, exist_ok=True)
    (trainer,) = trainers
    adapter = {n: p.detach().cpu().contiguous() for n, p in trainer.model.named_parameters() if p.requires_grad}
    save_file(adapter, os.path.join(record_dir, f"rank{rank}.safetensors"))
    record = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "writes": writes,
              "global_step": trainer.state.global_step, "wrapper": type(trainer.model_wrapped).__name__,
              "counters": trainer.deg_counters,
              "share": trainer.stream_runtime.store.share_stats() if trainer.stream_runtime is not None else None,
              "stores_constructed": store.CONSTRUCTED}
    ignored = getattr(trainer.model_wrapped, "parameters_to_ignore", None)
    if ignored is not None:  # what DistributedDataParallel broadcasts and all-reduces
        module = trainer.model_wrapped.module
        record["ddp_params"] = sorted(n for n, _ in module.named_parameters() if n not in ignored)
        record["ddp_buffers"] = sorted(n for n, _ in module.named_buffers() if n not in ignored)
        record["trainable"] = sorted(adapter)
    with open(os.path.join(record_dir, f"rank{rank}.json"), "w", encoding="utf-8") as fh:
        json.dump(record, fh)


if __name__ == "__main__":
    main()
