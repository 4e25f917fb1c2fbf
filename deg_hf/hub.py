"""Model cards and pushing checkpoints to the Hugging Face Hub.

``push_checkpoint`` uploads a deliberately short list of files from a checkpoint directory: the
adapter (a full fine-tune's model files instead), the tokenizer, ``deg.json``, a ``README.md`` model
card written from it and the training log; optimizer, scheduler and RNG state only on request; ``training_args.bin`` (a pickle of the
arguments, Hub token included) never. Everything is checked before the first remote call: the repo
id, the record, the adapter weights, and that no file to upload holds a Hub token or a local path or
is a symlink out of the checkpoint. The card is rendered into the upload: a push never writes to
the checkpoint directory.

huggingface_hub is imported inside the functions, so importing this module stays cheap.
"""

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
    LOCAL_PREFIX,
    TOKENIZER_FILES,
    DegJsonError,
    check_checkpoint,
    memory_target_text,
    memory_totals,
    read_deg_json,
    redact,
    skipped_ids,
    stream_enabled,
    stream_layer_fetches,
    train_highlights,
)

__all__ = [
    "UPLOAD_FILES",
    "OPTIMIZER_FILES",
    "NEVER_UPLOAD",
    "model_card",
    "write_model_card",
    "select_upload_files",
    "scan_for_secrets",
    "HubUnreachableError",
    "push_checkpoint",
]

README = "README.md"
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

_TEMPLATE = "model_card_template.md"
_HF_TOKEN_BYTES_RE = re.compile(rb"hf_[A-Za-z0-9]{30,}")
# metadata files whose string values are checked for local paths that exist on this machine
_PATH_CHECKED_JSON = ("adapter_config.json", DEG_JSON, "trainer_state.json")
_DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt", ".tsv", ".gz", ".zst")
_TASK_DESCRIPTIONS = {
    "sft": "supervised fine-tuning",
    "dpo": "Direct Preference Optimization",
    "kto": "Kahneman-Tversky Optimization",
    "orpo": "Odds Ratio Preference Optimization",
    "simpo": "Simple Preference Optimization",
}
_CHUNK = 8 * 1024 * 1024
# an absolute path in text: two or more components after a root ("/data/run", "C:\\Users\\me"), not
# the tail of a URL ("https://host/a/b") nor a relative path ("data/run")
_ABSOLUTE_PATH_RE = re.compile(r"(?<![\w.:/~\\%-])/[\w.@+-]+/[\w.@+/-]*|\b[A-Za-z]:(?:\\\\|\\|/)[\w.@+ -]+")
_BINARY_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model")
# vocabularies: their tokens may look like paths ("/usr/bin" is a token of code tokenizers)
_VOCABULARY_FILES = ("vocab.json", "vocab.txt", "merges.txt")


# ----------------------------------------------------------------------------------------------------
# model card
# ----------------------------------------------------------------------------------------------------


def _hub_id(name: Any, *, data: bool = False) -> str | None:
    """``name`` when it reads as a Hub repo id (not a redacted or existing local path), else None."""
    if not isinstance(name, str) or not name or name.startswith((LOCAL_PREFIX.rstrip("/"), ".", "/", "~")):
        return None
    if os.path.exists(name) or "\\" in name:
        return None
    if data and name.lower().endswith(_DATA_FILE_SUFFIXES):
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def _cell(value: Any) -> str:
    """A value as one markdown table cell."""
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value, ensure_ascii=False)
    else:
        text = str(value)
    text = text.replace("\n", " ").replace("|", "\\|")
    return f"`{text}`" if text.strip() == "" else text


def _template_path() -> Path:
    from importlib import resources

    return Path(str(resources.files("deg_hf").joinpath(_TEMPLATE)))


