"""MemoryPlanCallback: the memory plan's events and counters, in the logs and in train.log.jsonl."""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback

from deg_hf.memory.coef import GIB

LOG_FILE = "train.log.jsonl"


def _gib(n) -> float:
    return round(float(n) / GIB, 4)


class MemoryPlanCallback(TrainerCallback):
    """Writes a ``mem_plan`` event at train start, one line per logged step with the counters
    ``parts``, ``oom_retry``, ``oom_skip``, ``trunk_forks`` (since the previous log), ``est_peak_gib`` and, where
    device memory is measured (CUDA; CPU with a target), ``peak_gib`` (the most any part held since the previous
    log), and one ``oom_skip`` event per skipped example; skips the optimizer and scheduler
    step of an accumulation window whose every example was skipped."""

    def __init__(self, trainer):
        self.trainer = trainer
        self._last = {"parts": 0, "oom_retry": 0, "oom_skip": 0, "trunk_forks": 0}

    # -- file
    def _write(self, args, state, row: dict) -> None:
        if not state.is_world_process_zero:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, LOG_FILE), "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=str) + "\n")

    def _flush_events(self, args, state) -> None:
        engine = self.trainer.deg_engine
        while engine.events:
            self._write(args, state, engine.events.pop(0))

    # -- events
    def on_train_begin(self, args, state, control, **kwargs):
        # a resumed run starts from the counters its checkpoint recorded: log what happens from here
        engine = self.trainer.deg_engine
        self._last = {k: getattr(engine.counters, k) for k in self._last}
        planner = self.trainer.deg_planner
        row = {"event": "mem_plan", "step": state.global_step, "streaming": self.trainer.stream_runtime is not None}
        if planner is not None:
            from deg_hf.memory.preflight import UNLIMITED

            unlimited = planner.target_bytes >= UNLIMITED
            row.update(
                target_gib=None if unlimited else _gib(planner.target_bytes),
                static_gib=_gib(planner.static_bytes),
                activation_budget_gib=None if unlimited else _gib(planner.budget()),
                scale=planner.scale,
                coefficients=planner.coef.to_dict(),
            )
        self._write(args, state, row)

    def counters_since_last_log(self) -> dict:
        engine = self.trainer.deg_engine
        now = {k: getattr(engine.counters, k) for k in self._last}
        delta = {k: now[k] - self._last[k] for k in now}
        self._last = now
        planner = self.trainer.deg_planner
        if planner is not None:
            delta["est_peak_gib"] = _gib(planner.static_bytes + engine.last_estimate)
        peak = self.trainer._deg_measured_peak()
        if peak is not None:
            delta["peak_gib"] = _gib(peak)
        return delta

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._flush_events(args, state)
        if logs and "oom_retry" in logs:
            self._write(args, state, {"step": state.global_step, **logs})

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        engine = self.trainer.deg_engine
        if not engine.window_all_skipped():
            return
        # every example of this window was skipped: leave weights, moments and the schedule as they are
        engine.all_skipped_steps += 1
        for obj in (self.trainer.optimizer, self.trainer.lr_scheduler):
            _skip_next_step(obj)
        self._write(args, state, {"event": "step_skipped", "step": state.global_step,
                                  "reason": "every example of the accumulation window ran out of memory"})

    def on_step_end(self, args, state, control, **kwargs):
        # stop as soon as the skips pass the share the whole run allows: the end could only confirm it
        planned = state.max_steps * args.gradient_accumulation_steps * args.per_device_train_batch_size
        self._check_skips(args, state, planned=planned if state.max_steps > 0 else None)

    def on_train_end(self, args, state, control, **kwargs):
        self._flush_events(args, state)
        self._check_skips(args, state)

    def _check_skips(self, args, state, planned=None) -> None:
        from deg_hf.memory.split_retry import check_skips

        counters = self.trainer.deg_engine.counters
        skipped, examples = counters.oom_skip, counters.examples
        world = int(getattr(args, "world_size", 1) or 1)
        if world > 1:  # every process decides on the same totals, so they all stop together
            import torch
            import torch.distributed as dist

            both = torch.tensor([skipped, examples], device=args.device)
            dist.all_reduce(both)
            skipped, examples = (int(x) for x in both.tolist())
            planned = planned * world if planned else None
        if skipped:
            self._flush_events(args, state)
            check_skips(skipped, examples, counters.skipped, self.trainer.deg_stream.oom_max_skip_fraction,
                        planned=planned)


def _skip_next_step(obj) -> None:
    """Make ``obj.step()`` a no-op once, then restore it."""
    had_own = "step" in vars(obj)
    own = vars(obj).get("step")

    def skipped(*args, **kwargs):
        if had_own:
            obj.step = own
        else:
            del obj.step
        return None

    obj.step = skipped
