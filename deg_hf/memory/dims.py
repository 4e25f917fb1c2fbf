"""The few sizes of a decoder-only transformer that the memory model needs, read from its config
(a ``PretrainedConfig``, its ``to_dict()``, or a ``config.json`` dict; pure Python)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelDims", "model_dims", "non_negative_int"]

@dataclass(frozen=True)
class ModelDims:
    """The few sizes of a decoder-only transformer the estimate needs."""

    hidden: int
    intermediate: int  # activation width of the MLP per token (routed experts included)
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    mask_kinds: int = 1  # distinct attention-mask kinds (sliding + full: 2)
    experts: int = 0  # routed experts per MoE layer (0: dense MLP)
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    dense_intermediate: int = 0  # the config's intermediate_size (dense MLP width)


_ALIASES = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "vocab_size": ("vocab_size",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
    "head_dim": ("head_dim",),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "layer_types": ("layer_types",),
    "experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_tok",),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "n_shared_experts": ("n_shared_experts",),
}


def _raw(cfg: Any, key: str) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key)
    return getattr(cfg, key, None)


def _text_config(cfg: Any) -> Any:
    """The language-model part of a (possibly multimodal) config."""
    if cfg is None:
        raise ValueError("model_config is required")
    if not isinstance(cfg, Mapping):
        getter = getattr(cfg, "get_text_config", None)
        if callable(getter):  # transformers.PretrainedConfig
            try:
                return getter()
            except TypeError:
                pass
    if _raw(cfg, "hidden_size") is None:
        for key in ("text_config", "language_config", "llm_config"):
            sub = _raw(cfg, key)
            if sub is not None:
                return sub
    return cfg


def _lookup(text: Any, top: Any, name: str) -> Any:
    # the text sub-config first; multimodal configs keep e.g. tie_word_embeddings at the top
    for cfg in (text, top):
        for key in _ALIASES[name]:
            value = _raw(cfg, key)
            if value is not None:
                return value
    return None


def non_negative_int(name: str, value: Any) -> int:
    """``value`` as a non-negative int (numpy/torch integers welcome, bools and floats not)."""
    try:
        out = operator.index(value)
    except TypeError:
        out = None
    if isinstance(value, bool) or out is None or out < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return out


def model_dims(model_config: Any) -> ModelDims:
    """Read the sizes from a config.json dict or a config object (``text_config`` honoured).

    ``hidden_size``, ``num_hidden_layers`` and ``vocab_size`` are required; the rest default
    like a Llama config (``intermediate_size = 4 H``, 128-wide heads, no grouped-query attention,
    untied embeddings, which is the larger choice). For MoE configs the per-token MLP activation
    width is ``experts_per_tok * expert_intermediate + shared_intermediate``.
    """
    if isinstance(model_config, ModelDims):
        return model_config
    text = _text_config(model_config)
    top = model_config
    got: dict[str, int] = {}
    for name in ("hidden_size", "num_hidden_layers", "vocab_size"):
        value = _lookup(text, top, name)
        if value is None:
            raise ValueError(f"model config has no {name}")
        got[name] = non_negative_int(name, value)
    hidden = got["hidden_size"]
    heads = _lookup(text, top, "num_attention_heads")
    heads = max(1, hidden // 128) if heads is None else max(1, non_negative_int("num_attention_heads", heads))
    kv = _lookup(text, top, "num_key_value_heads")
    kv = heads if kv is None else non_negative_int("num_key_value_heads", kv)
    head_dim = _lookup(text, top, "head_dim")
    head_dim = hidden // heads if head_dim is None else non_negative_int("head_dim", head_dim)
    inter = _lookup(text, top, "intermediate_size")
    inter = 4 * hidden if inter is None else non_negative_int("intermediate_size", inter)
    tie = _lookup(text, top, "tie_word_embeddings")
    layer_types = _lookup(text, top, "layer_types")
    attn_kinds = {t for t in layer_types or () if isinstance(t, str) and "attention" in t}
    experts = _lookup(text, top, "experts")
    experts = 0 if experts is None else non_negative_int("num_experts", experts)
    per_tok = non_negative_int("num_experts_per_tok", _lookup(text, top, "num_experts_per_tok") or 0)
    expert_inter = non_negative_int("moe_intermediate_size", _lookup(text, top, "moe_intermediate_size") or inter)
    shared = _lookup(text, top, "shared_expert_intermediate_size")
    if shared is None:
        shared = non_negative_int("n_shared_experts", _lookup(text, top, "n_shared_experts") or 0) * expert_inter
    shared = non_negative_int("shared_expert_intermediate_size", shared)
    act_inter = inter
    if experts and per_tok:
        act_inter = max(inter, per_tok * expert_inter + shared)
    return ModelDims(
        hidden=hidden,
        intermediate=act_inter,
        layers=got["num_hidden_layers"],
        vocab=got["vocab_size"],
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=bool(tie),
        mask_kinds=max(1, len(attn_kinds)),
        experts=experts if per_tok else 0,
        expert_intermediate=expert_inter if experts and per_tok else 0,
        shared_intermediate=shared if experts and per_tok else 0,
        dense_intermediate=inter,
    )