def model_card(
    record: Mapping[str, Any],
    *,
    repo_id: str | None = None,
    license: str | None = None,
    tokenizer_in_repo: bool = True,
):
    """A ``huggingface_hub.ModelCard`` describing the checkpoint recorded in ``record``.

    The metadata names the base model (when it is a Hub id), ``library_name: peft`` (``transformers``
    for a full fine-tune), the ``text-generation`` pipeline, tags (``deg-hf``, the task, the adapter
    type and ``peft``, or ``full-fine-tune``, and ``trl``) and the dataset (when it is a Hub id). ``tokenizer_in_repo`` says whether the load snippet takes the
    tokenizer from the adapter repo or from the base model.
    """
    from huggingface_hub import ModelCard, ModelCardData

    record = redact(dict(record))
    task = str(record.get("task", "sft"))
    base = record.get("base_model") or {}
    base_name = str(base.get("name_or_path"))
    base_id = _hub_id(base_name)
    full = record.get("peft", {}) is None  # a full fine-tune: the checkpoint holds every weight
    peft = record.get("peft") or {}
    peft_type = str(peft.get("type") or "LORA")
    data = record.get("data") or {}
    data_name = data.get("name_or_path") or data.get("name")
    data_id = _hub_id(data_name, data=True)

    tags = ["deg-hf", task, "full-fine-tune", "trl"] if full else ["deg-hf", task, peft_type.lower(), "peft", "trl"]
    card_data = ModelCardData(
        base_model=base_id,
        library_name="transformers" if full else "peft",
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(tags)),
        datasets=[data_id] if data_id else None,
        license=license,
    )

    targets = peft.get("target_modules")
    if isinstance(targets, list):
        targets = ", ".join(f"`{t}`" for t in targets)
    args = record.get("train_args") or {}
    train_rows = [(label, _cell(value)) for label, value in train_highlights(args)]
    if not train_rows:
        train_rows = [("(none recorded)", "")]

    memory = record.get("memory") or {}
    memory_rows: list[tuple[str, str]] = []
    if memory:
        target = memory_target_text(memory)
        if target:
            memory_rows.append(("Memory target", _cell(target)))
        if memory.get("scale") is not None:
            memory_rows.append(("Plan scale", _cell(memory["scale"])))
        totals = memory_totals(memory)
        for key, label in (
            ("parts", "Micro-batch parts run"),
            ("oom_retry", "Out-of-memory retries"),
            ("oom_skip", "Examples skipped after out-of-memory"),
            ("trunk_forks", "Pairs run as prompt trunk and completion forks"),
        ):
            if key in totals:
                memory_rows.append((label, _cell(totals[key])))
        sharing = memory.get("prefix_sharing")
        if isinstance(sharing, dict) and sharing.get("tokens_rows"):
            memory_rows.append(("Prefix sharing: tokens run / in rows",
                                _cell(f"{sharing.get('tokens_packed', 0)} / {sharing['tokens_rows']}")))
        skipped = skipped_ids(memory)
        if skipped:
            memory_rows.append(("Skipped example ids", _cell(skipped[:32]) + (" ..." if len(skipped) > 32 else "")))
        if not memory_rows:
            memory_rows.append(("Plan", "recorded in deg.json"))
    stream = record.get("stream")
    quant = base.get("quantization") if isinstance(base.get("quantization"), Mapping) else None

    sizes = data.get("sizes")
    sizes_text = ", ".join(f"{v} {k} examples" for k, v in sizes.items()) if isinstance(sizes, Mapping) else ""
    load_id = repo_id or "<repo_id>"
    kind = "full fine-tune" if full else f"{peft_type} adapter"
    title = repo_id.split("/")[-1] if repo_id else f"{base_name.split('/')[-1]} {task.upper()} {kind}"
    kwargs = {
        "full_fine_tune": full,
        "title": title,
        "task": task,
        "task_upper": task.upper(),
        "task_description": _TASK_DESCRIPTIONS.get(task, task),
        "base_model_name": base_name,
        "base_model_link": f"https://huggingface.co/{base_id}" if base_id else None,
        "base_revision": base.get("revision"),
        "peft_type": "LoRA" if peft_type.upper() == "LORA" else peft_type,
        "peft_r": peft.get("r"),
        "peft_alpha": peft.get("lora_alpha"),
        "peft_dropout": peft.get("lora_dropout"),
        "peft_targets": targets,
        "default_lora_applied": bool(peft.get("default_lora_applied")),
        "data_name": data_id or data_name,
        "data_fingerprint": data.get("fingerprint"),
        "data_sizes": sizes_text,
        "train_rows": train_rows,
        "memory_rows": memory_rows,
        "streaming": stream_enabled(stream),
        "layer_fetches": stream_layer_fetches(stream),
        "metric_rows": [(str(k), _cell(v)) for k, v in (record.get("metrics") or {}).items()],
        "version_rows": [(k, v) for k, v in (record.get("versions") or {}).items() if v is not None],
        "load_id": load_id,
        "tokenizer_source": load_id if tokenizer_in_repo else base_name,
        "base_quant": None if quant is None else {
            "type": str(quant.get("quant_type", "nf4")).upper(),
            "quant_type": quant.get("quant_type", "nf4"),
            "blocksize": quant.get("blocksize", 64),
            "double": bool(quant.get("double_quant")),
            "compute_dtype": quant.get("compute_dtype"),
        },
        "created_at": record.get("created_at"),
        "deg_hf_version": record.get("deg_hf_version"),
    }
    return ModelCard.from_template(card_data, template_path=str(_template_path()), **kwargs)


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def write_model_card(
    directory: str | os.PathLike,
    record: Mapping[str, Any],
    *,
    repo_id: str | None = None,
    license: str | None = None,
) -> Path:
    """Write (or refresh) ``README.md`` in ``directory`` from ``record``; returns its path."""
    directory = Path(directory)
    card = model_card(record, repo_id=repo_id, license=license, tokenizer_in_repo=_has_tokenizer(directory))
    path = directory / README
    tmp = directory / f".{README}.tmp"
    tmp.write_text(str(card), encoding="utf-8")
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------------
# what is uploaded, and the scan before it
# ----------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------
# push
# ----------------------------------------------------------------------------------------------------


