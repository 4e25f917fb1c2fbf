"""The ``deg.json`` record of a training run: built from a trainer, written at every save, read on resume.

:func:`build_record` gathers what the trainer knows (task, base model, adapter, every training
argument, streaming settings and statistics, the memory planner's state and the out-of-memory
counters, the data, the metrics logged so far) and hands it to :func:`deg_hf.checkpoint.make_record`.
:func:`write_checkpoint_files` writes ``deg.json`` and the ``README.md`` model card next to the
adapter (for a ``checkpoint-N``, while it is staged: see :mod:`deg_hf.checkpoint.atomic`);
:class:`DegCheckpointCallback` does it for checkpoints saved without them, and
:func:`restore_from_checkpoint` puts the planner state and the counters back on resume.

Like the rest of deg_hf's trainer support this module imports nothing heavy at module level:
transformers' ``TrainerCallback`` is resolved when the callback class is first used.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

from deg_hf.trainers.record_sections import (
    COUNTER_KEYS,
    _peft_config,
    _unwrap,
    base_model_section,
    counters_of,
    data_section,
    memory_section,
    metrics_section,
    stream_section,
)

logger = logging.getLogger(__name__)

__all__ = [
    "build_record",
    "write_checkpoint_files",
    "restore_from_checkpoint",
    "resolve_resume_checkpoint",
]  # and DegCheckpointCallback, built on first access (it subclasses transformers.TrainerCallback)


def build_record(trainer, metrics: Mapping[str, Any] | None = None) -> dict:
    """The ``deg.json`` content for ``trainer`` as it stands (redacted, not yet validated or written)."""
    from deg_hf.checkpoint import make_record

    model = _unwrap(trainer)
    peft = _peft_config(model)  # None: a full fine-tune (resident, no peft_config)
    default_lora = bool(getattr(trainer, "deg_default_lora", False))
    record = make_record(
        task=getattr(trainer, "deg_task", "sft"),
        base_model=base_model_section(trainer),
        peft=peft,
        train_args=trainer.args.to_dict(),
        stream=stream_section(trainer),
        memory=memory_section(trainer),
        data=data_section(trainer),
        metrics=metrics_section(trainer, metrics),
        default_lora_applied=default_lora,
    )
    notes = list(getattr(trainer, "deg_notes", None) or [])
    if notes:
        from deg_hf.checkpoint import jsonable, redact

        record["notes"] = redact(jsonable(notes))
    return record


def _is_main(trainer) -> bool:
    check = getattr(trainer, "is_world_process_zero", None)
    return bool(check()) if callable(check) else True


def write_checkpoint_files(
    trainer, directory: str | os.PathLike, metrics: Mapping[str, Any] | None = None, *, strict: bool = True
):
    """Write ``deg.json`` and the ``README.md`` model card into ``directory`` (main process only).

    Returns the path of ``deg.json``, or None on the other processes. With ``strict=False`` (the
    saves inside a training run) a failure to build or validate the record is logged instead of
    raised: a long run is not stopped for its metadata, and a checkpoint without ``deg.json`` still
    resumes. A failure to write (``OSError``: a full disk) is raised either way: the save failed.
    """
    if not _is_main(trainer):
        return None
    from deg_hf.checkpoint import read_deg_json, write_deg_json
    from deg_hf.hub import write_model_card

    try:
        path = write_deg_json(directory, build_record(trainer, metrics))
        # the card is written from the record exactly as it landed on disk (redacted for this directory)
        write_model_card(directory, read_deg_json(path), repo_id=getattr(trainer.args, "hub_model_id", None))
    except Exception as exc:
        if strict or isinstance(exc, OSError):
            raise
        logger.error("could not write deg.json into %s: %s", directory, exc, exc_info=True)
        return None
    return path


def resolve_resume_checkpoint(trainer, resume_from_checkpoint) -> str | None:
    """The checkpoint directory ``train(resume_from_checkpoint=...)`` resumes from, or None.

    ``True`` means the newest *complete* ``checkpoint-N`` in ``args.output_dir``: incomplete ones
    (an interrupted save of an older deg_hf) are skipped with a warning naming them, and when there
    is none the run starts from the beginning, with a warning. A path must be a complete checkpoint,
    else ``ValueError`` says what it lacks. ``False``/``None`` mean no resume.
    """
    from deg_hf.checkpoint.atomic import checkpoint_problem, newest_complete_checkpoint

    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    optimizer = not getattr(trainer.args, "save_only_model", False)
    if resume_from_checkpoint is True:
        output_dir = trainer.args.output_dir
        found = newest_complete_checkpoint(output_dir, optimizer=optimizer)
        if found is None:
            logger.warning("resume_from_checkpoint=True: %s holds no complete checkpoint-N; training starts from "
                           "the beginning", output_dir)
        return found
    path = os.fspath(resume_from_checkpoint)
    problem = checkpoint_problem(path, optimizer=optimizer)
    if problem is not None:
        raise ValueError(
            f"cannot resume from {path}: {problem}. Give a complete checkpoint-N directory, or "
            "resume_from_checkpoint=True to take the newest complete one in output_dir."
        )
    return path


def _counter_target(trainer) -> Any:
    """Where the trainer keeps its live counters: the split-and-retry engine's ``counters`` object
    when there is one (``trainer.deg_counters`` may be a read-only view of it), else the
    ``deg_counters`` mapping itself."""
    engine_counters = getattr(getattr(trainer, "deg_engine", None), "counters", None)
    if engine_counters is not None:
        return engine_counters
    return getattr(trainer, "deg_counters", None)


def _set_counters(trainer, memory: Mapping[str, Any], record_metrics: Mapping[str, Any] | None = None
                  ) -> dict | None:
    from deg_hf.checkpoint import memory_totals, skipped_ids

    totals = memory_totals(memory)
    if not any(key in totals for key in COUNTER_KEYS):
        return None
    values = {key: int(totals.get(key, 0) or 0) for key in COUNTER_KEYS}
    if "examples" not in totals:  # recorded before deg_hf counted them: the steps taken times the batch
        args, step = trainer.args, int((record_metrics or {}).get("global_step", 0) or 0)
        values["examples"] = max(values["oom_skip"], step * int(getattr(args, "per_device_train_batch_size", 1))
                                 * int(getattr(args, "gradient_accumulation_steps", 1)))
    skipped = list(skipped_ids(memory))
    target = _counter_target(trainer)
    if target is None:
        try:
            trainer.deg_counters = {**values, "skipped": skipped}
        except AttributeError:  # a read-only property without a backing object: nothing to restore into
            pass
    elif isinstance(target, Mapping):
        target.update(values)
        target["skipped"] = skipped
    else:
        for key, value in values.items():
            setattr(target, key, value)
        if hasattr(target, "skipped"):
            target.skipped = skipped
    now = counters_of(trainer) or {}
    if any(now.get(key) != value for key, value in values.items()):
        logger.warning("could not restore the out-of-memory counters (%s): they restart from zero", values)
    return {**values, "skipped": skipped}


def restore_from_checkpoint(trainer, checkpoint_dir) -> dict | None:
    """Put the memory planner's state and the out-of-memory counters recorded in a checkpoint's
    ``deg.json`` back on ``trainer``; returns the record, or None when there is nothing to restore.

    ``checkpoint_dir`` may also be ``True`` (the last checkpoint in ``args.output_dir``) or
    ``None``/``False`` (no-op). A checkpoint without ``deg.json`` (or with an unreadable one) is
    resumed without it, with a warning: the planner then recalibrates from scratch.
    """
    from deg_hf.checkpoint import DEG_JSON, DegJsonError, read_deg_json

    directory = resolve_resume_checkpoint(trainer, checkpoint_dir)
    if directory is None:
        return None
    if not os.path.isfile(os.path.join(directory, DEG_JSON)):
        logger.warning(
            "resuming from %s, which has no %s: the memory planner starts uncalibrated and the "
            "out-of-memory counters start at zero", directory, DEG_JSON,
        )
        return None
    try:
        record = read_deg_json(directory)
    except DegJsonError as exc:
        logger.warning("resuming without the deg_hf record: %s", exc)
        return None
    task = getattr(trainer, "deg_task", None)
    if task and record.get("task") != task:
        logger.warning("resuming a %s run from a checkpoint recorded as %s (%s)", task, record.get("task"), directory)
    recorded_store = (record.get("stream") or {}).get("store_fingerprint")
    runtime = getattr(trainer, "stream_runtime", None)
    current_store = getattr(getattr(runtime, "store", None), "fingerprint", None)
    if recorded_store and current_store and recorded_store != current_store:
        logger.warning(
            "the base model's weight files changed since %s was saved (store fingerprint %s, now %s)",
            directory, recorded_store, current_store,
        )
    memory = record.get("memory") or {}
    planner = getattr(trainer, "deg_planner", None)
    state = memory.get("planner_state")
    if planner is not None and isinstance(state, Mapping):
        try:
            planner.load_state_dict(state)
        except (ValueError, TypeError) as exc:
            logger.warning("the planner state in %s cannot be restored (%s): the memory planner starts "
                           "uncalibrated", directory, exc)
    elif planner is not None:
        logger.warning("%s records no planner state: the memory planner starts uncalibrated", directory)
    _set_counters(trainer, memory, record.get("metrics"))
    return record


_CALLBACK_CLASS = None


def _callback_class():
    global _CALLBACK_CLASS
    if _CALLBACK_CLASS is not None:
        return _CALLBACK_CLASS
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    class DegCheckpointCallback(TrainerCallback):
        """Writes ``deg.json`` and ``README.md`` into every ``checkpoint-N`` directory the trainer saves
        without them (deg_hf's trainers write both while the checkpoint is staged, before it is
        renamed into place; this covers other trainers the callback is added to).

        Holds the trainer by weak reference, so the callback does not keep the trainer (and its
        streaming runtime) alive. A failure to write the record is logged, never raised: a long run
        is not stopped for its metadata (the checkpoint is resumable without it).
        """

        def __init__(self, trainer):
            self._trainer = weakref.ref(trainer)

        @property
        def trainer(self):
            return self._trainer()

        def on_save(self, args, state, control, **kwargs):
            trainer = self._trainer()
            if trainer is None or not state.is_world_process_zero:
                return control
            directory = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            # deg_hf trainers write the record into the checkpoint before it is committed
            if not os.path.isdir(directory) or os.path.isfile(os.path.join(directory, "deg.json")):
                return control
            write_checkpoint_files(trainer, directory, strict=False)
            return control

    DegCheckpointCallback.__module__ = __name__
    _CALLBACK_CLASS = DegCheckpointCallback
    return _CALLBACK_CLASS


def __getattr__(name: str):
    # a TrainerCallback subclass needs transformers: build it on first use
    if name == "DegCheckpointCallback":
        cls = _callback_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
