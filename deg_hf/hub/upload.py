"""What a push uploads from a checkpoint directory, and the scan of it for tokens, local paths and
outward symlinks before anything leaves the machine."""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from deg_hf.checkpoint import (
    ADAPTER_WEIGHT_FILES,
    DEG_JSON,
    FULL_MODEL_WEIGHT_FILES,
    TOKENIZER_FILES,
)
from deg_hf.hub.card import README

TRAIN_LOG = "train.log.jsonl"
#: files uploaded when present (exact names, top level of the checkpoint directory)
UPLOAD_FILES = (
    *ADAPTER_WEIGHT_FILES,
    "adapter_config.json",
    *TOKENIZER_FILES,
    DEG_JSON,
    README,
    TRAIN_LOG,
)
#: uploaded in place of the adapter files when the checkpoint is a full fine-tune
FULL_MODEL_FILES = (*FULL_MODEL_WEIGHT_FILES, "model-*.safetensors", "config.json", "generation_config.json")
#: uploaded only with ``include_optimizer=True`` (names or glob patterns)
OPTIMIZER_FILES = ("optimizer.pt", "scheduler.pt", "rng_state*.pth", "trainer_state.json")
#: never uploaded, whatever the other lists say
NEVER_UPLOAD = ("training_args.bin",)

_HF_TOKEN_BYTES_RE = re.compile(rb"hf_[A-Za-z0-9]{30,}")
# metadata files whose string values are checked for local paths that exist on this machine
_PATH_CHECKED_JSON = ("adapter_config.json", DEG_JSON, "trainer_state.json")
_CHUNK = 8 * 1024 * 1024
# an absolute path in text: two or more components after a root ("/data/run", "C:\\Users\\me"), not
# the tail of a URL ("https://host/a/b") nor a relative path ("data/run")
_ABSOLUTE_PATH_RE = re.compile(r"(?<![\w.:/~\\%-])/[\w.@+-]+/[\w.@+/-]*|\b[A-Za-z]:(?:\\\\|\\|/)[\w.@+ -]+")
_BINARY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model")
# vocabularies: their tokens may look like paths ("/usr/bin" is a token of code tokenizers)
_VOCABULARY_FILES = ("vocab.json", "vocab.txt", "merges.txt")

def select_upload_files(checkpoint_dir: str | os.PathLike, *, include_optimizer: bool = False,
                        full: bool = False) -> list[str]:
    """Names of the top-level files of ``checkpoint_dir`` that a push uploads, sorted (with
    ``full=True``, a full fine-tune's model files too)."""
    directory = Path(checkpoint_dir)
    allowed = list(UPLOAD_FILES) + (list(OPTIMIZER_FILES) if include_optimizer else [])
    allowed += list(FULL_MODEL_FILES) if full else []
    chosen = []
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name in NEVER_UPLOAD:
            continue
        if any(fnmatch.fnmatchcase(path.name, pattern) for pattern in allowed):
            chosen.append(path.name)
    return chosen


def _known_tokens(token: str | None) -> list[str]:
    candidates = [token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]
    try:
        import huggingface_hub

        candidates.append(huggingface_hub.get_token())
    except Exception:  # no token store, a failed OIDC exchange...: the other sources remain
        pass
    # short strings would match by chance; a real token is far longer
    return sorted({c for c in candidates if isinstance(c, str) and len(c) >= 8})


def _needle_variants(path: str) -> set[bytes]:
    variants = {path, json.dumps(path)[1:-1]}
    return {v.encode("utf-8") for v in variants}


def _local_path_needles(checkpoint_dir: Path) -> dict[bytes, str]:
    """Byte strings that betray a local path, mapped to what they are (for the error message)."""
    needles: dict[bytes, str] = {}
    for variant in {os.path.abspath(checkpoint_dir), os.path.realpath(checkpoint_dir)}:
        for needle in _needle_variants(variant):
            needles[needle] = f"the local path of the checkpoint directory ({variant})"
    home = os.path.expanduser("~")
    if home and home != "~" and os.path.isabs(home) and os.path.normpath(home) not in ("/", "\\"):
        home = os.path.normpath(home)
        for variant in {home, os.path.realpath(home)}:
            for needle in _needle_variants(variant):
                needles.setdefault(needle, f"your home directory ({variant})")
    return needles


