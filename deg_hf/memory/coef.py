"""The memory model: coefficients, model sizes, the activation estimate, static bytes (pure Python).

One training micro-batch ("part") of a decoder-only transformer with LoRA adapters is charged

    estimate = workspace + scale * (always + max(lm_head, layer))     (checkpointed layers)
    estimate = workspace + scale * (always + lm_head + layer)         (no checkpointing)

where every term is ``coefficient * size`` (:func:`activation_bytes`). With checkpointed layers the
LM head's tensors and one recomputed layer's working set are alive at different moments of the
backward (the head first, then the layers one by one); without checkpointing every layer's working
set is still saved when the head runs. With ``T = rows * padded_len`` decoder tokens (padding
included: a short row batched beside a long one pays the long width), ``N`` the positions the LM
head scores, ``b`` the compute dtype's bytes per element, ``L`` decoder layers, ``H`` hidden size,
``I`` MLP width, ``A`` attention heads, ``K`` key/value heads, ``D`` head dim, ``V`` vocabulary,
``P`` padded_len, and ``n`` = 1 with checkpointing or ``L`` without it, the sizes in bytes are:

    group    component          size                                what it stands for
    always   inputs             T * 8                               int64 ids, labels, mask, positions
             embed              T * H * b                           embedding output / its gradient
             boundary           L * T * H * b                       residual stream saved at each layer input
             attn_mask          M * rows * P * P * m                the 4-D mask (sdpa: bool, m=1; eager:
                                                                    float, m=b; none for one sdpa row;
                                                                    flash/flex: 0)
    layer    layer_hidden       n * T * H * b                       hidden-wide tensors of a layer
             layer_hidden_fp32  n * T * H * 4                       their fp32 parts (RMSNorm, fp32 LoRA path)
             layer_qkv          n * T * (A + 2K) * D * b            q/k/v projections, rotated copies
             layer_inter        n * T * I * b                       gate, up, activation, product, grads
             layer_inter_fp32   n * T * I * 4                       their fp32 parts (fp32 LoRA path)
             attn_scores        n * T * P * A * b                   eager attention only (0 for sdpa/flash)
             attn_bias          M * rows * P * P * n * b            sdpa: the float bias each layer call
                                                                    makes of a bool mask and saves
    lm_head  logits             N * V * b                           full head: the logits
             logits_fp32        N * V * 4                           full head: fp32 upcast, log-softmax,
                                                                    their gradients
             lm_tile            min(N, 4096) * 32768 * b            TRL fused head: one projection tile
             lm_fold            min(N, 4096) * min(V, 32768) * 4    fused head without Triton: the fp32
                                                                    temporaries torch folds a tile with
             lm_hidden          N * H * 4                           LM-head input and fp32 input gradient
             workspace          1                                   constant bytes (not scaled)

``M`` is the number of distinct attention-mask kinds (2 for models mixing sliding and full
attention). The full head scores every position of its rows; TRL's fused head
(``add_fused_lm_head``) every position but each row's last, or only the labelled ones where Triton
runs (CUDA). Its tile is TRL's ``[TOKEN_CHUNK_SIZE, _CHUNKED_LOGPROB_CHUNK_SIZE]`` buffer, 32768
columns wide whatever the vocabulary. A pair packed by prefix sharing is one decoder row
``prompt | chosen | rejected`` and two LM-head rows.

The default coefficients are a fit (``scripts/calibrate_memory.py``; see :class:`MemCoef`) to
peaks measured by the CPU tensor meter. ``scale`` is calibrated from measured peaks by
:meth:`~deg_hf.memory.planner.MemPlanner.observe`; it multiplies everything but the constant
workspace. The planner's budget is ``target_bytes - static_bytes`` in real bytes; a part fits when
its scaled estimate is at most the budget. Every coefficient is non-negative and every size only
ever adds, so the estimate is monotone non-decreasing in each size and each coefficient.

The non-activation memory (:func:`static_bytes`) is resident weights (embeddings, final norm,
an untied LM head), decoder weights in flight (``stream_buffers`` layers when streaming, all
layers otherwise), adapter parameters, their gradients and optimizer state.
"""

