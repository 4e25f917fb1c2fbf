"""The checkpoint record (``deg.json``): build, redact, validate, write, read, summarise and load.

Every checkpoint saved by a deg_hf trainer carries a ``deg.json`` next to the adapter weights. It
records what was trained (task, base model, adapter), how (every training argument, the streaming
settings, the memory plan and the out-of-memory recoveries), on what (data name and fingerprint),
with what result (metrics) and with which library versions.

This module is import-light on purpose: only the standard library at module level, so ``deg-hf info``
and ``import deg_hf`` never pay for torch, transformers, PEFT or TRL. jsonschema, huggingface_hub,
transformers and PEFT are imported inside the functions that need them.

Privacy: a written ``deg.json`` never contains a local absolute path or a Hub token. Absolute paths
are rewritten relative to the current working directory when they lie under it, otherwise to
``<local>/<basename>``; strings that look like a Hub token, and string values under keys that name a
token or a secret, become ``"<redacted>"``; ``hub_token`` and ``push_to_hub_token`` are dropped.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import hashlib
import json
import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "DEG_JSON",
    "FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "TASKS",
    "ADAPTER_WEIGHT_FILES",
    "FULL_MODEL_WEIGHT_FILES",
    "DegJsonError",
    "make_record",
    "jsonable",
    "redact",
    "config_sha256",
    "collect_versions",
    "write_deg_json",
    "read_deg_json",
    "validate_record",
    "check_checkpoint",
    "summarize",
    "load",
]

FORMAT_VERSION = 1
DEG_JSON = "deg.json"
#: format versions this deg_hf can read
READABLE_FORMAT_VERSIONS = (1,)
TASKS = ("sft", "dpo", "kto", "orpo", "simpo")
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: what a full fine-tune's checkpoint holds instead (one file, or a sharded index)
FULL_MODEL_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
REDACTED = "<redacted>"
LOCAL_PREFIX = "<local>/"

# training arguments that hold a Hub token: never written, not even redacted
_DROPPED_KEYS = frozenset({"hub_token", "push_to_hub_token"})
# tokenizer vocabulary entries, not secrets, although their names contain "token"
_SPECIAL_TOKEN_KEYS = frozenset(
    {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}
)
_SECRET_WORDS = ("token", "password", "passwd", "secret", "api_key", "apikey")
_HF_TOKEN_RE = re.compile(r"hf_[A-Za-z0-9]{20,}")
_WINDOWS_ABS_RE = re.compile(r"^(?:[A-Za-z]:[\\/]|\\\\)")
# keys ignored when hashing a config: they change when the same model is re-saved
_CONFIG_VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
_VERSION_PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "deg_hf")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
)


class DegJsonError(ValueError):
    """A checkpoint's ``deg.json`` (or the checkpoint itself) is missing, unreadable or invalid."""


# ----------------------------------------------------------------------------------------------------
# JSON conversion and redaction
# ----------------------------------------------------------------------------------------------------

_JSON_SCALARS = (str, int, float, bool, type(None))


