"""Up-front checks of a base model's files, before any weight is read.

:func:`check_model_files` is what the streamed builder runs once it has read ``config.json``:

* the config describes a decoder-only causal LM (:func:`causal_lm_problem`, which ``deg-hf plan``
  shares: it reads the config as a dict and needs no torch);
* every safetensors file the checkpoint lists exists and is whole: its header parses and the tensor
  data it promises is exactly what the file holds (a truncated download or a half-copied file is
  named here, not met later as a raw error from the middle of a load);
* every tensor the model uses has the shape ``config.json`` implies (the first mismatch is named);
* the checkpoint holds no tensor the model would not use (weights for more layers than
  ``config.json`` declares would otherwise train a smaller model silently).

Only headers are read. A checkpoint whose config declares a ``quantization_config`` stores packed
tensors whose shapes are not the model's, so its shapes and names are not compared here.

Module level imports are the standard library only: ``deg-hf plan`` imports this module.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

#: bytes per element of each safetensors dtype (sub-byte and unknown dtypes are not size-checked)
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
               "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
#: the largest header a safetensors file may declare (the format's own limit)
_MAX_HEADER = 100 * 1024 * 1024
#: encoder families transformers can also build as a causal LM head (as a decoder only when
#: config.is_decoder is set); a checkpoint of theirs is an encoder
_ENCODER_FAMILIES = frozenset({
    "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie", "data2vec-text",
    "roberta-prelayernorm", "rembert", "megatron-bert", "xmod", "big_bird", "bert-generation", "qdqbert",
})
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")
_LAYER_INDEX_RE = re.compile(r"\.layers\.(\d+)\.")


class ModelFileError(ValueError):
    """A base model whose files cannot be trained as they are; the message names the file or tensor."""


def causal_lm_problem(config: Mapping[str, Any]) -> str | None:
    """Why ``config`` (a config.json as a dict) is not a decoder-only causal LM, or None when it is."""
    model_type = str(config.get("model_type") or "unknown")
    if config.get("is_encoder_decoder"):
        return f"model_type {model_type!r} is an encoder-decoder model"
    if model_type in _ENCODER_FAMILIES and not config.get("is_decoder"):
        return f"model_type {model_type!r} is an encoder"
    architectures = config.get("architectures") or []
    if architectures and not any(str(a).endswith(_CAUSAL_SUFFIXES) for a in architectures):
        return f"its architectures ({', '.join(map(str, architectures))}) have no causal LM head"
    return None


def check_causal_lm(config: Any, source: str) -> None:
    """Raise :class:`ModelFileError` unless ``config`` (a dict or a ``PretrainedConfig``) is a
    decoder-only causal LM that transformers can build as one."""
    values = config if isinstance(config, Mapping) else config.to_dict()
    problem = causal_lm_problem(values)
    if problem is None and not isinstance(config, Mapping):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if values.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            problem = f"transformers has no causal LM class for model_type {values.get('model_type')!r}"
    if problem:
        raise ModelFileError(
            f"{source} is not a decoder-only causal LM: {problem}. deg_hf trains causal language models "
            "(Llama, Qwen, Mistral, Gemma, ...); give such a model's directory or Hub id."
        )


def read_header(path: str) -> dict:
    """The tensor entries of a safetensors file's header, after checking that the file is whole:
    the header parses and the data it promises is exactly the data the file holds."""
    name = os.path.basename(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ModelFileError(
                    f"{name} in {os.path.dirname(path)} is not a whole safetensors file ({size} bytes, too short "
                    "for the header it declares): it is truncated or corrupt; download or copy it again"
                )
            raw = fh.read(length)
    except FileNotFoundError:
        raise ModelFileError(
            f"{name} is listed by {os.path.dirname(path)}'s model.safetensors.index.json but missing; download "
            "the checkpoint again"
        ) from None
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelFileError(
            f"{name} in {os.path.dirname(path)} has a corrupt safetensors header ({exc}); download or copy it again"
        ) from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - length
    end = 0
    for key, entry in tensors.items():
        try:
            start, stop = (int(x) for x in entry["data_offsets"])
            shape = [int(x) for x in entry["shape"]]
            dtype = str(entry["dtype"])
        except (KeyError, TypeError, ValueError):
            raise ModelFileError(f"{name}: the header entry of tensor {key} is malformed; the file is corrupt") from None
        count = 1
        for dim in shape:
            count *= dim
        if dtype in _ITEM_BYTES and stop - start != count * _ITEM_BYTES[dtype]:
            raise ModelFileError(f"{name}: tensor {key} ({dtype} {shape}) does not match its byte range; the file "
                                 "is corrupt")
        end = max(end, stop)
    if end != data:
        what = "truncated" if end > data else "longer than its header says"
        raise ModelFileError(
            f"{name} in {os.path.dirname(path)} is {what}: its header promises {end} bytes of tensor data, the "
            f"file holds {data}. Download or copy it again."
        )
    return tensors


def check_model_files(directory: str, config: Any, *, source: str | None = None) -> None:
    """Check a local checkpoint directory against its ``config`` (a ``PretrainedConfig``) before
    any weight is read; raise :class:`ModelFileError` naming the first problem."""
    from deg_hf.streaming.store import safetensors_files

    source = source or directory
    check_causal_lm(config, source)
    entries: dict[str, tuple[str, list[int]]] = {}
    for path in safetensors_files(directory):
        for key, entry in read_header(path).items():
            entries[key] = (os.path.basename(path), [int(x) for x in entry["shape"]])
    if getattr(config, "quantization_config", None):
        return  # packed quantized tensors: their shapes are not the model's
    expected, ignored = _expected_tensors(config)
    for key, shape in expected.items():
        if key in entries and entries[key][1] != shape:
            file, found = entries[key]
            raise ModelFileError(
                f"{source}: tensor {key} in {file} has shape {found}, but config.json implies {shape}. The weights "
                "and config.json belong to different models; use the config.json saved with these weights."
            )
    unexpected = sorted(k for k in entries if k not in expected and not any(p.search(k) for p in ignored))
    if unexpected:
        hint = ""
        layers = {int(m.group(1)) for k in entries if (m := _LAYER_INDEX_RE.search(k))}
        declared = _text_config(config).__dict__.get("num_hidden_layers")
        if layers and declared is not None and max(layers) + 1 > declared:
            hint = (f" The weights hold {max(layers) + 1} decoder layers, config.json declares "
                    f"num_hidden_layers={declared}.")
        raise ModelFileError(
            f"{source} holds {len(unexpected)} tensor(s) the model built from config.json would not use "
            f"(first: {unexpected[0]} in {entries[unexpected[0]][0]}).{hint} Training would silently use part of "
            "the checkpoint; use the config.json saved with these weights."
        )


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _expected_tensors(config) -> tuple[dict[str, list[int]], list[re.Pattern]]:
    """Names and shapes of every tensor a causal LM built from ``config`` loads (built on ``meta``),
    and the patterns of checkpoint names transformers ignores when loading it."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: list(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    patterns = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])]
    return expected, patterns
