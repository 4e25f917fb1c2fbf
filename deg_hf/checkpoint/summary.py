"""A human-readable summary of a ``deg.json`` record (what ``deg-hf info`` prints), and the readers
the model card shares with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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
    quant = base.get("quantization")
    if isinstance(quant, Mapping):
        add("base quantization", f"{str(quant.get('quant_type')).upper()} (bitsandbytes 4-bit), blocksize "
            f"{quant.get('blocksize')}, double quantization {'on' if quant.get('double_quant') else 'off'}"
            + (f", compute {quant['compute_dtype']}" if quant.get("compute_dtype") else ""))

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