from __future__ import annotations

import json
import math
import operator
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = [
    "GIB",
    "MIB",
    "TRL_LM_HEAD_TILE_TOKENS",
    "TRL_LM_HEAD_TILE_VOCAB",
    "LORA_MODULES",
    "MemCoef",
    "ModelDims",
    "Features",
    "model_dims",
    "features",
    "estimate",
    "breakdown",
    "sizes",
    "activation_bytes",
    "LM_HEAD_TERMS",
    "LAYER_TERMS",
    "lora_param_count",
    "layer_param_count",
    "static_breakdown",
    "static_bytes",
    "non_negative_int",
]

MIB = 1 << 20
GIB = 1 << 30

# TRL's fused LM head (trl.kernels.chunked_logprob.ChunkedLogProbFunction) projects
# [TOKEN_CHUNK_SIZE, chunk_size] tiles, chunk_size being trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE.
TRL_LM_HEAD_TILE_TOKENS = 4096
TRL_LM_HEAD_TILE_VOCAB = 32768

# Attention kernels that never materialise the (rows, heads, P, P) score matrix.
_NO_MASK_ATTN = ("flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")
_MEMORY_EFFICIENT_ATTN = ("sdpa", *_NO_MASK_ATTN, "paged_attention")

# Adam keeps two moments per trainable parameter.
_ADAM_STATES = 2


# ----------------------------------------------------------------------------- coefficients


