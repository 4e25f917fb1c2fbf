"""The sections of a ``deg.json`` record, each read from a trainer as it stands: the base model (its
revision, config hash and 4-bit quantization), streaming settings and statistics, the memory
planner's state and counters, the data and the metrics. :func:`deg_hf.trainers.records.build_record`
puts them together."""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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
