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
import math
import os
import re
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "build_record",
    "write_checkpoint_files",
    "restore_from_checkpoint",
    "resolve_resume_checkpoint",
]  # and DegCheckpointCallback, built on first access (it subclasses transformers.TrainerCallback)

#: a planner target at or above this many bytes stands for "no target" (the CPU default)
UNLIMITED_TARGET_BYTES = 1 << 60
#: counters whose totals deg.json records (and a resume restores)
COUNTER_KEYS = ("parts", "oom_retry", "oom_skip", "trunk_forks", "examples")
# log_history keys that are bookkeeping, not metrics
_NOT_METRICS = frozenset({"step", "epoch", "total_flos"})
# datasets' packaged builders: their dataset_name is the file format, not a name
_PACKAGED_BUILDERS = frozenset({"json", "csv", "parquet", "arrow", "text", "pandas", "sql", "generator",
                                "imagefolder", "audiofolder", "videofolder", "webdataset", "xml", "cache"})
_HUB_CACHE_DIR_RE = re.compile(r"^(?P<ns>[A-Za-z0-9][\w.-]*)___(?P<name>[\w.-]+)$")
_SNAPSHOT_RE = re.compile(r"[\\/]snapshots[\\/](?P<commit>[0-9a-f]{40})(?:[\\/]|$)")


# ----------------------------------------------------------------------------------------------------
# pieces of the record
# ----------------------------------------------------------------------------------------------------


def _unwrap(trainer) -> Any:
    model = trainer.model
    accelerator = getattr(trainer, "accelerator", None)
    if accelerator is not None:
        try:
            model = accelerator.unwrap_model(model)
        except Exception:  # an accelerator that was never prepared: the model is not wrapped
            pass
    return model


def _base_of(model) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _peft_config(model) -> Any:
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    active = getattr(model, "active_adapter", None)
    if isinstance(active, (list, tuple)):
        active = active[0] if active else None
    if isinstance(active, str) and active in configs:
        return configs[active]
    return configs.get("default", next(iter(configs.values())))


def _config_file_dir(name_or_path: str, revision: str | None, trainer) -> str | None:
    """A local directory holding the base model's config.json, or None when none is at hand."""
    if name_or_path and os.path.isfile(os.path.join(name_or_path, "config.json")):
        return name_or_path
    runtime = getattr(trainer, "stream_runtime", None)
    directory = getattr(getattr(runtime, "store", None), "directory", None)
    if directory and os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    if not name_or_path:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json", revision=revision)
    except Exception:  # not a repo id, or no cache
        return None
    return os.path.dirname(cached) if isinstance(cached, str) and os.path.isfile(cached) else None


def base_model_section(trainer) -> dict:
    """``name_or_path``, ``revision`` (the commit when known) and ``config_sha256`` of the base."""
    from deg_hf.checkpoint import config_sha256

    base = _base_of(_unwrap(trainer))
    config = getattr(base, "config", None)
    name = getattr(base, "name_or_path", None) or getattr(config, "_name_or_path", None) or ""
    name = str(name)
    init_kwargs = getattr(trainer.args, "model_init_kwargs", None) or {}
    requested = init_kwargs.get("revision") if isinstance(init_kwargs, Mapping) else None
    revision = getattr(config, "_commit_hash", None)
    directory = _config_file_dir(name, revision or requested, trainer)
    if revision is None and directory:
        match = _SNAPSHOT_RE.search(os.path.abspath(directory))
        revision = match.group("commit") if match else None
    if revision is None and requested and not os.path.isdir(name):
        revision = str(requested)  # a branch or tag: better than nothing
    sha = None
    try:
        sha = config_sha256(directory) if directory else (config_sha256(config) if config is not None else None)
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("deg.json: cannot hash the base model config (%s)", exc)
    if not name:
        name = "<unknown>"
    return {"name_or_path": name, "revision": revision, "config_sha256": sha,
            "quantization": base_quantization(trainer, base)}