class HubUnreachableError(ConnectionError):
    """The Hub could not be reached (no network, offline mode, a wrong endpoint)."""


def is_network_error(exc: BaseException) -> bool:
    """True for the failures of reaching a server at all (not for answers such as 404 or 401)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(exc, (OfflineModeIsEnabled, TimeoutError, ConnectionError)):
        return True
    # huggingface_hub's HTTP client (httpx) raises its own transport errors
    return any(c.__name__ in ("TransportError", "TimeoutException") for c in type(exc).__mro__)


def unreachable(exc: BaseException, what: str) -> HubUnreachableError:
    """One line naming the endpoint and what to check, for a network failure ``exc`` during ``what``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    endpoint = constants.ENDPOINT
    reason = " ".join(str(exc).split())[:160] or type(exc).__name__
    transport = any(c.__name__ in ("TransportError", "TimeoutException") for c in type(exc).__mro__)
    if isinstance(exc, OfflineModeIsEnabled) or (constants.HF_HUB_OFFLINE and not transport):
        return HubUnreachableError(f"cannot {what}: offline mode is on (HF_HUB_OFFLINE is set); unset it to reach "
                                   f"the Hub at {endpoint}")
    return HubUnreachableError(f"cannot {what}: the Hub at {endpoint} cannot be reached ({reason}); check your "
                               "network connection, or HF_ENDPOINT if you use a mirror")


def _validate_repo_id(repo_id: Any) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: give 'name' or 'namespace/name'")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: {exc}") from None


def push_checkpoint(
    checkpoint_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    include_optimizer: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a deg_hf checkpoint to the Hub model repo ``repo_id``; returns the repo URL.

    Before any remote call: the repo id is validated (``ValueError``), ``deg.json`` is read and
    validated and the adapter weights and ``adapter_config.json`` must be present
    (:class:`~deg_hf.checkpoint.DegJsonError`), the ``README.md`` model card is rendered from the
    record (into the upload: the checkpoint directory is never written to), and every file to upload,
    the card included, is scanned for tokens, local paths and symlinks leading out of the checkpoint
    (``ValueError``). Then the repo is created if needed (and the branch ``revision``) and the files
    are uploaded in one commit. A network failure raises :class:`HubUnreachableError`, naming the
    endpoint.
    """
    _validate_repo_id(repo_id)
    directory = Path(checkpoint_dir)
    record = read_deg_json(directory)
    full = record.get("peft", {}) is None
    check_checkpoint(directory, full=full)
    if not full and not (directory / "adapter_config.json").is_file():
        raise DegJsonError(f"{directory} has adapter weights but no adapter_config.json: PEFT cannot load it")
    card = model_card(record, repo_id=repo_id, tokenizer_in_repo=_has_tokenizer(directory))
    contents = {README: str(card).encode("utf-8")}
    files = sorted(set(select_upload_files(directory, include_optimizer=include_optimizer, full=full)) | {README})
    scan_for_secrets(directory, files, token=token, contents=contents)

    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=contents.get(name, str(directory / name)))
        for name in files
    ]
    kind = "full fine-tune" if full else "adapter"
    message = commit_message or f"Upload {record['task'].upper()} {kind} trained with deg_hf"
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        full_id = getattr(repo_url, "repo_id", None) or repo_id
        if revision:
            api.create_branch(full_id, branch=revision, repo_type="model", exist_ok=True)
        api.create_commit(full_id, operations, commit_message=message, repo_type="model", revision=revision)
    except Exception as exc:
        if is_network_error(exc):
            raise unreachable(exc, f"push {directory.name} to {repo_id}") from None
        raise
    url = str(repo_url) if repo_url else f"{api.endpoint.rstrip('/')}/{full_id}"
    if revision:
        url = f"{url.rstrip('/')}/tree/{revision}"
    return url
