"""The ``deg.json`` file: its format constants, schema validation, atomic writing and reading."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from deg_hf.checkpoint.redact import jsonable, redact

FORMAT_VERSION = 1
DEG_JSON = "deg.json"
#: format versions this deg_hf can read
READABLE_FORMAT_VERSIONS = (1,)
TASKS = ("sft", "dpo", "kto", "orpo", "simpo")
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
#: what a full fine-tune's checkpoint holds instead (one file, or a sharded index)
FULL_MODEL_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
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