def _read_chunks(data: bytes | Path, overlap: int) -> Iterable[bytes]:
    """The bytes worth scanning: a safetensors file's JSON header only, any other file whole."""
    if isinstance(data, bytes):
        yield data
        return
    with data.open("rb") as handle:
        if data.suffix == ".safetensors":
            head = handle.read(8)
            if len(head) == 8:
                size = int.from_bytes(head, "little")
                if 0 < size <= 100 * 1024 * 1024:
                    yield handle.read(size)
                    return
            handle.seek(0)
        tail = b""
        while True:
            block = handle.read(_CHUNK)
            if not block:
                return
            yield tail + block
            tail = block[-overlap:] if overlap else b""


def _json_local_paths(value: Any, key: str = "") -> Iterable[tuple[str, str]]:
    if isinstance(value, str):
        if os.path.isabs(value) and len(Path(value).parts) >= 3 and os.path.exists(value):
            yield key, value
    elif isinstance(value, list):
        for item in value:
            yield from _json_local_paths(item, key)
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _json_local_paths(item, str(k))


def _text_to_scan(name: str, data: bytes) -> str | None:
    """The text of an uploaded file in which absolute paths are looked for: None for binary files
    and pure vocabularies (whose tokens may look like paths); a tokenizer.json without its vocabulary."""
    if name.endswith(_BINARY_SUFFIXES) or name in _VOCABULARY_FILES:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if name == "tokenizer.json":
        try:
            content = json.loads(text)
            model = content.get("model")
            if isinstance(model, dict):
                content["model"] = {k: v for k, v in model.items() if k not in ("vocab", "merges")}
            return json.dumps(content, ensure_ascii=False)
        except (ValueError, AttributeError):
            return text
    return text


def _outward_symlink(directory: Path, name: str) -> str | None:
    """Where ``name`` leads when it is a symlink out of ``directory`` (None when it stays inside)."""
    path = directory / name
    if not path.is_symlink():
        return None
    root = os.path.realpath(directory)
    target = os.path.realpath(path)
    return None if os.path.commonpath([root, target]) == root else target


def scan_for_secrets(checkpoint_dir: str | os.PathLike, files: Iterable[str], *, token: str | None = None,
                     contents: Mapping[str, bytes] | None = None) -> None:
    r"""Raise ``ValueError`` when a file to upload holds a Hub token or a local absolute path, or is a
    symlink leading out of the checkpoint.

    Looks for the known token (``token``, ``HF_TOKEN``, the stored login) and anything shaped like a
    Hub token; in every text file, any absolute local path (``/a/b...``, ``C:\...``), and in binary
    files the checkpoint directory's and the home directory's absolute paths; in ``adapter_config.json``,
    ``deg.json`` and ``trainer_state.json``, any string that is an existing local path. ``contents``
    gives the bytes of files uploaded from memory (the model card) instead of from the directory.
    The token itself is never echoed.
    """
    directory = Path(checkpoint_dir)
    contents = dict(contents or {})
    tokens = [t.encode("utf-8") for t in _known_tokens(token)]
    needles = _local_path_needles(directory)
    overlap = max([len(n) for n in [*tokens, *needles]] + [64])
    problems: list[str] = []
    for name in files:
        found: list[str] = []
        source = contents.get(name)
        if source is None:
            target = _outward_symlink(directory, name)
            if target is not None:
                problems.append(f"{name} is a symlink to {target}, outside the checkpoint (copy the file in to "
                                "upload it)")
                continue
            source = directory / name
        for chunk in _read_chunks(source, overlap):
            if any(t in chunk for t in tokens):
                found.append("your Hugging Face token")
            elif _HF_TOKEN_BYTES_RE.search(chunk):
                found.append("a Hugging Face token (hf_...)")
            found.extend(what for needle, what in needles.items() if needle in chunk)
        size = len(source) if isinstance(source, bytes) else source.stat().st_size
        if size <= 64 * 1024 * 1024:
            data = source if isinstance(source, bytes) else source.read_bytes()
            paths: dict[str, str] = {}
            text = _text_to_scan(name, data)
            if text is not None:
                for match in _ABSOLUTE_PATH_RE.finditer(text):
                    paths.setdefault(match.group(0), f"the local path {match.group(0)}")
            if name in _PATH_CHECKED_JSON:
                try:
                    content = json.loads(data.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    content = None
                for key, value in _json_local_paths(content):
                    paths[value] = f"the local path {value} (key '{key}')"
            found.extend(paths.values())
        if found:
            problems.append(f"{name} contains {', '.join(dict.fromkeys(found))}")
    if problems:
        hint = ""
        if any(p.startswith("adapter_config.json") for p in problems):
            hint = "; set base_model_name_or_path in adapter_config.json to the base model's Hub id"
        raise ValueError(f"refusing to upload {directory.name} (nothing was sent or changed): " + "; ".join(problems)
                         + hint)
