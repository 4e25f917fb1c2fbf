"""Static memory: what the weights, adapters, gradients and optimizer state hold outside
activations, the parameter counts behind it, and the host store of a streamed base (pure Python)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from deg_hf.memory.dims import ModelDims, model_dims, non_negative_int

__all__ = [
    "LORA_MODULES",
    "lora_param_count",
    "layer_param_count",
    "layer_linear_count",
    "quant_bytes_per_weight",
    "host_store_bytes",
    "static_breakdown",
    "static_bytes",
]

# Adam keeps two moments per trainable parameter.
_ADAM_STATES = 2

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
