"""Host-memory store of a checkpoint's decoder-layer weights.

Each decoder layer is held as ONE flat, contiguous byte block (pinned when CUDA is present) plus a
layout (piece name -> offset, shape, dtype). A fetch to the device is then a single copy per layer,
and the device side carves the same views out of a flat buffer of the same size.

A block holds the layer's tensors at the training dtype, or, with 4-bit quantization
(:mod:`deg_hf.streaming.quant`), its Linear weights as bitsandbytes' packed 4-bit pieces beside the
small tensors (norms, biases) at the training dtype. Weights are quantized while the store fills,
one tensor at a time, so a whole unquantized model never exists in host memory; a checkpoint saved
4-bit by transformers is copied in as it is.

The store is filled once, tensor by tensor, straight into the preallocated blocks: the
``load -> .to() -> .pin_memory()`` route makes transient copies that can push a large base over the
host's page-locked ceiling.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from deg_hf.streaming import quant as q
from deg_hf.streaming.sources import CheckpointSource, fingerprint, safetensors_files

__all__ = [
    "CONSTRUCTED", "LayerLayout", "StreamingError", "TensorSlot", "WeightStore", "fingerprint",
    "resolve_checkpoint", "safetensors_files",
]

_ALIGN = 64  # bytes; keeps every view aligned for vectorised kernels and DMA
_QUANT_CHUNK = 1 << 22  # elements quantized at once on the host: bounds the quantizer's temporaries

#: every WeightStore construction increments this (tests count stores per setup)
CONSTRUCTED = 0


class StreamingError(ValueError):
    """A model or checkpoint that cannot be streamed; the message says what to do instead."""


@dataclass(frozen=True)
class TensorSlot:
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass
class LayerLayout:
    """Where each piece of one layer lives inside its flat byte block.

    ``quantized`` names the 4-bit weights (each stored as the pieces of
    :func:`deg_hf.streaming.quant.piece_entries`); ``compute`` is the layout of their dequantized
    values in a device compute buffer (None when nothing is quantized)."""

    slots: dict[str, TensorSlot]  # piece name (e.g. "self_attn.q_proj.weight") -> slot
    nbytes: int
    quantized: dict[str, q.QuantMeta] = field(default_factory=dict)
    compute: LayerLayout | None = None

    @classmethod
    def build(cls, entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> LayerLayout:
        slots, offset = {}, 0
        for name, shape, dtype in entries:
            offset = (offset + _ALIGN - 1) // _ALIGN * _ALIGN
            slot = TensorSlot(offset, tuple(shape), dtype)
            slots[name] = slot
            offset += slot.nbytes
        return cls(slots, (offset + _ALIGN - 1) // _ALIGN * _ALIGN)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of ``flat`` (a uint8 tensor at least ``nbytes`` long) for every piece."""
        out = {}
        for name, slot in self.slots.items():
            raw = flat[slot.offset : slot.offset + slot.nbytes]
            out[name] = raw.view(slot.dtype).view(slot.shape)
        return out

    def plain_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of the tensors stored at full precision (the 4-bit pieces left out)."""
        return {n: v for n, v in self.views(flat).items() if q.SEP not in n}

    @property
    def compute_bytes(self) -> int:
        return self.compute.nbytes if self.compute is not None else 0


# --------------------------------------------------------------------------- checkpoint files


def resolve_checkpoint(name_or_path: str, revision: str | None = None) -> str:
    """A local directory holding config.json and safetensors weights for a path or a Hub id."""
    if os.path.isdir(name_or_path):
        local = name_or_path
    elif os.path.exists(name_or_path):
        raise StreamingError(
            f"{name_or_path!r} is a file; pass the directory that holds config.json and the "
            "*.safetensors weights (or a Hub model id)."
        )
    else:
        from huggingface_hub import snapshot_download

        try:
            local = snapshot_download(
                name_or_path,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"],
            )
        except Exception as exc:  # network, auth, unknown repo: say what was tried
            raise StreamingError(
                f"could not find {name_or_path!r} locally nor download it from the Hub ({exc}). "
                "Pass a local checkpoint directory, or check the model id and your HF_TOKEN."
            ) from exc
    if not safetensors_files(local):
        raise StreamingError(
            f"{name_or_path!r} has no *.safetensors weights. Layer streaming reads safetensors only: "
            "convert the checkpoint with `model.save_pretrained(dir, safe_serialization=True)` or "
            "pass stream_layers=False to train resident."
        )
    return local


# --------------------------------------------------------------------------- the store


class WeightStore:
    """Every decoder layer's base weights, in host memory, one flat block per layer.

    ``source`` is a checkpoint directory or a tensor source (:mod:`deg_hf.streaming.sources`).
    ``layer_keys[i]`` maps each local parameter name of layer ``i`` (as the module names it before
    any adapter is injected, e.g. ``self_attn.q_proj.weight``) to its source key. ``dtype`` is the
    training dtype. With ``quant``, the local names in ``quantize[i]`` are stored 4-bit; weights the
    source already holds 4-bit (a pre-quantized checkpoint) are stored 4-bit whatever ``quant`` says.
    """

    def __init__(
        self,
        source,
        layer_keys: list[dict[str, str]],
        dtype: torch.dtype,
        *,
        quant: q.QuantSpec | None = None,
        quantize: list[set[str]] | None = None,
        pin: bool | None = None,
        cache_dir: str | None = None,
        progress: bool = True,
        quantize_device: torch.device | str | None = None,
    ):
        global CONSTRUCTED
        CONSTRUCTED += 1
        if isinstance(source, (str, os.PathLike)):
            source = CheckpointSource(os.fspath(source))
        self.source = source
        self.directory = getattr(source, "directory", None)
        self.dtype = dtype
        self.quant = quant
        self.fingerprint = source.fingerprint
        self.pinned = False
        self.layer_keys = layer_keys
        missing = sorted(k for keys in layer_keys for k in keys.values() if k not in source)
        if missing:
            raise StreamingError(
                f"the checkpoint in {self.directory!r} lacks {len(missing)} decoder-layer weights the model "
                f"expects (first: {missing[0]!r}). Its tensor names do not follow the model's module "
                "names; re-save it with `save_pretrained` from a current transformers, or pass "
                "stream_layers=False."
            )
        quantize = quantize if quant is not None and quantize is not None else [set() for _ in layer_keys]
        self.layouts = [self._layout(keys, names) for keys, names in zip(layer_keys, quantize)]
        self.quantized = any(lay.quantized for lay in self.layouts)
        if self.quantized:
            q.require_bitsandbytes()
        want_pin = torch.cuda.is_available() if pin is None else pin
        self.flat: list[torch.Tensor] = [self._allocate(lay.nbytes, want_pin) for lay in self.layouts]
        self._qdevice = torch.device(quantize_device) if quantize_device is not None else torch.device("cpu")
        cached = self._cache_path(cache_dir)
        if cached and os.path.isdir(cached) and self._read_cache(cached):
            self._release_source()
            return
        self._fill(progress)
        self._release_source()
        if cached:
            self._write_cache(cached)

    # -- construction helpers
    def _layout(self, keys: dict[str, str], quantize: set[str]) -> LayerLayout:
        entries, quantized = [], {}
        for local, key in keys.items():
            shape, src_dtype = self.source.meta(key)
            if q.prequantized_state_key(self.source, key) is not None:
                meta = q.read_prequantized_meta(self.source, key)
            elif local in quantize:
                meta = q.QuantMeta(tuple(shape), self.dtype, self.quant.quant_type, self.quant.blocksize,
                                   self.quant.double)
            else:
                # floating weights take the training dtype; integer tensors keep theirs
                entries.append((local, shape, self.dtype if src_dtype.is_floating_point else src_dtype))
                continue
            quantized[local] = meta
            entries += q.piece_entries(local, meta)
        layout = LayerLayout.build(entries)
        if quantized:
            layout.quantized = quantized
            layout.compute = LayerLayout.build((n, m.shape, self.dtype) for n, m in quantized.items())
        return layout

    def _allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        if pin:
            try:
                flat = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
                return flat
            except RuntimeError as exc:
                warnings.warn(
                    f"pinning {nbytes / 2**20:.0f} MiB of host memory failed ({exc}); the store falls "
                    "back to pageable memory, which makes host-to-device copies slower. Raise the "
                    "locked-memory limit (ulimit -l) to pin.",
                    stacklevel=3,
                )
        return torch.empty(nbytes, dtype=torch.uint8)

    def _fill(self, progress: bool) -> None:
        wanted: dict[str, tuple[int, str]] = {}
        for i, keys in enumerate(self.layer_keys):
            for local, key in keys.items():
                wanted[key] = (i, local)
        desc = "quantizing layers into host memory" if self.quantized else "loading layers into host memory"
        bar = _progress(total=sum(lay.nbytes for lay in self.layouts), enabled=progress, desc=desc)
        views = [lay.views(flat) for lay, flat in zip(self.layouts, self.flat)]
        for key in self.source.keys():  # the source's own order: sequential reads
            if key not in wanted:
                continue
            i, local = wanted[key]
            layout = self.layouts[i]
            meta = layout.quantized.get(local)
            if meta is None:
                dst = views[i][local]
                got = self.source.read(key, out=dst)
                if got.data_ptr() != dst.data_ptr():
                    dst.copy_(got.view(dst.shape))
                bar.update(dst.nbytes)
            elif q.prequantized_state_key(self.source, key) is not None:
                q.read_prequantized_into(self.source, key, local, meta, views[i])
                bar.update(sum(views[i][n].nbytes for n, *_ in q.piece_entries(local, meta)))
            else:
                self._quantize(self.source.read(key), local, meta, views[i])
                bar.update(sum(views[i][n].nbytes for n, *_ in q.piece_entries(local, meta)))
        bar.close()

    def _quantize(self, weight: torch.Tensor, local: str, meta: q.QuantMeta, views: dict) -> None:
        weight = weight.to(device=self._qdevice, dtype=meta.dtype)
        if self._qdevice.type != "cpu":  # on the device: quantize whole, bring the pieces back
            pieces = {n: torch.empty(s, dtype=d, device=self._qdevice) for n, s, d in q.piece_entries(local, meta)}
            q.quantize_into(weight, local, meta, pieces)
            for n, t in pieces.items():
                views[n].copy_(t)
        else:
            q.quantize_chunked(weight, local, meta, views, chunk=_QUANT_CHUNK)

    def _release_source(self) -> None:
        close = getattr(self.source, "close", None)
        if callable(close):
            close()

    def _cache_path(self, cache_dir: str | None) -> str | None:
        if not cache_dir:
            return None
        dtype = str(self.dtype).replace("torch.", "")
        tag = "".join(sorted({f"-{m.quant_type}-b{m.blocksize}-{'dq' if m.nested else 'sq'}"
                              for lay in self.layouts for m in lay.quantized.values()}))
        if self.quant is not None and self.quant.skip_modules is not None:
            tag += "-skip" + ",".join(sorted(self.quant.skip_modules))
        return os.path.join(cache_dir, f"{self.fingerprint}-{dtype}{tag}")

    def _read_cache(self, path: str) -> bool:
        for i, flat in enumerate(self.flat):
            fname = os.path.join(path, f"layer-{i:05d}.bin")
            if not os.path.exists(fname) or os.path.getsize(fname) != flat.numel():
                return False
        for i, flat in enumerate(self.flat):
            with open(os.path.join(path, f"layer-{i:05d}.bin"), "rb") as fh:
                fh.readinto(memoryview(flat.numpy()))
        return True

    def _write_cache(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        for i, flat in enumerate(self.flat):
            tmp = os.path.join(path, f".layer-{i:05d}.bin.tmp")
            with open(tmp, "wb") as fh:
                fh.write(memoryview(flat.numpy()))
            os.replace(tmp, os.path.join(path, f"layer-{i:05d}.bin"))

    # -- use
    @property
    def n_layers(self) -> int:
        return len(self.layouts)

    @property
    def nbytes(self) -> int:
        return sum(f.numel() for f in self.flat)

    @property
    def max_layer_bytes(self) -> int:
        return max(lay.nbytes for lay in self.layouts)

    @property
    def max_compute_bytes(self) -> int:
        """The largest layer's dequantized 4-bit weights (0 when nothing is quantized)."""
        return max(lay.compute_bytes for lay in self.layouts)

    @property
    def unquantized_bytes(self) -> int:
        """What the store would hold with every weight at the training dtype."""
        total = 0
        for lay in self.layouts:
            plain = sum(s.nbytes for n, s in lay.slots.items() if q.SEP not in n)
            total += plain + lay.compute_bytes
        return total

    def block(self, i: int) -> torch.Tensor:
        """Layer ``i``'s flat host block."""
        return self.flat[i]

    def host_views(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s full-precision tensors, as views of the host block (4-bit weights left out:
        they exist only packed)."""
        return self.layouts[i].plain_views(self.flat[i])

    def quantization(self) -> dict | None:
        """What deg.json records of the 4-bit storage (None when nothing is quantized)."""
        metas = [m for lay in self.layouts for m in lay.quantized.values()]
        if not metas:
            return None
        first = metas[0]
        return {
            "method": "bitsandbytes-4bit",
            "quant_type": first.quant_type,
            "blocksize": first.blocksize,
            "double_quant": first.nested,
            "quantized_from": str(first.dtype).replace("torch.", ""),
            "compute_dtype": str(self.dtype).replace("torch.", ""),
            "weights_per_layer": len(self.layouts[0].quantized),
            "prequantized": self.quant is None,
        }

    def close(self) -> None:
        self.flat = []


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool, desc: str):
    if not enabled or total < 64 * 2**20:  # a bar for small models is noise
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc)