def base_quantization(trainer, base) -> dict | None:
    """The 4-bit base the adapter was trained against (method, type, blocksize, double quant, compute
    dtype): the streamed store's, or a resident model's bitsandbytes config; None at full precision."""
    runtime = getattr(trainer, "stream_runtime", None)
    if runtime is not None:
        describe = getattr(getattr(runtime, "store", None), "quantization", None)
        return describe() if callable(describe) else None
    config = getattr(getattr(base, "config", None), "quantization_config", None)
    if not getattr(base, "is_quantized", False) or config is None:
        return None
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    if not cfg.get("load_in_4bit"):
        return None
    dtype = cfg.get("bnb_4bit_compute_dtype")
    return {
        "method": "bitsandbytes-4bit",
        "quant_type": str(cfg.get("bnb_4bit_quant_type") or "fp4"),
        "blocksize": 64,  # transformers' 4-bit loading
        "double_quant": bool(cfg.get("bnb_4bit_use_double_quant", False)),
        "compute_dtype": str(dtype).replace("torch.", "") if dtype is not None else None,
    }


def _settings(trainer) -> dict:
    settings = getattr(trainer, "deg_stream", None)
    if settings is None:
        return {}
    from deg_hf.config import STREAM_FIELDS

    return {name: getattr(settings, name) for name in STREAM_FIELDS if hasattr(settings, name)}


def stream_section(trainer) -> dict:
    """Streaming settings, the weight store's fingerprint and the runtime's statistics."""
    settings = _settings(trainer)
    runtime = getattr(trainer, "stream_runtime", None)
    if runtime is None:
        return {"enabled": False, **settings}
    stats = dict(runtime.stats())
    store = getattr(runtime, "store", None)
    return {
        "enabled": True,
        **settings,
        "store_fingerprint": getattr(store, "fingerprint", None),
        # the node's ranks map one store built by local rank 0 ({"shared": True, "ranks": N, ...})
        "store_shared": store.share_stats() if store is not None else None,
        # the 4-bit storage (method, type, blocksize, double quant, compute dtype); None at the training dtype
        "quantization": store.quantization() if store is not None else None,
        "device": str(getattr(runtime, "device", "")) or None,
        # host-to-device layer copies (a fetch served by a buffer that already held the layer is a hit)
        "layer_fetches": int(stats.get("loads", 0)),
        "loads": int(stats.get("loads", 0)),
        "hits": int(stats.get("hits", 0)),
        "bytes_moved": int(stats.get("bytes_moved", 0)),
        "stats": stats,
    }


def counters_of(trainer) -> dict | None:
    """``trainer.deg_counters`` as a plain dict (a mapping, or an object with ``as_dict``), or None."""
    counters = getattr(trainer, "deg_counters", None)
    if counters is None:
        return None
    if isinstance(counters, Mapping):
        return dict(counters)
    as_dict = getattr(counters, "as_dict", None)
    if callable(as_dict):
        return dict(as_dict())
    return {key: getattr(counters, key) for key in (*COUNTER_KEYS, "skipped") if hasattr(counters, key)}


