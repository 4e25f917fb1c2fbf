"""Run a micro-batch in parts that fit, and survive running out of memory.

:class:`SplitRetryEngine` is what the mixin's ``training_step`` calls. For one micro-batch it

1. asks the planner for contiguous parts of examples that fit the memory target;
2. runs each part, inside the trainer's :class:`~deg_hf.memory.meter.DeviceMemory` (measured on
   CUDA and CPU alike when measuring is on, held to the target on CPU), through the trainer's own ``training_step`` with a loss weight chosen so that
   the parts' gradients add up to the unsplit micro-batch's gradient: a loss normalised by the
   accumulation window's label count (``num_items_in_batch``) needs no weight; a loss that is a
   mean over the micro-batch's examples (DPO, KTO, ORPO, SimPO) or tokens (SFT without
   ``num_items_in_batch``) is weighted by the part's share of them;
3. hands each measured peak to the planner (:meth:`~deg_hf.memory.planner.MemPlanner.observe`), so
   the next plan is calibrated by what the last parts really held;
4. on an out-of-memory error anywhere in a part's forward or backward, puts back the gradients
   as they were before the part, halves the part and retries;
5. skips a single example that still runs out of memory, and then makes the step exactly what it
   would have been had the example never been in the batch: the micro-batch is run again without
   it and, when the loss is normalised over the whole accumulation window, the window's earlier
   micro-batches are replayed with the corrected label count.

Any error that is not an out-of-memory error propagates unchanged.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from deg_hf.memory import batch as mb

logger = logging.getLogger(__name__)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if isinstance(exc, RuntimeError):
        text = str(exc)
        return "CUDA out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text or "out of memory" in text.lower()
    return False


@dataclass
class PartInfo:
    """What a fault hook sees of a part (also the payload of ``oom_skip`` events)."""

    step: int  # optimizer step (trainer.state.global_step)
    micro_batch: int  # index of the micro-batch within the accumulation window
    indices: tuple[int, ...]  # example positions within the micro-batch
    uids: tuple[Any, ...]  # example ids when the collator attached them, else the positions
    rows: int
    tokens: int

    def __len__(self) -> int:
        return len(self.indices)


class _Skip(Exception):
    def __init__(self, index: int, info: PartInfo, error: BaseException):
        super().__init__(f"example {index} skipped")
        self.index, self.info, self.error = index, info, error


@dataclass
class _Window:
    """The micro-batches of one optimizer step, kept so a skip can replay them."""

    step: int
    batches: list  # the trainer's own list of micro-batches (identity matters)
    grads_at_start: list
    excluded: dict[int, set] = field(default_factory=dict)  # micro-batch -> skipped example positions
    reported: dict[int, float] = field(default_factory=dict)  # micro-batch -> loss already returned
    num_items: Any = None  # corrected num_items_in_batch after a skip (token-normalised losses)
    corrected: bool = False


@dataclass
class Counters:
    parts: int = 0
    oom_retry: int = 0
    oom_skip: int = 0
    trunk_forks: int = 0  # single pairs rescued by running their prompt and completions apart
    examples: int = 0  # examples the training loop handed over (each micro-batch counted once)
    skipped: list = field(default_factory=list)  # dataset row ids of the skipped examples

    def as_dict(self) -> dict:
        return {"parts": self.parts, "oom_retry": self.oom_retry, "oom_skip": self.oom_skip,
                "trunk_forks": self.trunk_forks, "examples": self.examples, "skipped": list(self.skipped)}


class SkipLimitError(RuntimeError):
    """A run that skipped every example, or more than ``oom_max_skip_fraction`` of them, for memory:
    stopping beats finishing with an adapter trained on what happened to fit."""


def check_skips(skipped: int, examples: int, ids: list, limit: float, *, planned: int | None = None) -> None:
    """Raise :class:`SkipLimitError` when ``skipped`` of ``examples`` is every example, or more than
    ``limit`` of them. With ``planned`` (the examples the whole run will see) it raises as soon as the
    skips already pass ``limit`` of that total, when the end of the run could only confirm it."""
    shown = ", ".join(str(i) for i in ids[:12]) + (" ..." if len(ids) > 12 else "")
    remedy = ("lower max_length so long rows are truncated, filter the longest rows out of the dataset, "
              "lower per_device_train_batch_size, or set mem_target_gb to the device's real memory")
    if planned is None and examples and skipped >= examples:
        raise SkipLimitError(
            f"every one of the {examples} examples this run saw was skipped because it ran out of memory even "
            f"alone (dataset rows {shown}): nothing was trained. To fit them, {remedy}."
        )
    total = planned if planned else examples
    if total and skipped > limit * total and skipped:
        raise SkipLimitError(
            f"{skipped} examples were skipped because they ran out of memory even alone (dataset rows {shown}), "
            f"more than oom_max_skip_fraction={limit} of the run's {total} examples allows. To fit them, {remedy}; "
            "or raise oom_max_skip_fraction to train without them."
        )


class SplitRetryEngine:
    def __init__(self, trainer):
        self.trainer = trainer
        self.counters = Counters()
        self.events: list[dict] = []  # oom_skip events not yet written out
        self.window: _Window | None = None
        self.all_skipped_steps = 0
        self.last_estimate = 0
        self.peak_bytes: int | None = None  # the most device memory a part held since take_peak()
        self._examples: dict = {}  # example position -> planner Example, for the micro-batch running
        self.samples: list | None = None  # measured parts, when calibration records them
        self.sample_tags: dict = {}
        self._step_retries: dict[int, int] = {}  # optimizer step -> retries (bounded by oom_max_splits)

    # ------------------------------------------------------------------ trainer hooks
    def begin_window(self, batches: list) -> None:
        self.window = _Window(self.trainer.state.global_step, batches, self._grads())

    def window_all_skipped(self) -> bool:
        w = self.window
        if w is None or not w.excluded:
            return False
        stacked = self.trainer.deg_stacked_pairs
        return all(
            len(w.excluded.get(m, ())) == mb.n_examples(b, stacked) for m, b in enumerate(w.batches)
        )

    # ------------------------------------------------------------------ one micro-batch
    def training_step(self, model, inputs, num_items_in_batch, run_part):
        """``run_part(part_inputs, num_items, weight, info)`` runs the trainer's own forward and
        backward on a part and returns its weighted, detached loss."""
        w = self.window
        m = next((i for i, b in enumerate(w.batches) if b is inputs), None) if w else None
        if w is None or m is None:  # called outside the training loop's window (e.g. directly)
            self.begin_window([inputs])
            w, m = self.window, 0
        if w.num_items is not None:
            num_items_in_batch = w.num_items
        self.counters.examples += mb.n_examples(self.trainer._deg_strip_features(inputs), self.trainer.deg_stacked_pairs)
        self._correction = 0.0
        loss = self._run_micro_batch(model, m, num_items_in_batch, run_part)
        # the training loop already added the replayed micro-batches' old losses to its total
        return loss + self._correction

    def _run_micro_batch(self, model, m, num_items, run_part):
        w = self.window
        snapshot = self._grads()
        while True:
            try:
                loss = self._run_examples(model, m, num_items, run_part)
                w.reported[m] = float(loss)
                return loss
            except _Skip as skip:
                self._record_skip(skip)
                w.excluded.setdefault(m, set()).add(skip.index)
                if self._token_normalised(num_items):
                    # every micro-batch of the window was normalised by a count that included
                    # the skipped example: recount, and replay the earlier ones from the
                    # window's starting gradients
                    num_items = w.num_items = self._recount_window()
                    self._restore(w.grads_at_start)
                    old = sum(w.reported.get(i, 0.0) for i in range(m))
                    new = sum(float(self._run_micro_batch(model, i, num_items, run_part)) for i in range(m))
                    self._correction += new - old
                    snapshot = self._grads()
                else:
                    self._restore(snapshot)

    def _run_examples(self, model, m, num_items, run_part):
        trainer = self.trainer
        w = self.window
        inputs = w.batches[m]
        stacked = trainer.deg_stacked_pairs
        inputs = trainer._deg_strip_features(inputs)
        b = mb.n_examples(inputs, stacked)
        active = [i for i in range(b) if i not in w.excluded.get(m, set())]
        if not active:
            return torch.zeros((), device=trainer.args.device)
        token_mode = self._token_normalised(num_items)
        total_units = None if token_mode else self._units(inputs, active)
        uids = trainer._deg_uids(w.batches[m], b)
        self._examples = self._planner_examples(inputs, active, w.batches[m].get("deg_lengths"))
        queue = [list(p) for p in self._plan(inputs, active, w.batches[m].get("deg_lengths"))]
        data_parallel = self._world_size() > 1
        if data_parallel:
            queue = self._agree_on_parts(queue)
        whole = mb.select(inputs, active, stacked) if active != list(range(b)) else inputs
        in_whole = {i: k for k, i in enumerate(active)}
        prepared = False  # batch-level terms (KTO's KL) computed over the whole micro-batch
        if len(queue) > 1:
            trainer._deg_before_parts(model, whole, [[in_whole[i] for i in p] for p in queue])
            prepared = True
        loss_total = None
        try:
            while queue:
                idx = queue.pop(0)
                part = mb.select(inputs, idx, stacked) if idx != list(range(b)) else inputs
                if idx != active:
                    part = trainer._deg_part_inputs(part, whole)
                info = PartInfo(trainer.state.global_step, m, tuple(idx), tuple(uids[i] for i in idx),
                                rows=int(part[mb.main_key(part)].shape[0]),
                                tokens=mb.label_tokens(part, stacked))
                weight = 1.0 if token_mode else self._units(inputs, idx) / total_units
                before = self._grads()
                # under DistributedDataParallel only the last part's backward synchronises (the
                # accumulated gradient, as across an accumulation window)
                sync = contextlib.nullcontext() if not (data_parallel and queue) else trainer.accelerator.no_sync(model)
                try:
                    with sync:
                        loss = self._measured(run_part, idx, part, num_items, weight, info)
                except Exception as exc:
                    if not is_oom(exc) or not trainer.deg_stream.oom_retry:
                        raise
                    if data_parallel:
                        raise RuntimeError(
                            "out of memory in one process of a data-parallel run: the other processes "
                            "cannot follow a retry they did not plan. Set mem_target_gb (or lower it) so "
                            "the planner splits micro-batches ahead of time on every process, or lower "
                            "per_device_train_batch_size / max_length."
                        ) from exc
                    self._restore(before)
                    del before
                    _free_device_cache()
                    if len(idx) == 1:
                        loss = self._run_trunk_forks(part, num_items, weight, info, run_part)
                        if loss is None:
                            raise _Skip(idx[0], info, exc) from exc
                        self.counters.parts += 1
                        loss_total = loss if loss_total is None else loss_total + loss
                        continue
                    self.count_retry(exc)
                    half = len(idx) // 2
                    queue[:0] = [idx[:half], idx[half:]]
                    if not prepared:
                        trainer._deg_before_parts(model, whole, [[in_whole[i] for i in p] for p in queue])
                        prepared = True
                    continue
                self.counters.parts += 1
                loss_total = loss if loss_total is None else loss_total + loss
        finally:
            trainer._deg_after_parts()
        return loss_total

    def _run_trunk_forks(self, part, num_items, weight, info, run_part):
        """A single pair that ran out of memory packed runs once more as its prompt (trunk) and its
        completions (forks) separately, when the trainer shares prefixes; None when that is not
        possible or runs out of memory too."""
        sharing = getattr(self.trainer, "deg_prefix", None)
        if sharing is None or not sharing.available or sharing.mode != "packed":
            return None
        before = self._grads()
        try:
            with sharing.use_mode("trunk_forks"), self.trainer.deg_memory.part() as reading:
                loss = run_part(part, num_items, weight, info)
            self._note_peak(reading)
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._restore(before)
            _free_device_cache()
            return None
        self.counters.trunk_forks += 1
        return loss

    # ------------------------------------------------------------------ memory
    def _measured(self, run_part, idx, part, num_items, weight, info):
        """``run_part`` inside the trainer's device memory; its peak calibrates the planner."""
        memory = self.trainer.deg_memory
        no_grad = [p for p in self._params() if p.grad is None] if memory.measures else []
        try:
            with memory.part() as reading:
                loss = run_part(part, num_items, weight, info)
        except Exception as exc:
            if is_oom(exc):
                # what the part held when it failed is a lower bound on its peak: it can only raise the scale
                self._observe(idx, memory.last, 0, lower_bound=True)
            raise
        # the first part of a window allocates the adapters' gradients, which the planner counts
        # as static memory, not as the part's
        grads = sum(p.grad.numel() * p.grad.element_size() for p in no_grad if p.grad is not None)
        self._observe(idx, reading, grads)
        return loss

    def _observe(self, idx, reading, grad_bytes: int, lower_bound: bool = False) -> None:
        if reading is None or not self.trainer.deg_memory.measures:
            return
        if not lower_bound:
            self._note_peak(reading)
        planner = self.trainer.deg_planner
        examples = [self._examples[i] for i in idx if i in self._examples]
        if planner is None or len(examples) != len(idx) or not examples:
            return
        peak = max(0, reading.peak_bytes - grad_bytes)
        if self.samples is not None and not lower_bound:
            from deg_hf.memory.calibrate import Sample

            self.samples.append(Sample(planner.features_for(examples), peak, planner.estimate(examples),
                                       dict(self.sample_tags)))
        planner.observe_static(reading.start_bytes)
        planner.observe(examples, peak, lower_bound=lower_bound)

    def _note_peak(self, reading) -> None:
        if self.trainer.deg_memory.measures:
            total = reading.start_bytes + reading.peak_bytes
            self.peak_bytes = total if self.peak_bytes is None else max(self.peak_bytes, total)

    def take_peak(self) -> int | None:
        """The most device memory any part held since the last call (None when not measured)."""
        peak, self.peak_bytes = self.peak_bytes, None
        return peak

    # ------------------------------------------------------------------ helpers
    def _world_size(self) -> int:
        accelerator = getattr(self.trainer, "accelerator", None)
        return int(getattr(accelerator, "num_processes", 1) or 1)

    def _agree_on_parts(self, queue: list[list[int]]) -> list[list[int]]:
        """Every process runs the same number of parts: the trainers gather metrics inside each
        part's loss and synchronise gradients in backward, collectives that must pair up. Parts
        are split further (largest first) up to the largest count any process planned."""
        import torch.distributed as dist

        count = torch.tensor([len(queue)], device=self.trainer.args.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        target = int(count.item())
        queue = [list(p) for p in queue]
        while len(queue) < target:
            i = max(range(len(queue)), key=lambda j: len(queue[j]))
            if len(queue[i]) < 2:
                raise RuntimeError(
                    f"another process splits this micro-batch into {target} parts, more than the "
                    f"{len(queue)} examples left here; lower per_device_train_batch_size or raise mem_target_gb"
                )
            half = len(queue[i]) // 2
            queue[i:i + 1] = [queue[i][:half], queue[i][half:]]
        return queue

    def _planner_examples(self, inputs, active, lengths=None) -> dict:
        """Position -> the planner's :class:`~deg_hf.memory.planner.Example` of each active example
        (empty without a planner)."""
        if self.trainer.deg_planner is None:
            return {}
        from deg_hf.memory.planner import Example

        if lengths is None:
            lengths = mb.row_lengths(inputs, self.trainer.deg_stacked_pairs)
        shared = self.trainer._deg_shared_prompt_lens(inputs)
        if shared is not None:
            # packed: one row of prompt + chosen + rejected per pair (P + C + R, not 2P + C + R); the
            # LM head still scores the two rows
            return {i: Example(i, (sum(lengths[i]) - shared[i],), prompt_len=shared[i] or None, lm_lengths=lengths[i])
                    for i in active}
        # KL rows (KTO, listed last) run without gradients, before the part or at its start, and keep
        # nothing for the backward: the part's peak is its own rows'
        kl = self.trainer.deg_kl_rows_per_example
        return {i: Example(i, lengths[i][:-kl] if kl and len(lengths[i]) > kl else lengths[i]) for i in active}

    def _plan(self, inputs, active, lengths=None) -> list[list[int]]:
        planner = self.trainer.deg_planner
        if planner is None or not self.trainer.deg_stream.mem_plan:
            return [active]
        examples = self._examples or self._planner_examples(inputs, active, lengths)
        parts = planner.plan([examples[i] for i in active])
        self.last_estimate = max((p.estimate for p in parts), default=0)
        return [list(p.indices) for p in parts]

    def _units(self, inputs, idx) -> float:
        if self.trainer.deg_loss_unit == "tokens":
            return float(max(1, mb.label_tokens(inputs, self.trainer.deg_stacked_pairs, idx)))
        return float(len(idx))

    def _token_normalised(self, num_items) -> bool:
        trainer = self.trainer
        scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled) and num_items is not None
        return (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items is not None) or (
            getattr(trainer, "compute_loss_func", None) is not None
        )

    def _recount_window(self):
        trainer, w = self.trainer, self.window
        stacked = trainer.deg_stacked_pairs
        kept = []
        for i, b in enumerate(w.batches):
            b = trainer._deg_strip_features(b)
            active = [j for j in range(mb.n_examples(b, stacked)) if j not in w.excluded.get(i, set())]
            if active:
                kept.append(mb.select(b, active, stacked))
        if not kept:
            return None
        return trainer._get_num_items_in_batch(kept, trainer.args.device)

    def count_retry(self, exc) -> None:
        self.counters.oom_retry += 1
        step = self.trainer.state.global_step
        self._step_retries[step] = self._step_retries.get(step, 0) + 1
        limit = self.trainer.deg_stream.oom_max_splits
        if self._step_retries[step] > limit:
            raise RuntimeError(
                f"out of memory {limit} times in one optimizer step (oom_max_splits={limit}); "
                "lower per_device_train_batch_size or max_length, or raise oom_max_splits"
            ) from exc

    def _record_skip(self, skip: _Skip) -> None:
        self.counters.oom_skip += 1
        self.counters.skipped.append(skip.info.uids[0])
        event = {"event": "oom_skip", "step": skip.info.step, "micro_batch": skip.info.micro_batch,
                 "index": skip.info.indices[0], "uid": skip.info.uids[0], "rows": skip.info.rows,
                 "tokens": skip.info.tokens, "error": str(skip.error).splitlines()[0][:200]}
        self.events.append(event)
        logger.warning("skipped example %s (uid %s): out of memory even alone (%d rows, %d tokens)",
                       event["index"], event["uid"], event["rows"], event["tokens"])

    def _params(self):
        return [p for p in self.trainer.model.parameters() if p.requires_grad]

    def _grads(self) -> list:
        return [None if p.grad is None else p.grad.detach().clone() for p in self._params()]

    def _restore(self, grads: list) -> None:
        for p, g in zip(self._params(), grads):
            p.grad = None if g is None else g.clone()


def _free_device_cache() -> None:
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
