"""Building the ``deg.json`` record: what was trained, how, on what, and with which versions."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deg_hf.checkpoint.io import FORMAT_VERSION, TASKS
from deg_hf.checkpoint.redact import jsonable, redact

# keys ignored when hashing a config: they change when the same model is re-saved
_CONFIG_VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
_VERSION_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deg_hf")


def _as_dict(obj: Any, what: str) -> dict:
    """A dict from a mapping, a dataclass instance (its init fields) or an object with ``to_dict()``."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise TypeError(f"{what} must be a dict, got {type(obj).__name__}")


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _peft_summary(peft: Any, default_lora_applied: bool) -> dict:
    src = _as_dict(peft, "peft")
    kind = _enum_value(src.get("type", src.get("peft_type", "LORA")))
    targets = src.get("target_modules")
    if isinstance(targets, (set, frozenset, tuple, list)):
        targets = sorted(str(t) for t in targets)
    elif targets is not None:
        targets = str(targets)  # a regular expression or "all-linear"
    summary = {
        "type": str(kind).upper() if kind is not None else "LORA",
        "r": src.get("r"),
        "lora_alpha": src.get("lora_alpha"),
        "lora_dropout": src.get("lora_dropout"),
        "target_modules": targets,
        "default_lora_applied": bool(default_lora_applied),
    }
    for key in ("bias", "use_rslora", "use_dora", "modules_to_save", "task_type", "init_lora_weights"):
        if key in src and src[key] is not None:
            summary[key] = _enum_value(src[key])
    return jsonable(summary)


def collect_versions(extra: Mapping[str, Any] | None = None) -> dict[str, str | None]:
    """Installed versions of the training stack, read from package metadata (nothing is imported)."""
    from importlib import metadata

    versions: dict[str, str | None] = {}
    for name in _VERSION_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    if versions.get("deg_hf") is None:
        from deg_hf import __version__

        versions["deg_hf"] = __version__
    if extra:
        versions.update({str(k): (None if v is None else str(v)) for k, v in extra.items()})
    return versions


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def make_record(
    *,
    task: str,
    base_model: Mapping[str, Any],
    peft: Any,
    train_args: Any,
    stream: Mapping[str, Any] | None,
    memory: Mapping[str, Any] | None,
    data: Mapping[str, Any] | None,
    metrics: Mapping[str, Any] | None,
    default_lora_applied: bool,
    versions: Mapping[str, Any] | None = None,
) -> dict:
    """Build the ``deg.json`` content (JSON-native, redacted, not yet validated or written).

    ``base_model`` needs ``name_or_path`` and may give ``revision`` (the commit, when known) and
    ``config_sha256`` (see :func:`config_sha256`). ``peft`` is a PEFT config or its ``to_dict()``, or
    None for a full fine-tune (every base weight trained).
    ``train_args`` is a dict or a ``TrainingArguments``-like dataclass: every argument is kept,
    values that are not JSON-native become ``str(value)``. ``versions`` entries override the
    collected ones.
    """
    from deg_hf import __version__

    task_name = str(_enum_value(task)).lower()
    if task_name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    base = _as_dict(base_model, "base_model")
    if not base.get("name_or_path"):
        raise ValueError("base_model needs a 'name_or_path'")
    base_entry = {
        "name_or_path": base["name_or_path"],
        "revision": base.get("revision"),
        "config_sha256": base.get("config_sha256"),
    }
    base_entry.update({k: v for k, v in base.items() if k not in base_entry})
    record = {
        "format_version": FORMAT_VERSION,
        "deg_hf_version": __version__,
        "task": task_name,
        "base_model": base_entry,
        "fine_tuning": "full" if peft is None else "adapter",
        "peft": None if peft is None else _peft_summary(peft, default_lora_applied),
        "train_args": _as_dict(train_args, "train_args"),
        "stream": None if stream is None else _as_dict(stream, "stream"),
        "memory": None if memory is None else _as_dict(memory, "memory"),
        "data": None if data is None else _as_dict(data, "data"),
        "metrics": None if metrics is None else _as_dict(metrics, "metrics"),
        "versions": collect_versions(versions),
        "created_at": _utc_now(),
    }
    return redact(jsonable(record))


def config_sha256(model_dir_or_config: Any) -> str:
    """SHA-256 of a model config: canonical JSON (sorted keys, compact), volatile keys left out.

    Accepts a model directory (its ``config.json`` is read), a path to a ``config.json``, a dict,
    or a ``PretrainedConfig`` (its ``to_diff_dict()``, i.e. what ``save_pretrained`` writes).
    ``transformers_version``, ``_name_or_path`` and ``_commit_hash`` are not hashed.
    """
    obj = model_dir_or_config
    if isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
    elif isinstance(obj, Mapping):
        config = dict(obj)
    elif callable(getattr(obj, "to_diff_dict", None)):
        config = obj.to_diff_dict()
    elif callable(getattr(obj, "to_dict", None)):
        config = obj.to_dict()
    else:
        raise TypeError(f"cannot hash a config from {type(obj).__name__}")
    config = {k: v for k, v in config.items() if k not in _CONFIG_VOLATILE_KEYS}
    canonical = json.dumps(jsonable(config), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