def memory_section(trainer) -> dict | None:
    """The planner's targets, coefficients and full state, and the out-of-memory counters; None when
    the trainer has neither a planner nor counters."""
    planner = getattr(trainer, "deg_planner", None)
    counters = counters_of(trainer)
    if planner is None and counters is None:
        return None
    memory: dict[str, Any] = {}
    if planner is not None:
        target = getattr(planner, "target_bytes", None)
        static = getattr(planner, "static_bytes", None)
        budget = planner.budget() if callable(getattr(planner, "budget", None)) else None
        if target is not None and target >= UNLIMITED_TARGET_BYTES:
            target = budget = None  # no target applies (CPU without mem_target_gb): everything fits
        memory.update({
            "target": "unlimited" if target is None else int(target),
            "target_bytes": int(target) if target is not None else None,
            "target_gib": round(target / (1 << 30), 3) if target is not None else None,
            "static_bytes": int(static) if static is not None else None,
            "budget_bytes": int(budget) if budget is not None else None,
            "scale": float(planner.scale) if getattr(planner, "scale", None) is not None else None,
            "coefficients": planner.coef.to_dict() if getattr(planner, "coef", None) is not None else None,
            "planner_state": planner.state_dict(),
        })
        for name in ("min_rows", "checkpointing", "streaming", "fused_lm_head", "dtype_bytes", "attn_implementation"):
            if hasattr(planner, name):
                memory.setdefault("settings", {})[name] = getattr(planner, name)
    if counters is not None:
        memory["totals"] = {key: int(counters.get(key, 0) or 0) for key in COUNTER_KEYS}
        memory["skipped_ids"] = list(counters.get("skipped", []) or [])
    sharing = getattr(trainer, "deg_prefix", None)
    if sharing is not None:
        memory["prefix_sharing"] = sharing.summary()
    return memory


def _size(dataset) -> int | None:
    if dataset is None:
        return None
    try:
        return int(len(dataset))
    except (TypeError, NotImplementedError):  # an IterableDataset
        return None


def _dataset_name(dataset) -> str | None:
    info = getattr(dataset, "info", None)
    name = getattr(info, "dataset_name", None)
    namespace = None
    for entry in getattr(dataset, "cache_files", None) or []:
        filename = entry.get("filename") if isinstance(entry, Mapping) else None
        for part in Path(str(filename or "")).parts:
            match = _HUB_CACHE_DIR_RE.match(part)
            if match:
                namespace = match.group("ns")
                name = name or match.group("name")
                break
        if namespace:
            break
    if not name or (str(name) in _PACKAGED_BUILDERS and namespace is None):
        return None
    name = str(name)
    if namespace and "/" not in name:
        name = f"{namespace}/{name}"
    config = getattr(info, "config_name", None)
    if config and config != "default":
        name = f"{name}:{config}"
    return name


def data_section(trainer) -> dict | None:
    """Name (a Hub id when it can be told), fingerprint and split sizes of the training data."""
    train = getattr(trainer, "train_dataset", None)
    evaluation = getattr(trainer, "eval_dataset", None)
    if train is None and evaluation is None:
        return None
    name = getattr(trainer.args, "dataset_name", None) or (_dataset_name(train) if train is not None else None)
    fingerprint = getattr(train, "_fingerprint", None)
    sizes: dict[str, int | None] = {"train": _size(train)}
    if isinstance(evaluation, Mapping):
        for key, value in evaluation.items():
            sizes[f"eval_{key}"] = _size(value)
    elif evaluation is not None:
        sizes["eval"] = _size(evaluation)
    info = getattr(train, "info", None)
    return {
        "name_or_path": name,
        "fingerprint": str(fingerprint) if fingerprint else None,
        "builder": getattr(info, "builder_name", None),
        "sizes": sizes,
    }


def metrics_section(trainer, metrics: Mapping[str, Any] | None = None) -> dict:
    """The latest value of every scalar in ``trainer.state.log_history``, then ``metrics``."""
    out: dict[str, Any] = {}
    state = getattr(trainer, "state", None)
    for entry in getattr(state, "log_history", None) or []:
        for key, value in entry.items():
            if key in _NOT_METRICS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out[key] = value
    for key, value in (metrics or {}).items():
        out[str(key)] = value
    if state is not None:
        out.setdefault("global_step", int(getattr(state, "global_step", 0) or 0))
        epoch = getattr(state, "epoch", None)
        if isinstance(epoch, (int, float)) and math.isfinite(epoch):
            out.setdefault("epoch", epoch)
    return out


# ----------------------------------------------------------------------------------------------------
# the record, its files, the callback and the resume
# ----------------------------------------------------------------------------------------------------


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
