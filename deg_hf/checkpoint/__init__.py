"""The checkpoint record (``deg.json``): build, redact, validate, write, read, summarise and load.

Every checkpoint saved by a deg_hf trainer carries a ``deg.json`` next to the adapter weights. It
records what was trained (task, base model, adapter), how (every training argument, the streaming
settings, the memory plan and the out-of-memory recoveries), on what (data name and fingerprint),
with what result (metrics) and with which library versions.

The package follows those steps: :mod:`~deg_hf.checkpoint.redact` (JSON conversion, local paths
and secrets removed), :mod:`~deg_hf.checkpoint.build` (the record), :mod:`~deg_hf.checkpoint.io`
(format constants, schema, atomic write, read), :mod:`~deg_hf.checkpoint.summary` (``deg-hf info``)
and :mod:`~deg_hf.checkpoint.loading` (``deg_hf.load``). Every public name is importable from
``deg_hf.checkpoint`` itself.

It is import-light on purpose: only the standard library at module level, so ``deg-hf info`` and
``import deg_hf`` never pay for torch, transformers, PEFT or TRL. jsonschema, huggingface_hub,
transformers and PEFT are imported inside the functions that need them.
"""

from __future__ import annotations

from deg_hf.checkpoint.build import collect_versions, config_sha256, make_record
from deg_hf.checkpoint.io import (
    ADAPTER_WEIGHT_FILES,
    DEG_JSON,
    FORMAT_VERSION,
    FULL_MODEL_WEIGHT_FILES,
    READABLE_FORMAT_VERSIONS,
    TASKS,
    TOKENIZER_FILES,
    DegJsonError,
    check_checkpoint,
    load_schema,
    read_deg_json,
    validate_record,
    write_deg_json,
)
from deg_hf.checkpoint.loading import STREAM_FREE_FRACTION, load, looks_like_repo_id
from deg_hf.checkpoint.loading import _should_stream as _should_stream
from deg_hf.checkpoint.loading import _weight_bytes as _weight_bytes
from deg_hf.checkpoint.redact import LOCAL_PREFIX, REDACTED, jsonable, redact
from deg_hf.checkpoint.summary import (
    format_bytes,
    memory_target_text,
    memory_totals,
    skipped_ids,
    stream_enabled,
    stream_layer_fetches,
    summarize,
    train_highlights,
)

__all__ = [
    "DEG_JSON",
    "FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "TASKS",
    "ADAPTER_WEIGHT_FILES",
    "FULL_MODEL_WEIGHT_FILES",
    "TOKENIZER_FILES",
    "LOCAL_PREFIX",
    "REDACTED",
    "STREAM_FREE_FRACTION",
    "DegJsonError",
    "make_record",
    "jsonable",
    "redact",
    "config_sha256",
    "collect_versions",
    "load_schema",
    "write_deg_json",
    "read_deg_json",
    "validate_record",
    "check_checkpoint",
    "format_bytes",
    "memory_target_text",
    "memory_totals",
    "skipped_ids",
    "stream_enabled",
    "stream_layer_fetches",
    "train_highlights",
    "summarize",
    "looks_like_repo_id",
    "load",
]
