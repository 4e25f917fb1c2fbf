"""Redaction: JSON-native conversion of any value, and removal of local paths and secrets.

A written ``deg.json`` never contains a local absolute path or a Hub token. Absolute paths are
rewritten relative to the current working directory when they lie under it, otherwise to
``<local>/<basename>``; strings that look like a Hub token, and string values under keys that name a
token or a secret, become ``"<redacted>"``; ``hub_token`` and ``push_to_hub_token`` are dropped.
"""

from __future__ import annotations

import enum
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

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
