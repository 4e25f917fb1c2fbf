"""The activation estimate of the memory model and its coefficients (pure Python). Model sizes are
read in :mod:`deg_hf.memory.dims`; weights, adapters and optimizer state in :mod:`deg_hf.memory.static`.

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
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from deg_hf.memory.dims import model_dims, non_negative_int

__all__ = [
    "GIB",
    "MIB",
    "TRL_LM_HEAD_TILE_TOKENS",
    "TRL_LM_HEAD_TILE_VOCAB",
    "MemCoef",
    "Features",
    "features",
    "estimate",
    "breakdown",
    "sizes",
    "activation_bytes",
    "LM_HEAD_TERMS",
    "LAYER_TERMS",
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
