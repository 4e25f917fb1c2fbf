"""4-bit (NF4 / FP4) decoder weights in the host store, quantized and dequantized by bitsandbytes.

A quantized weight lives in its layer's flat block as the pieces bitsandbytes' ``quantize_4bit``
produces: the packed 4-bit values, the per-block ``absmax`` (itself 8-bit quantized with double
quantization, with its own ``absmax``, code and offset), and the 16-value code. These are exactly the
bytes transformers keeps in a ``Params4bit`` (and saves in a pre-quantized checkpoint), so a
checkpoint quantized here and one quantized by transformers hold the same bytes.

A fetch copies the block to the device (one copy, a quarter of the bf16 bytes) and dequantizes each
weight there, with bitsandbytes' own dequantization ops called as its 4-bit matmul calls them, into
an ordinary compute-dtype buffer. The layer then runs unchanged: its backward is an ordinary matmul
with the dequantized weight, and no bitsandbytes autograd function ever holds a reference to a
streaming buffer (the defect in design.md's pitfalls cannot arise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from deg_hf.config import QUANT_BLOCKSIZES as BLOCKSIZES
from deg_hf.config import QUANT_TYPES

NESTED_BLOCKSIZE = 256  # bitsandbytes' block size for double quantization of absmax
SEP = "#"  # piece names: "<weight>#packed", "<weight>#absmax", ... ('#' never occurs in module names)

NF4_EXTRA = "pip install 'deg_hf[nf4]'"


def require_bitsandbytes():
    """bitsandbytes, or an ImportError that names the extra to install."""
    try:
        import bitsandbytes  # noqa: F401
        from bitsandbytes import functional
    except ImportError as exc:
        raise ImportError(
            f"4-bit streaming needs bitsandbytes, which is not installed: {NF4_EXTRA} "
            f"(or pip install 'bitsandbytes>=0.50'). ({exc})"
        ) from exc
    return functional


@dataclass(frozen=True)
class QuantSpec:
    """How the store quantizes decoder weights it reads at full precision."""

    quant_type: str = "nf4"
    blocksize: int = 64
    double: bool = True
    #: module-name patterns transformers would not convert (``llm_int8_skip_modules``); None: its defaults
    skip_modules: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"stream_quantization must be one of {QUANT_TYPES} or None, got {self.quant_type!r}")
        if self.blocksize not in BLOCKSIZES:
            raise ValueError(f"stream_quant_blocksize must be one of {BLOCKSIZES}, got {self.blocksize!r}")

    def tag(self) -> str:
        """Part of a cache key: every setting that changes the stored bytes."""
        skip = "" if self.skip_modules is None else "-skip" + ",".join(sorted(self.skip_modules))
        return f"{self.quant_type}-b{self.blocksize}-{'dq' if self.double else 'sq'}{skip}"


@dataclass(frozen=True)
class QuantMeta:
    """One 4-bit weight inside a layer block: what its dequantization needs besides the pieces."""

    shape: tuple[int, ...]  # the weight's own shape, [out_features, in_features]
    dtype: torch.dtype  # the dtype it was quantized from
    quant_type: str
    blocksize: int
    nested: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def piece_entries(name: str, meta: QuantMeta) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(piece name, shape, dtype)`` of every tensor a 4-bit weight is stored as, sized from its shape
    alone (the store allocates before quantizing)."""
    n = meta.numel
    blocks = -(-n // meta.blocksize)
    entries = [
        (f"{name}{SEP}packed", ((n + 1) // 2, 1), torch.uint8),
        (f"{name}{SEP}absmax", (blocks,), torch.uint8 if meta.nested else torch.float32),
        (f"{name}{SEP}code", (16,), torch.float32),
    ]
    if meta.nested:
        entries += [
            (f"{name}{SEP}nested_absmax", (-(-blocks // NESTED_BLOCKSIZE),), torch.float32),
            (f"{name}{SEP}nested_code", (256,), torch.float32),
            (f"{name}{SEP}offset", (), torch.float32),
        ]
    return entries


def quantize_into(weight: torch.Tensor, name: str, meta: QuantMeta, views: dict[str, torch.Tensor]) -> None:
    """Quantize ``weight`` (already in ``meta.dtype``) with bitsandbytes and write its pieces."""
    F = require_bitsandbytes()
    packed, state = F.quantize_4bit(
        weight, blocksize=meta.blocksize, compress_statistics=meta.nested, quant_type=meta.quant_type
    )
    got = {f"{name}{SEP}packed": packed.view(torch.uint8).view(-1, 1), f"{name}{SEP}absmax": state.absmax,
           f"{name}{SEP}code": state.code}
    if meta.nested:
        got[f"{name}{SEP}nested_absmax"] = state.state2.absmax
        got[f"{name}{SEP}nested_code"] = state.state2.code
        got[f"{name}{SEP}offset"] = state.offset
    for key, value in got.items():
        dst = views[key]
        if dst.shape != value.shape or dst.dtype != value.dtype:
            raise RuntimeError(  # bitsandbytes changed its layout: never store bytes we cannot read back
                f"bitsandbytes produced {key} as {tuple(value.shape)} {value.dtype}, the store expected "
                f"{tuple(dst.shape)} {dst.dtype}; this bitsandbytes version is not supported by deg_hf"
            )
        dst.copy_(value)


def quantize_chunked(
    weight: torch.Tensor, name: str, meta: QuantMeta, views: dict[str, torch.Tensor], chunk: int
) -> None:
    """:func:`quantize_into`, a ``chunk`` of elements at a time, with the same bytes as a whole-tensor
    call: 4-bit blocks are independent, and double quantization runs once over the whole ``absmax``
    as bitsandbytes runs it. Bounds the host quantizer's temporaries (several times the chunk in
    fp32 and int32) whatever the size of the weight."""
    n = weight.numel()
    if n <= chunk:
        return quantize_into(weight, name, meta, views)
    F = require_bitsandbytes()
    step = max(meta.blocksize, chunk // meta.blocksize * meta.blocksize)  # whole blocks, an even count
    flat = weight.reshape(-1)
    packed = views[f"{name}{SEP}packed"].view(-1)
    absmax = torch.empty(-(-n // meta.blocksize), dtype=torch.float32)
    code = None
    for lo in range(0, n, step):
        p, state = F.quantize_4bit(flat[lo : lo + step], blocksize=meta.blocksize, compress_statistics=False,
                                   quant_type=meta.quant_type)
        packed[lo // 2 : lo // 2 + p.numel()].copy_(p.view(torch.uint8).view(-1))
        absmax[lo // meta.blocksize : lo // meta.blocksize + state.absmax.numel()].copy_(state.absmax)
        code = state.code
    views[f"{name}{SEP}code"].copy_(code)
    if not meta.nested:
        views[f"{name}{SEP}absmax"].copy_(absmax)
        return
    offset = absmax.mean()
    qabsmax, state2 = F.quantize_blockwise(absmax - offset, blocksize=NESTED_BLOCKSIZE)
    views[f"{name}{SEP}absmax"].copy_(qabsmax)
    views[f"{name}{SEP}nested_absmax"].copy_(state2.absmax)
    views[f"{name}{SEP}nested_code"].copy_(state2.code)
    views[f"{name}{SEP}offset"].copy_(offset)


def dequantize_into(name: str, meta: QuantMeta, views: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Dequantize one weight from its pieces (on their device) into ``out`` (any float dtype), with
    the ops bitsandbytes' own 4-bit matmul uses, so a streamed layer sees the weight a resident
    QLoRA layer computes with."""
    ops = torch.ops.bitsandbytes
    absmax = views[f"{name}{SEP}absmax"]
    if meta.nested:
        absmax = ops.dequantize_blockwise.default(
            absmax, views[f"{name}{SEP}nested_absmax"], views[f"{name}{SEP}nested_code"], NESTED_BLOCKSIZE,
            torch.float32,
        ) + views[f"{name}{SEP}offset"]
    packed = views[f"{name}{SEP}packed"]
    if out.device.type == "cuda":
        ops.dequantize_4bit.out(packed, absmax, meta.blocksize, meta.quant_type, list(meta.shape), out.dtype, out=out)
    else:  # the CPU backend has no out= variant
        out.copy_(ops.dequantize_4bit.default(packed, absmax, meta.blocksize, meta.quant_type, list(meta.shape), out.dtype))
    return out


# ----------------------------------------------------------------------------- pre-quantized checkpoints

#: the tensors transformers saves beside a 4-bit weight ``<module>.weight``, and the pieces they fill
PREQUANTIZED_SUFFIXES = {
    "absmax": "absmax",
    "quant_map": "code",
    "nested_absmax": "nested_absmax",
    "nested_quant_map": "nested_code",
}


def prequantized_state_key(source, weight_key: str) -> str | None:
    """The key of the packed JSON quant state saved beside ``weight_key``, or None if not 4-bit."""
    for quant_type in QUANT_TYPES:
        key = f"{weight_key}.quant_state.bitsandbytes__{quant_type}"
        if key in source:
            return key
    return None


def read_prequantized_meta(source, weight_key: str) -> QuantMeta:
    """The :class:`QuantMeta` of a weight saved 4-bit by transformers, from its packed JSON state."""
    state = _unpack_state(source.read(prequantized_state_key(source, weight_key)))
    nested = "nested_blocksize" in state
    if nested and int(state["nested_blocksize"]) != NESTED_BLOCKSIZE:
        raise ValueError(
            f"{weight_key}: double quantization with block size {state['nested_blocksize']} is not supported "
            f"(bitsandbytes' 4-bit kernels use {NESTED_BLOCKSIZE})"
        )
    return QuantMeta(
        shape=tuple(int(s) for s in state["shape"]), dtype=getattr(torch, state["dtype"]),
        quant_type=state["quant_type"], blocksize=int(state["blocksize"]), nested=nested,
    )


def read_prequantized_into(source, weight_key: str, name: str, meta: QuantMeta, views: dict[str, torch.Tensor]) -> None:
    """Copy a pre-quantized weight's saved tensors into its pieces: no full-precision copy is made."""
    packed = views[f"{name}{SEP}packed"]
    raw = source.read(weight_key)
    packed.copy_(raw.view(-1).view(torch.uint8).view(packed.shape))
    for suffix, piece in PREQUANTIZED_SUFFIXES.items():
        key = f"{name}{SEP}{piece}"
        if key in views:
            source.read(f"{weight_key}.{suffix}", out=views[key])
    if meta.nested:
        state = _unpack_state(source.read(prequantized_state_key(source, weight_key)))
        views[f"{name}{SEP}offset"].fill_(float(state["nested_offset"]))


def _unpack_state(tensor: torch.Tensor) -> dict:
    # bitsandbytes packs the non-tensor quant state as the UTF-8 bytes of a JSON object in a uint8 tensor
    return json.loads(bytes(tensor.view(torch.uint8).tolist()).decode("utf-8"))


def bnb_config_dict(cfg) -> dict:
    """A ``BitsAndBytesConfig`` (object or dict, e.g. from config.json) as a plain dict."""
    if cfg is None:
        return {}
    if isinstance(cfg, dict):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(vars(cfg))


def method_of(cfg: dict) -> str:
    """A readable name for a quantization config's method (``bitsandbytes-4bit``, ``gptq``, ...)."""
    method = str(cfg.get("quant_method", "")).lower().split(".")[-1].replace("_", "")
    if method == "bitsandbytes" or "load_in_4bit" in cfg or "load_in_8bit" in cfg:
        if cfg.get("load_in_4bit"):
            return "bitsandbytes-4bit"
        if cfg.get("load_in_8bit"):
            return "bitsandbytes-8bit"
        return "bitsandbytes"
    return method or "unknown"


def resolve_spec(settings, quantization_config) -> QuantSpec | None:
    """The 4-bit storage asked for, by the stream settings and by a ``quantization_config``
    (``BitsAndBytesConfig`` or its dict), as one answer; None for the training dtype.

    A ``BitsAndBytesConfig(load_in_4bit=True, ...)`` means what it means to transformers: its quant
    type, double quantization and skip list apply. ``stream_quantization``, when also set, must agree.
    Other methods are refused, saying what to pass instead."""
    wanted = getattr(settings, "stream_quantization", None)
    blocksize = int(getattr(settings, "stream_quant_blocksize", 64))
    cfg = bnb_config_dict(quantization_config)
    if not cfg:
        if not wanted:
            return None
        return QuantSpec(wanted, blocksize, bool(getattr(settings, "stream_quant_double", True)))
    method = method_of(cfg)
    if method == "bitsandbytes-8bit":
        raise ValueError(
            "quantization_config asks for 8-bit (LLM.int8, load_in_8bit), which layer streaming cannot run: "
            "its matmul needs the int8 weights and their outlier columns inside bitsandbytes' own layers. "
            "Use 4-bit (BitsAndBytesConfig(load_in_4bit=True) or stream_quantization='nf4'), or "
            "stream_layers=False to train it resident."
        )
    if method != "bitsandbytes-4bit":
        raise ValueError(
            f"quantization_config ({method}) cannot be applied by layer streaming, which stores weights 4-bit "
            "with bitsandbytes only. Use BitsAndBytesConfig(load_in_4bit=True) or stream_quantization='nf4', "
            "or stream_layers=False to load it as transformers does."
        )
    quant_type = str(cfg.get("bnb_4bit_quant_type") or "fp4")  # BitsAndBytesConfig's own default
    if wanted and wanted != quant_type:
        raise ValueError(
            f"stream_quantization={wanted!r} and quantization_config's bnb_4bit_quant_type={quant_type!r} "
            "disagree; set one of them (or make them equal)."
        )
    skip = cfg.get("llm_int8_skip_modules")
    return QuantSpec(quant_type, blocksize, bool(cfg.get("bnb_4bit_use_double_quant", False)),
                     tuple(skip) if skip else None)


def compute_dtype_of(quantization_config) -> torch.dtype | None:
    """``bnb_4bit_compute_dtype`` of a quantization config, as a torch dtype (None when absent)."""
    value = bnb_config_dict(quantization_config).get("bnb_4bit_compute_dtype")
    if isinstance(value, str):
        value = getattr(torch, value.replace("torch.", ""), None)
    return value if isinstance(value, torch.dtype) else None


def resident_config(spec: QuantSpec, dtype: torch.dtype | None):
    """The ``BitsAndBytesConfig`` that loads a resident model as ``spec`` stores a streamed one."""
    from transformers import BitsAndBytesConfig

    require_bitsandbytes()
    if spec.blocksize != 64:
        raise ValueError(
            f"stream_quant_blocksize={spec.blocksize} applies to streaming only: transformers' 4-bit loading "
            "uses blocks of 64. Use 64 with stream_layers=False."
        )
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=spec.quant_type, bnb_4bit_use_double_quant=spec.double,
        bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=list(spec.skip_modules) if spec.skip_modules else None,
    )