def jsonable(value: Any) -> Any:
    """Return ``value`` as JSON-native data, recursively.

    Values of exactly ``str``, ``int``, ``bool``, ``None`` and finite ``float`` are kept as they are;
    lists and tuples become lists and mappings become dicts with ``str`` keys (both converted
    recursively); sets become sorted lists. Anything else (an enum member, a ``Path``, a non-finite
    float, a dtype, a subclass of a JSON type...) is replaced by ``str(value)``.
    """
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else str(value)
    if kind in (str, int, bool, type(None)):
        return value
    if kind in (list, tuple):
        return [jsonable(v) for v in value]
    if kind in (set, frozenset):
        items = [jsonable(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, Mapping) and not isinstance(value, enum.Enum):
        return {(k if type(k) is str else str(k)): jsonable(v) for k, v in value.items()}
    return str(value)


def _home_dir() -> str | None:
    home = os.path.expanduser("~")
    if not home or home == "~" or not os.path.isabs(home):
        return None
    home = os.path.normpath(home)
    return None if _depth(home) < 1 else home


def _depth(path: str) -> int:
    """Number of named components of an absolute path (``/`` is 0, ``/tmp`` is 1)."""
    return len([p for p in re.split(r"[\\/]+", os.path.splitdrive(path)[1]) if p])


def _is_under(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives, or a mix of absolute and relative
        return False


def _looks_absolute(text: str) -> bool:
    if not text or "\n" in text:
        return False
    if text.startswith("/") or text == "~" or text.startswith("~/") or text.startswith("~\\"):
        return True
    return bool(_WINDOWS_ABS_RE.match(text))


def _local_path_repr(path: str) -> str:
    """How a local absolute path is written: relative to the working directory, or ``<local>/name``."""
    expanded = os.path.expanduser(path)
    if os.path.isabs(expanded):
        norm = os.path.normpath(expanded)
        cwd = os.path.normpath(os.getcwd())
        home = _home_dir()
        # a relative path must not give the user's home away: skip it when the working directory is
        # the filesystem root or lies above the home directory
        cwd_ok = _depth(cwd) >= 1 and not (home and home != cwd and _is_under(home, cwd))
        if cwd_ok and _is_under(norm, cwd):
            return os.path.relpath(norm, cwd).replace(os.sep, "/")
        name = os.path.basename(norm.rstrip("/\\"))
    else:  # a Windows path read on another system
        name = re.split(r"[\\/]+", expanded.rstrip("/\\"))[-1]
        if re.fullmatch(r"[A-Za-z]:", name):
            name = ""
    return LOCAL_PREFIX + name if name else LOCAL_PREFIX.rstrip("/")


def _sensitive_dirs(extra_dirs: Iterable[str | os.PathLike]) -> list[str]:
    """Directories whose absolute path must not appear inside any written string, longest first."""
    dirs: set[str] = set()
    home = _home_dir()
    if home:
        dirs.add(home)
    cwd = os.path.normpath(os.getcwd())
    if _depth(cwd) >= 1:
        dirs.add(cwd)
    for extra in extra_dirs:
        for variant in {os.path.abspath(os.fspath(extra)), os.path.realpath(os.fspath(extra))}:
            path = Path(variant)
            for candidate in (path, *path.parents):
                # one-level directories (/tmp, /home, /data) name nobody; deeper ones may
                if _depth(str(candidate)) >= 2:
                    dirs.add(os.path.normpath(str(candidate)))
    return sorted(dirs, key=len, reverse=True)


def _is_secret_key(key: str) -> bool:
    low = key.lower()
    if low in _SPECIAL_TOKEN_KEYS:
        return False
    # "tokenizer_*" and "*_tokens_*" (token counts: include_num_input_tokens_seen, max_new_tokens) name
    # no secret; a secret is one token ("hub_token", "api_token", "access_token")
    low = low.replace("tokenizer", "").replace("tokens", "")
    return any(word in low for word in _SECRET_WORDS)


def _redact_string(text: str, dirs: list[str]) -> str:
    text = _HF_TOKEN_RE.sub(REDACTED, text)
    if _looks_absolute(text):
        return _local_path_repr(text)
    for directory in dirs:
        if directory not in text:
            continue
        pattern = re.escape(directory) + r"(?=$|[\\/\s\"'`,;:)\]}>])[^\s\"'`,;)\]}>]*"
        text = re.sub(pattern, lambda m: _local_path_repr(m.group(0)), text)
    return text


def redact(value: Any, *, extra_dirs: Iterable[str | os.PathLike] = ()) -> Any:
    """Return a copy of JSON data with local paths and secrets removed (see the module docstring).

    ``extra_dirs`` are directories (typically the checkpoint directory) whose absolute path, and
    that of their parents two levels deep or more, must not survive anywhere inside a string.
    """
    return _redact(value, _sensitive_dirs(extra_dirs))


def _redact(value: Any, dirs: list[str]) -> Any:
    if isinstance(value, str):
        return _redact_string(value, dirs)
    if isinstance(value, list):
        return [_redact(v, dirs) for v in value]
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if key in _DROPPED_KEYS:
                continue
            if isinstance(item, str) and item and _is_secret_key(key):
                out[_redact_string(key, dirs)] = REDACTED
            else:
                out[_redact_string(key, dirs)] = _redact(item, dirs)
        return out
    return value


# ----------------------------------------------------------------------------------------------------
# building the record
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# schema validation, writing and reading
# ----------------------------------------------------------------------------------------------------

_SCHEMA_CACHE: dict | None = None


def load_schema() -> dict:
    """The shipped JSON Schema of ``deg.json`` (``deg_hf/schema/deg.schema.json``)."""
    global _SCHEMA_CACHE
    if _SCHEMA_CACHE is None:
        from importlib import resources

        text = resources.files("deg_hf").joinpath("schema", "deg.schema.json").read_text(encoding="utf-8")
        _SCHEMA_CACHE = json.loads(text)
    return _SCHEMA_CACHE


def _field_name(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _minimal_check(record: Any) -> str | None:
    """A reduced schema check used when jsonschema is not installed: returns a problem or None."""
    schema = load_schema()
    if not isinstance(record, dict):
        return "the record is not a JSON object"
    for key in schema["required"]:
        if key not in record:
            return f"required field '{key}' is missing"
    type_map = {"object": dict, "string": str, "integer": int, "number": (int, float), "boolean": bool,
                "null": type(None), "array": list}
    for key, spec in schema["properties"].items():
        allowed = spec.get("type")
        if allowed is None or key not in record:
            continue
        allowed = [allowed] if isinstance(allowed, str) else allowed
        if not any(isinstance(record[key], type_map[t]) for t in allowed):
            return f"field '{key}' must be {' or '.join(allowed)}"
    if record["task"] not in TASKS:
        return f"field 'task' must be one of {', '.join(TASKS)}, got {record['task']!r}"
    sub_required = schema["properties"]["base_model"]["required"]
    for key in sub_required:
        if key not in record["base_model"]:
            return f"required field 'base_model.{key}' is missing"
    return None


def validate_record(record: Any, *, source: str = "deg.json") -> None:
    """Raise :class:`DegJsonError` naming the offending field when ``record`` breaks the schema."""
    if isinstance(record, dict) and "format_version" in record:
        _check_format_version(record["format_version"], source)
    try:
        import jsonschema
    except ImportError:  # jsonschema is a test dependency; fall back to the essential checks
        problem = _minimal_check(record)
        if problem:
            raise DegJsonError(f"{source} does not match the deg.json schema: {problem}") from None
        return
    validator = jsonschema.Draft202012Validator(load_schema())
    error = jsonschema.exceptions.best_match(validator.iter_errors(record))
    if error is None:
        return
    field = _field_name(error.absolute_path)
    if error.validator == "required":
        missing = [k for k in error.validator_value if isinstance(error.instance, dict) and k not in error.instance]
        if missing:
            field = _field_name([*error.absolute_path, missing[0]])
            raise DegJsonError(f"{source} does not match the deg.json schema: required field '{field}' is missing")
    raise DegJsonError(f"{source} does not match the deg.json schema: field '{field}': {error.message}")


def _check_format_version(version: Any, source: str) -> None:
    if type(version) is int and version in READABLE_FORMAT_VERSIONS:
        return
    readable = ", ".join(str(v) for v in READABLE_FORMAT_VERSIONS)
    from deg_hf import __version__

    raise DegJsonError(
        f"{source} has format_version {version!r}, but deg_hf {__version__} reads format version(s) "
        f"{readable} only; upgrade deg_hf (pip install -U deg_hf) to read this checkpoint"
    )


def write_deg_json(directory: str | os.PathLike, record: Mapping[str, Any]) -> Path:
    """Redact, validate and atomically write ``deg.json`` into ``directory``; returns its path.

    Redaction here also knows the checkpoint directory, so its absolute path and those of its parents
    never reach the file. The file is written to a temporary name in the same directory and moved into
    place with ``os.replace``, so a reader sees the old record or the new one, never half of one.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    clean = redact(jsonable(dict(record)), extra_dirs=[directory])
    validate_record(clean, source=f"the record for {DEG_JSON}")
    text = json.dumps(clean, indent=2, sort_keys=False, ensure_ascii=False, allow_nan=False) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{DEG_JSON}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, directory / DEG_JSON)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return directory / DEG_JSON


def _listing(directory: Path, limit: int = 8) -> str:
    try:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    except OSError:
        return "(unreadable)"
    if not names:
        return "nothing (the directory is empty)"
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_deg_json(path_or_dir: str | os.PathLike) -> dict:
    """Read and validate a ``deg.json`` (give the file or the checkpoint directory)."""
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / DEG_JSON
        if not path.is_file():
            raise DegJsonError(
                f"{path.parent} has no {DEG_JSON}: it was not saved by deg_hf, or the save was interrupted "
                f"before the record was written (found: {_listing(path.parent)})"
            )
    elif not path.exists():
        raise DegJsonError(f"{path} does not exist: give a checkpoint directory saved by deg_hf or its {DEG_JSON}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DegJsonError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); the file is corrupt") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DegJsonError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}; the file is corrupt "
            "(an interrupted copy?)"
        ) from None
    if not isinstance(record, dict):
        raise DegJsonError(f"{path} does not hold a JSON object (found {type(record).__name__})")
    if "format_version" not in record:
        raise DegJsonError(f"{path} has no format_version: it was not written by deg_hf")
    validate_record(record, source=str(path))
    return record


def check_checkpoint(directory: str | os.PathLike, *, full: bool = False) -> Path:
    """Raise :class:`DegJsonError` unless ``directory`` holds adapter weights (with ``full=True``, a
    full fine-tune's model weights); returns the weights file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DegJsonError(f"{directory} is not a directory: give the checkpoint directory")
    if full:
        for name in FULL_MODEL_WEIGHT_FILES:
            if (directory / name).is_file() and (directory / "config.json").is_file():
                return directory / name
        raise DegJsonError(
            f"{directory} is recorded as a full fine-tune but has no model weights and config.json "
            f"({' or '.join(FULL_MODEL_WEIGHT_FILES)}); found: {_listing(directory)}"
        )
    for name in ADAPTER_WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise DegJsonError(
        f"{directory} has no adapter weights ({' or '.join(ADAPTER_WEIGHT_FILES)}); found: {_listing(directory)}"
    )


# ----------------------------------------------------------------------------------------------------
# human-readable summary
# ----------------------------------------------------------------------------------------------------


def _fmt_number(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def format_bytes(value: Any) -> str:
    """``8589934592`` -> ``"8.00 GiB"``; strings and None are returned as text."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value} B"


def memory_target_text(memory: Mapping[str, Any]) -> str | None:
    if memory.get("target_bytes") is not None:
        return format_bytes(memory["target_bytes"])
    if memory.get("target_gib") is not None:
        return f"{_fmt_number(memory['target_gib'])} GiB"
    target = memory.get("target")
    if target is None:
        return None
    if isinstance(target, (int, float)) and not isinstance(target, bool) and target >= 1024**2:
        return format_bytes(target)
    return str(target)


def memory_totals(memory: Mapping[str, Any]) -> dict[str, Any]:
    totals = dict(memory.get("totals") or {})
    for key in ("parts", "oom_retry", "oom_skip"):
        if key not in totals and key in memory:
            totals[key] = memory[key]
    return totals


def skipped_ids(memory: Mapping[str, Any]) -> list:
    for key in ("skipped_ids", "skipped_example_ids", "skipped"):
        if isinstance(memory.get(key), list):
            return memory[key]
    return []


def stream_enabled(stream: Mapping[str, Any] | None) -> bool:
    if not stream:
        return False
    return bool(stream.get("enabled", True))


def stream_layer_fetches(stream: Mapping[str, Any] | None) -> Any:
    if not stream:
        return None
    for key in ("layer_fetches", "fetches"):
        if key in stream:
            return stream[key]
    stats = stream.get("stats")
    if isinstance(stats, Mapping):
        return stats.get("layer_fetches", stats.get("fetches"))
    return None


def train_highlights(args: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The training arguments worth showing first: (label, value) pairs for those present."""
    rows = []
    for label, key in (
        ("learning rate", "learning_rate"),
        ("epochs", "num_train_epochs"),
        ("max steps", "max_steps"),
        ("batch per device", "per_device_train_batch_size"),
        ("gradient accumulation", "gradient_accumulation_steps"),
        ("max length", "max_length"),
        ("beta", "beta"),
        ("scheduler", "lr_scheduler_type"),
        ("warmup ratio", "warmup_ratio"),
        ("warmup steps", "warmup_steps"),
        ("optimizer", "optim"),
        ("bf16", "bf16"),
        ("fp16", "fp16"),
        ("gradient checkpointing", "gradient_checkpointing"),
        ("seed", "seed"),
    ):
        if key not in args:
            continue
        value = args[key]
        if key == "max_steps" and isinstance(value, int) and value <= 0:
            continue
        if key in ("warmup_ratio", "warmup_steps") and not value:
            continue
        rows.append((label, value))
    return rows


def summarize(record: Mapping[str, Any]) -> str:
    """A readable multi-line summary of a ``deg.json`` record (what ``deg-hf info`` prints)."""
    lines: list[str] = []

    def add(label: str, text: str) -> None:
        lines.append(f"{label + ':':<13}{text}")

    lines.append(
        f"deg_hf checkpoint (deg.json format {record.get('format_version')}, "
        f"written by deg_hf {record.get('deg_hf_version')})"
    )
    add("task", str(record.get("task")))
    base = record.get("base_model") or {}
    base_text = str(base.get("name_or_path"))
    if base.get("revision"):
        base_text += f" @ {base['revision']}"
    if base.get("config_sha256"):
        base_text += f" (config sha256 {str(base['config_sha256'])[:12]})"
    add("base model", base_text)

    peft = record.get("peft")
    if peft is None:
        add("adapter", "none: a full fine-tune (every weight of the base trained)")
    else:
        targets = peft.get("target_modules")
        if isinstance(targets, list):
            targets = ", ".join(targets)
        adapter = (
            f"{peft.get('type', 'LORA')} r={peft.get('r')} alpha={_fmt_number(peft.get('lora_alpha'))} "
            f"dropout={_fmt_number(peft.get('lora_dropout'))} targets={targets}"
        )
        if peft.get("default_lora_applied"):
            adapter += " (deg_hf's default LoRA: no peft_config was given, and a streamed base stays frozen)"
        add("adapter", adapter)

    data = record.get("data")
    if data:
        text = str(data.get("name_or_path") or data.get("name") or "unnamed")
        if data.get("fingerprint"):
            text += f", fingerprint {str(data['fingerprint'])[:16]}"
        sizes = data.get("sizes")
        if isinstance(sizes, Mapping) and sizes:
            text += ", " + ", ".join(f"{k} {v}" for k, v in sizes.items()) + " examples"
        add("data", text)
    else:
        add("data", "not recorded")

    args = record.get("train_args") or {}
    highlights = train_highlights(args)
    add("training", ", ".join(f"{label} {_fmt_number(v)}" for label, v in highlights) or "no arguments recorded")

    memory = record.get("memory")
    if memory:
        parts = []
        target = memory_target_text(memory)
        if target:
            parts.append(f"target {target}")
        if memory.get("scale") is not None:
            parts.append(f"scale {_fmt_number(memory['scale'])}")
        totals = memory_totals(memory)
        for key, label in (("parts", "micro-batch parts"), ("oom_retry", "OOM retries"), ("oom_skip", "OOM skips"),
                           ("trunk_forks", "trunk-and-forks pairs")):
            if key in totals:
                parts.append(f"{label} {totals[key]}")
        skipped = skipped_ids(memory)
        if skipped:
            shown = ", ".join(str(s) for s in skipped[:8]) + (" ..." if len(skipped) > 8 else "")
            parts.append(f"skipped examples [{shown}]")
        add("memory plan", "; ".join(parts) or "recorded, no details")
    else:
        add("memory plan", "not used")

    stream = record.get("stream")
    if stream_enabled(stream):
        text = "on"
        fetches = stream_layer_fetches(stream)
        if fetches is not None:
            text += f", {fetches} layer fetches"
        if stream.get("store_fingerprint"):
            text += f", store {str(stream['store_fingerprint'])[:16]}"
        add("streaming", text)
    else:
        add("streaming", "off (resident model)")

    metrics = record.get("metrics") or {}
    add("metrics", ", ".join(f"{k} {_fmt_number(v)}" for k, v in metrics.items()) or "none recorded")
    versions = record.get("versions") or {}
    add("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None) or "unknown")
    add("created", str(record.get("created_at")))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# loading a checkpoint
# ----------------------------------------------------------------------------------------------------

_DOWNLOAD_PATTERNS = [*ADAPTER_WEIGHT_FILES, "adapter_config.json", DEG_JSON, "README.md", *TOKENIZER_FILES,
                      *FULL_MODEL_WEIGHT_FILES, "model-*.safetensors", "config.json", "generation_config.json"]


def looks_like_repo_id(text: str) -> bool:
    """True when ``text`` is not an existing local path and is a valid Hub repo id."""
    if not text or os.path.exists(os.path.expanduser(text)) or text.startswith((".", "/", "~", "\\")):
        return False
    if _WINDOWS_ABS_RE.match(text):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _resolve_checkpoint(path_or_repo_id: str | os.PathLike, revision: str | None, token: str | None) -> Path:
    local = Path(os.path.expanduser(os.fspath(path_or_repo_id)))
    if local.is_dir():
        return local
    text = os.fspath(path_or_repo_id)
    if not looks_like_repo_id(text):
        raise DegJsonError(f"{text} is not a checkpoint directory (nor a Hub repo id)")
    import huggingface_hub

    return Path(
        huggingface_hub.snapshot_download(
            repo_id=text, revision=revision, token=token, allow_patterns=_DOWNLOAD_PATTERNS
        )
    )


def _is_redacted_local(name: str) -> bool:
    return name.startswith(LOCAL_PREFIX) or name == LOCAL_PREFIX.rstrip("/")


def _resolve_base(record: Mapping[str, Any], checkpoint: Path, override: str | os.PathLike | None) -> tuple[str, bool]:
    """The base model to load: (name or path, is_local_dir)."""
    if override is not None:
        override = os.fspath(override)
        return override, Path(override).is_dir()
    name = str(record["base_model"]["name_or_path"])
    redacted = _is_redacted_local(name)
    if not redacted and Path(name).is_dir():
        return name, True
    # deg.json never records a local path outside the working directory; PEFT's adapter_config.json,
    # which stays on this machine, names the directory the base was loaded from
    adapter_config = checkpoint / "adapter_config.json"
    if adapter_config.is_file():
        try:
            cfg_name = json.loads(adapter_config.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, json.JSONDecodeError, AttributeError):
            cfg_name = None
        if isinstance(cfg_name, str) and cfg_name and Path(cfg_name).is_dir():
            return cfg_name, True
    if not redacted and looks_like_repo_id(name):
        return name, False
    raise DegJsonError(
        f"the base model of this checkpoint ({name}) was a local directory that cannot be found from here; "
        "pass base_model=PATH to load()"
    )


def _base_config_hashes(base_name: str, is_local: bool, revision: str | None) -> tuple[str, set[str]]:
    """Hashes of the base config: of its config.json, and of the config as transformers reads it.

    Both are accepted, so a record hashed from ``model.config`` matches a base whose config.json was
    written by another transformers version (renamed or reordered keys).
    """
    if is_local:
        source = base_name
    else:
        import huggingface_hub

        source = huggingface_hub.hf_hub_download(base_name, "config.json", revision=revision)
    file_hash = config_sha256(source)
    hashes = {file_hash}
    try:
        from transformers import AutoConfig

        hashes.add(config_sha256(AutoConfig.from_pretrained(os.path.dirname(source) if not is_local else source)))
    except Exception:  # an unknown architecture: the file hash alone decides
        pass
    return file_hash, hashes


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


#: ``load(streamed=None)`` streams when the base weights exceed this fraction of free device memory
STREAM_FREE_FRACTION = 0.8


def _weight_bytes(directory: str | os.PathLike) -> int:
    """Bytes of a checkpoint's safetensors weight files on disk (0 without any)."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def _should_stream(base_name: str, base_is_local: bool, revision: str | None, device: Any) -> bool:
    """``streamed=None``: stream when the target device is a CUDA device and the base's weights
    would take more than 80% of its free memory (never for a base without safetensors weights,
    which cannot be streamed)."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if base_is_local:
        directory = base_name
    else:
        from deg_hf.streaming.store import StreamingError, resolve_checkpoint

        try:
            directory = resolve_checkpoint(base_name, revision)  # the weights are needed either way
        except StreamingError:  # no safetensors weights: resident is the only way
            return False
    weights = _weight_bytes(directory)
    if not weights:
        return False
    free, _total = torch.cuda.mem_get_info(device)
    return weights > STREAM_FREE_FRACTION * free


def _load_adapter_streamed(base, checkpoint: Path, device: Any):
    """Wrap a streamed base in the checkpoint's LoRA adapter and load the adapter weights.

    PEFT creates adapter parameters on their base layer's device, which is ``meta`` for streamed
    decoder layers, and loading a state dict into a ``meta`` parameter silently does nothing. So
    the adapter is created, given real storage on the runtime's device, then its weights are
    loaded and checked one by one against the file.
    """
    import torch
    from peft import MODEL_TYPE_TO_PEFT_MODEL_MAPPING, PeftConfig, PeftModel
    from peft.utils import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict

    from deg_hf.streaming.build import materialize_adapters

    config = PeftConfig.from_pretrained(str(checkpoint))
    config.inference_mode = True
    cls = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
    model = cls(base, config, "default")
    materialize_adapters(model, device)
    weights = load_peft_weights(str(checkpoint), device=str(device))
    result = set_peft_model_state_dict(model, weights, adapter_name="default")
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k or "modules_to_save" in k]
    if unexpected:
        raise DegJsonError(f"the adapter in {checkpoint} does not fit the base model: unexpected tensors {unexpected[:4]}")
    still_meta = [n for n, p in model.named_parameters() if p.is_meta and "lora_" in n]
    if still_meta:
        raise DegJsonError(f"adapter tensors were left without storage after loading: {still_meta[:4]}")
    loaded = get_peft_model_state_dict(model, adapter_name="default")
    if set(loaded) != set(weights):
        missing = sorted(set(loaded) - set(weights))[:4]
        extra = sorted(set(weights) - set(loaded))[:4]
        raise DegJsonError(
            f"the adapter in {checkpoint} does not match the model built for it (not in the file: {missing}; "
            f"not in the model: {extra})"
        )
    for key, tensor in weights.items():
        got = loaded[key]
        if got.shape != tensor.shape or not torch.equal(got.detach().to(tensor.device, tensor.dtype), tensor):
            raise DegJsonError(f"adapter tensor {key} did not load from {checkpoint}")
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _load_full(checkpoint: Path, streamed: bool | None, device: Any):
    """A full fine-tune's checkpoint is a whole model: load it as it is (streamed on request)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_checkpoint(checkpoint, full=True)
    if streamed:
        from deg_hf.streaming.build import build_streamed_model

        model, _ = build_streamed_model(str(checkpoint), device=device, progress=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
        if device is not None:
            model = model.to(device)
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(checkpoint))


def load(
    path_or_repo_id: str | os.PathLike,
    streamed: bool | None = None,
    device: Any = None,
    trust_config_mismatch: bool = False,
    *,
    base_model: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | None = None,
):
    """Load a deg_hf checkpoint (local directory or Hub repo id): returns ``(model, tokenizer)``.

    The base model named in ``deg.json`` is loaded and the adapter applied with ``peft`` (a full
    fine-tune's checkpoint, ``"peft": null``, is the whole model and is loaded as it is):

    * ``streamed=False``: resident, with ``AutoModelForCausalLM`` (on ``device`` when given, else
      where ``from_pretrained`` puts it).
    * ``streamed=True``: decoder layers stream from host memory to ``device`` (default: the
      current CUDA device, else the CPU), as in training. The runtime is ``model._deg_stream_runtime``;
      ``model._deg_stream_runtime.close()`` frees its host and device memory.
    * ``streamed=None`` (default): streamed when the target is a CUDA device and the base's weight
      files exceed 80% of its free memory, resident otherwise.

    The base's config is checked against the ``config_sha256`` recorded at training time; a
    mismatch raises :class:`DegJsonError` unless ``trust_config_mismatch=True``. ``base_model``
    overrides where the base is loaded from (needed when it was a local directory, which deg.json
    does not record, and PEFT's adapter_config.json does not point at an existing directory
    either). ``revision`` and ``token`` apply to the Hub download of the checkpoint.
    """
    checkpoint = _resolve_checkpoint(path_or_repo_id, revision, token)
    record = read_deg_json(checkpoint)
    if record.get("peft", {}) is None:
        return _load_full(checkpoint, streamed, device)
    check_checkpoint(checkpoint)
    base_name, base_is_local = _resolve_base(record, checkpoint, base_model)
    base_revision = None if base_is_local else record["base_model"].get("revision")

    expected = record["base_model"].get("config_sha256")
    if not expected:
        warnings.warn(
            "deg.json records no config_sha256 for the base model: cannot check that the base matches the adapter",
            stacklevel=2,
        )
    else:
        actual, accepted = _base_config_hashes(base_name, base_is_local, base_revision)
        if expected not in accepted and not trust_config_mismatch:
            shown = record["base_model"]["name_or_path"] if base_model is None else base_name
            raise DegJsonError(
                f"the config of base model {shown} (sha256 {actual[:12]}) differs from the one this adapter was "
                f"trained on (sha256 {expected[:12]}): pass trust_config_mismatch=True to load it anyway"
            )

    from transformers import AutoTokenizer

    kwargs = {} if base_revision is None else {"revision": base_revision}
    if streamed is None:
        streamed = _should_stream(base_name, base_is_local, base_revision, device)
    if streamed:
        from deg_hf.streaming.build import build_streamed_model

        base, runtime = build_streamed_model(base_name, device=device, revision=base_revision, progress=False)
        try:
            model = _load_adapter_streamed(base, checkpoint, runtime.device)
        except BaseException:
            runtime.close()
            raise
        model._deg_stream_runtime = runtime
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_name, **kwargs)
        model = PeftModel.from_pretrained(model, str(checkpoint))
        if device is not None:
            model = model.to(device)
    model.eval()
    tok_source = str(checkpoint) if _has_tokenizer(checkpoint) else base_name
    tokenizer = AutoTokenizer.from_pretrained(tok_source, **({} if tok_source == str(checkpoint) else kwargs))
    return model, tokenizer
