"""The model card of a checkpoint, rendered from its ``deg.json``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deg_hf.checkpoint import (
    LOCAL_PREFIX,
    memory_target_text,
    memory_totals,
    redact,
    skipped_ids,
    stream_enabled,
    stream_layer_fetches,
    train_highlights,
)

README = "README.md"
_TEMPLATE = "model_card_template.md"
# a dataset name that ends like a file is a local file, not a Hub id
_DATA_FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet", ".arrow", ".txt", ".tsv", ".gz", ".zst")
_TASK_DESCRIPTIONS = {
    "sft": "supervised fine-tuning",
    "dpo": "Direct Preference Optimization",
    "kto": "Kahneman-Tversky Optimization",
    "orpo": "Odds Ratio Preference Optimization",
    "simpo": "Simple Preference Optimization",
}

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