@dataclass
class MemCoef:
    """Non-negative multipliers of the activation-memory sizes (see the module docstring).

    Each field multiplies one size (already in bytes, the dtype included through
    ``Features.dtype_bytes``), so one file serves bf16 and fp32 runs. ``workspace`` is a constant
    in bytes.

    The defaults are ``scripts/calibrate_memory.py --device cpu``'s fit: 216 parts measured by the
    CPU tensor meter (SFT, DPO, KTO, ORPO, SimPO; prefix sharing on and off; short, long and
    length-skewed micro-batches; LoRA r=16 on every projection, no dropout) on nine tiny float32
    checkpoints (the test harness's Llama, Qwen2, Qwen3, Mistral and Gemma2, and Llama/Gemma2
    variants of hidden size 32-128, 2-6 layers, vocabularies of 64-2048). On those parts the fit
    is within 1.2% of the measured peak at the median and never more than 4.4% under (its worst
    over-estimate, +113%, is on pairs whose prompts tokenize alike and pack into one row, which the
    planner charges pair by pair). ``boundary`` is pinned to 1 (checkpointing saves each layer's
    input once). The data cannot tell a term from its fp32 twin in float32, nor the MLP's width
    from the hidden size at these shapes, so the fp32 twins and ``layer_hidden_fp32`` carry the
    weight; terms the fit set to 0 are ones the others already account for at these shapes. They were not fitted on a GPU,
    where kernels differ (flash or memory-efficient attention, a Triton fused LM head with no
    ``lm_fold``, allocator rounding, bf16): there :meth:`~deg_hf.memory.planner.MemPlanner.observe`
    calibrates the scale from every measured part, and the same script run on the GPU writes a
    file of its own for ``mem_coef_file``.
    """

    # int64 input tensors: input_ids, labels, attention_mask, position_ids
    inputs: float = 67.4092
    # embedding output (the first checkpoint input) and its gradient at the end of backward
    embed: float = 0.0
    # one saved residual-stream tensor per layer input (the checkpoint boundary)
    boundary: float = 1.0
    # hidden-wide tensors of one layer in the compute dtype: norm outputs, attention/MLP outputs
    layer_hidden: float = 0.0
    # hidden-wide fp32 tensors: RMSNorm upcasts, the fp32 LoRA path of q/k/v/o/gate/up, gradients
    layer_hidden_fp32: float = 16.0541
    # q, k, v projections and their rotated copies (width (A + 2K) * D)
    layer_qkv: float = 0.0
    # intermediate-wide tensors in the compute dtype: gate, up, act(gate), act*up, gradients
    layer_inter: float = 0.0
    # intermediate-wide fp32 tensors: down_proj's fp32 LoRA input and its gradient
    layer_inter_fp32: float = 0.0
    # eager attention: scores, softmax, probabilities (memory-efficient kernels: size 0)
    attn_scores: float = 1.6221
    # the 4-D attention mask, held through the forward and backward
    attn_mask: float = 3.5447
    # the float bias sdpa derives from a boolean mask in each layer call, saved for its backward
    attn_bias: float = 1.5926
    # full LM head: logits in the compute dtype
    logits: float = 0.0
    # full LM head: fp32 upcast for the loss, log-softmax saved for backward, the gradients
    logits_fp32: float = 4.2587
    # fused LM head: the projection tile (forward and backward each allocate one, not together)
    lm_tile: float = 0.9869
    # fused LM head without Triton (CPU): the fp32 temporaries torch folds each tile with
    lm_fold: float = 7.2978
    # LM-head input (final norm output or the fused head's copy) and the fp32 grad accumulator
    lm_hidden: float = 0.0
    # constant bytes: scalars, small per-step buffers, allocator rounding
    workspace: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            setattr(self, f.name, _check_coef(f.name, getattr(self, f.name)))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemCoef:
        """Coefficients from a mapping; missing keys keep their defaults.

        Raises ``ValueError`` naming the key for an unknown key or a value that is not a finite,
        non-negative number.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"memory coefficients must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"unknown memory coefficient {key!r} (known: {', '.join(sorted(known))})")
        return cls(**{k: _check_coef(k, v) for k, v in data.items()})

    def to_dict(self) -> dict[str, float]:
        """Every coefficient by name (what :meth:`save` writes)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MemCoef:
        """Read a JSON object of coefficients (partial files are fine)."""
        with open(path, encoding="utf-8") as fh:
            try:
                data = json.load(fh)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{os.fspath(path)}: not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every coefficient as a JSON object."""
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=2, sort_keys=True)
            fh.write("\n")


def _check_coef(name: str, value: Any) -> float:
    # bool is an int subclass; `true` in a JSON file is a mistake, not a coefficient
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"memory coefficient {name!r} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"memory coefficient {name!r} must be finite and >= 0, got {value!r}")
    return value


# ----------------------------------------------------------------------------- model dimensions


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


# ----------------------------------------------------------------------------- features


@dataclass(frozen=True)
class Features:
    """Sizes of one micro-batch (a "part") for :func:`estimate`; build with :func:`features`.

    ``tokens`` is the number of positions the decoder computes (``rows * padded_len`` with
    padding); ``lm_tokens`` the number the LM head scores. ``prompt_tokens`` and
    ``completion_tokens`` are recorded for logs; only ``lm_tokens`` enters the estimate.
    ``streaming`` is recorded too: it moves weights (see :func:`static_bytes`), not activations.
    """

    rows: int
    padded_len: int
    tokens: int
    lm_tokens: int
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 4
    mask_kinds: int = 1
    lm_head_tile_tokens: int = TRL_LM_HEAD_TILE_TOKENS
    lm_head_tile_vocab: int = TRL_LM_HEAD_TILE_VOCAB
    checkpointing: bool = True
    streaming: bool = True
    fused_lm_head: bool = False
    lm_head_compact: bool = True
    attn_implementation: str = "sdpa"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# the integer sizes the estimate is monotone in
SIZE_FIELDS = (
    "rows", "padded_len", "tokens", "lm_tokens", "hidden", "intermediate", "layers", "vocab",
    "heads", "kv_heads", "head_dim", "dtype_bytes", "mask_kinds", "lm_head_tile_tokens",
    "lm_head_tile_vocab",
)  # fmt: skip


def features(
    model_config: Any,
    *,
    rows: int,
    padded_len: int,
    tokens: int | None = None,
    lm_rows: int | None = None,
    lm_width: int | None = None,
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    streaming: bool = True,
    checkpointing: bool = True,
    fused_lm_head: bool = False,
    lm_head_compact: bool = True,
    lm_head_tile: int = TRL_LM_HEAD_TILE_TOKENS,
    lm_head_tile_vocab: int = TRL_LM_HEAD_TILE_VOCAB,
    dtype_bytes: int = 4,
    attn_implementation: str = "sdpa",
) -> Features:
    """Sizes of a part of ``rows`` rows padded to ``padded_len`` tokens.

    ``model_config`` is a config.json dict, a config object or :class:`ModelDims`. ``tokens``
    overrides ``rows * padded_len`` (padding-free packing: one row of the summed lengths). The LM
    head scores ``lm_rows`` rows padded to ``lm_width`` (default: the decoder's rows; a packed pair
    is scored as its two unpacked rows). The full head scores every position; TRL's fused head
    every position but the last of each row, or only the ``completion_tokens`` labelled ones where
    Triton runs (CUDA, ``lm_head_compact``).
    """
    dims = model_dims(model_config)
    rows, padded_len = non_negative_int("rows", rows), non_negative_int("padded_len", padded_len)
    lm_head_tile = non_negative_int("lm_head_tile", lm_head_tile)
    lm_head_tile_vocab = non_negative_int("lm_head_tile_vocab", lm_head_tile_vocab)
    dtype_bytes = non_negative_int("dtype_bytes", dtype_bytes)
    n_tok = rows * padded_len if tokens is None else non_negative_int("tokens", tokens)
    if lm_rows is None and lm_width is None:
        lm_rows, lm_tokens = rows, n_tok
    else:
        lm_rows = rows if lm_rows is None else non_negative_int("lm_rows", lm_rows)
        lm_width = padded_len if lm_width is None else non_negative_int("lm_width", lm_width)
        lm_tokens = lm_rows * lm_width
    if fused_lm_head:
        lm_tokens = max(0, lm_tokens - lm_rows)  # labels shift left: a row's last position is never scored
        if lm_head_compact and completion_tokens is not None:
            lm_tokens = min(lm_tokens, non_negative_int("completion_tokens", completion_tokens))
    if prompt_tokens is not None:
        non_negative_int("prompt_tokens", prompt_tokens)
    return Features(
        rows=rows,
        padded_len=padded_len,
        tokens=n_tok,
        lm_tokens=lm_tokens,
        hidden=dims.hidden,
        intermediate=dims.intermediate,
        layers=dims.layers,
        vocab=dims.vocab,
        heads=dims.heads,
        kv_heads=dims.kv_heads,
        head_dim=dims.head_dim,
        dtype_bytes=dtype_bytes,
        mask_kinds=dims.mask_kinds,
        lm_head_tile_tokens=lm_head_tile,
        lm_head_tile_vocab=lm_head_tile_vocab,
        checkpointing=checkpointing,
        streaming=streaming,
        fused_lm_head=fused_lm_head,
        lm_head_compact=lm_head_compact,
        attn_implementation=attn_implementation,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )


# ----------------------------------------------------------------------------- the estimate


def _mask_bytes(f: Features) -> tuple[int, int]:
    """(bytes held once, bytes saved per live layer) per mask element."""
    impl = f.attn_implementation
    if impl in _NO_MASK_ATTN or "flash" in impl:
        return 0, 0  # varlen kernels take cu_seqlens; flex builds a small block mask
    if impl == "sdpa":
        # a boolean mask, turned into a float bias by every sdpa call and saved for its backward
        return 1, f.dtype_bytes
    return f.dtype_bytes, 0  # eager and unknown kernels: an additive float mask


def _materialises_scores(f: Features) -> bool:
    impl = f.attn_implementation
    return not (impl in _MEMORY_EFFICIENT_ATTN or "flash" in impl)


def sizes(f: Features) -> dict[str, int]:
    """Exact integer sizes (bytes at coefficient 1) per component."""
    b = f.dtype_bytes
    t = f.tokens
    live = 1 if f.checkpointing else f.layers
    qkv_width = (f.heads + 2 * f.kv_heads) * f.head_dim
    full = not f.fused_lm_head
    held, per_layer = _mask_bytes(f)
    kinds = f.mask_kinds
    if f.attn_implementation == "sdpa" and f.rows <= 1:
        # one row has no padding: transformers skips the full-attention mask and lets sdpa run
        # is_causal (a sliding-window mask, if any, is still counted)
        kinds -= 1
    return {
        "inputs": t * 8,
        "embed": t * f.hidden * b,
        "boundary": f.layers * t * f.hidden * b,
        "layer_hidden": live * t * f.hidden * b,
        "layer_hidden_fp32": live * t * f.hidden * 4,
        "layer_qkv": live * t * qkv_width * b,
        "layer_inter": live * t * f.intermediate * b,
        "layer_inter_fp32": live * t * f.intermediate * 4,
        "attn_scores": live * t * f.padded_len * f.heads * b if _materialises_scores(f) else 0,
        "attn_mask": kinds * f.rows * f.padded_len * f.padded_len * held,
        "attn_bias": kinds * f.rows * f.padded_len * f.padded_len * live * per_layer,
        "logits": f.lm_tokens * f.vocab * b if full else 0,
        "logits_fp32": f.lm_tokens * f.vocab * 4 if full else 0,
        "lm_tile": 0 if full else min(f.lm_tokens, f.lm_head_tile_tokens) * f.lm_head_tile_vocab * b,
        "lm_fold": 0 if full or f.lm_head_compact else (min(f.lm_tokens, f.lm_head_tile_tokens)
                                                       * min(f.vocab, f.lm_head_tile_vocab) * 4),
        "lm_hidden": f.lm_tokens * f.hidden * 4,
        "workspace": 1,
    }


def breakdown(features: Features, coef: MemCoef | None = None) -> dict[str, int]:
    """Unscaled bytes per component: ``ceil(coefficient * size)``, keyed by coefficient name."""
    coef = MemCoef() if coef is None else coef
    return {name: math.ceil(getattr(coef, name) * size) for name, size in sizes(features).items()}


#: components alive while the LM head runs (its forward and, later, its backward)
LM_HEAD_TERMS = ("logits", "logits_fp32", "lm_tile", "lm_fold", "lm_hidden")
#: components of one decoder layer's working set (under checkpointing: the layer being recomputed)
LAYER_TERMS = ("layer_hidden", "layer_hidden_fp32", "layer_qkv", "layer_inter", "layer_inter_fp32",
               "attn_scores", "attn_bias")


def activation_bytes(parts: Mapping[str, int], checkpointing: bool = True) -> int:
    """The scaled part of the estimate from :func:`breakdown` (``workspace`` left out).

    Under checkpointing the LM head's tensors and a recomputed layer's working set are alive at
    different moments of the backward (the head first, then the layers one by one), so the
    larger of the two counts; without checkpointing every layer's working set is still saved
    when the head runs, and both count. The other terms (inputs, embeddings, layer boundaries,
    the held mask) are alive throughout.
    """
    head = sum(parts.get(k, 0) for k in LM_HEAD_TERMS)
    layer = sum(parts.get(k, 0) for k in LAYER_TERMS)
    rest = sum(v for k, v in parts.items() if k != "workspace" and k not in LM_HEAD_TERMS and k not in LAYER_TERMS)
    return rest + (max(head, layer) if checkpointing else head + layer)


def estimate(features: Features, coef: MemCoef | None = None, scale: float = 1.0) -> int:
    """Activation bytes of one forward+backward: ``workspace + ceil(scale * activation_bytes)``."""
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be finite and >= 0, got {scale!r}")
    parts = breakdown(features, coef)
    rest = activation_bytes(parts, features.checkpointing)
    return parts["workspace"] + (rest if scale == 1.0 else math.ceil(scale * rest))


# ----------------------------------------------------------------------------- static memory

# LoRA target name -> (in features, out features) as a function of the dims
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linear_shapes(d: ModelDims) -> dict[str, tuple[int, int]]:
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    inter = d.dense_intermediate or d.intermediate
    return {
        "q_proj": (d.hidden, q),
        "k_proj": (d.hidden, kv),
        "v_proj": (d.hidden, kv),
        "o_proj": (q, d.hidden),
        "gate_proj": (d.hidden, inter),
        "up_proj": (d.hidden, inter),
        "down_proj": (inter, d.hidden),
    }


def lora_param_count(model_config: Any, r: int, target_modules: str | Iterable[str] = "all-linear") -> int:
    """LoRA parameters (``r * (in + out)`` per targeted projection per layer) of a dense decoder.

    ``target_modules`` is ``"all-linear"`` (all seven projections, as PEFT does, LM head excluded)
    or names among :data:`LORA_MODULES` (``"q"`` is accepted for ``"q_proj"``). MoE expert weights
    are not counted.
    """
    d = model_dims(model_config)
    non_negative_int("r", r)
    shapes = _linear_shapes(d)
    if isinstance(target_modules, str):
        names = list(LORA_MODULES) if target_modules == "all-linear" else [target_modules]
    else:
        names = list(target_modules)
    per_layer = 0
    for name in dict.fromkeys(names):  # PEFT wraps each module once
        key = name if name in shapes else f"{name}_proj"
        if key not in shapes:
            raise ValueError(f"unknown LoRA target module {name!r} (known: {', '.join(LORA_MODULES)})")
        fan_in, fan_out = shapes[key]
        per_layer += r * (fan_in + fan_out)
    return per_layer * d.layers


def layer_param_count(model_config: Any) -> int:
    """Weights of one decoder layer: attention, MLP (or experts + router) and two norms."""
    d = model_dims(model_config)
    s = _linear_shapes(d)
    attn = sum(s[k][0] * s[k][1] for k in ("q_proj", "k_proj", "v_proj", "o_proj"))
    if d.experts:
        mlp = d.experts * 3 * d.hidden * d.expert_intermediate + d.hidden * d.experts
        mlp += 3 * d.hidden * d.shared_intermediate
    else:
        mlp = sum(s[k][0] * s[k][1] for k in ("gate_proj", "up_proj", "down_proj"))
    return attn + mlp + 2 * d.hidden


def _optimizer_state_bytes(optimizer: str, trainable_dtype_bytes: float) -> float:
    name = optimizer.lower()
    if name in ("sgd", "none") or name.startswith("adafactor"):
        return 0.0  # plain SGD keeps nothing; Adafactor's factored moments are negligible here
    if "8bit" in name:
        return _ADAM_STATES * 1.0  # two 8-bit moments (block scales are negligible)
    if "lion" in name:
        return 1.0 * trainable_dtype_bytes  # one momentum
    return _ADAM_STATES * trainable_dtype_bytes  # Adam(W) and anything unknown: two moments


def quant_bytes_per_weight(blocksize: int = 64, double: bool = True) -> float:
    """Host and transfer bytes per 4-bit weight as bitsandbytes stores it: half a byte packed, plus
    its block's absmax (fp32 per ``blocksize`` weights; with double quantization one byte, plus an
    fp32 absmax per 256 blocks). Per-tensor constants (code books, offset) are left out."""
    if blocksize < 1:
        raise ValueError(f"blocksize must be >= 1, got {blocksize!r}")
    return 0.5 + (1 / blocksize + 4 / (blocksize * 256) if double else 4 / blocksize)


def layer_linear_count(model_config: Any) -> int:
    """Weights of one decoder layer that sit in Linear layers (what bitsandbytes quantizes): all but
    the norms."""
    return layer_param_count(model_config) - 2 * model_dims(model_config).hidden


def host_store_bytes(model_config: Any, *, dtype_bytes: float = 2, quant_bytes_per_weight: float | None = None) -> int:
    """The host store of every decoder layer: Linear weights at ``quant_bytes_per_weight`` when 4-bit
    (norms stay at ``dtype_bytes``), else everything at ``dtype_bytes``."""
    d = model_dims(model_config)
    linear = layer_linear_count(d)
    wb = dtype_bytes if quant_bytes_per_weight is None else quant_bytes_per_weight
    return math.ceil(d.layers * (linear * wb + (layer_param_count(d) - linear) * dtype_bytes))


def static_breakdown(
    model_config: Any,
    *,
    streaming: bool = True,
    stream_buffers: int = 2,
    lora_params: int = 0,
    optimizer: str = "adamw",
    dtype_bytes: float = 2,
    trainable_dtype_bytes: float = 4,
    weight_dtype_bytes: float | None = None,
    quant_bytes_per_weight: float | None = None,
) -> dict[str, int]:
    """Device bytes held outside activations, per component.

    ``resident``: embeddings, final norm and an untied LM head in ``dtype_bytes``. ``layers``:
    decoder weights in ``weight_dtype_bytes`` (default ``dtype_bytes``), either ``stream_buffers``
    layers in flight when streaming or all of them. ``adapters``, ``grads`` and ``optimizer``: LoRA
    parameters, their gradients (both in ``trainable_dtype_bytes``) and the optimizer state (Adam:
    two moments).

    With ``quant_bytes_per_weight`` (a 4-bit base, :func:`quant_bytes_per_weight`) the layers' Linear
    weights are counted at that many bytes (norms at ``dtype_bytes``), and a ``dequantized`` entry is
    added: streamed, each buffer's compute buffer holding its layer's Linear weights dequantized to
    ``dtype_bytes``; resident (bitsandbytes' QLoRA), the largest weight dequantized for one matmul.
    """
    d = model_dims(model_config)
    wb = dtype_bytes if weight_dtype_bytes is None else weight_dtype_bytes
    for name, value in (("dtype_bytes", dtype_bytes), ("trainable_dtype_bytes", trainable_dtype_bytes),
                        ("weight_dtype_bytes", wb)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    non_negative_int("stream_buffers", stream_buffers)
    non_negative_int("lora_params", lora_params)
    embed = d.vocab * d.hidden * (1 if d.tie_word_embeddings else 2)
    in_flight = min(stream_buffers, d.layers) if streaming else d.layers
    out = {
        "resident": math.ceil((embed + d.hidden) * dtype_bytes),
        "layers": math.ceil(in_flight * layer_param_count(d) * wb),
        "adapters": math.ceil(lora_params * trainable_dtype_bytes),
        "grads": math.ceil(lora_params * trainable_dtype_bytes),
        "optimizer": math.ceil(lora_params * _optimizer_state_bytes(optimizer, trainable_dtype_bytes)),
    }
    if quant_bytes_per_weight is not None:
        linear = layer_linear_count(d)
        out["layers"] = math.ceil(in_flight * (linear * quant_bytes_per_weight
                                               + (layer_param_count(d) - linear) * dtype_bytes))
        if streaming:
            out["dequantized"] = math.ceil(in_flight * linear * dtype_bytes)
        else:
            out["dequantized"] = math.ceil(max(a * b for a, b in _linear_shapes(d).values()) * dtype_bytes)
    return out


def static_bytes(model_config: Any, **kwargs: Any) -> int:
    """Sum of :func:`static_breakdown` (same keyword arguments)."""
    return sum(static_breakdown(model_config, **kwargs).values())
