"""Host-memory store of a checkpoint's decoder-layer weights.

Each decoder layer is held as ONE flat, contiguous byte tensor (pinned when CUDA is present) plus a
layout (name -> offset, shape, dtype). A fetch to the device is then a single copy per layer, and
the device side can carve the same views out of a flat buffer of the same size.

The store is filled once, tensor by tensor, by ``copy_`` into the preallocated flat tensors: the
``load -> .to() -> .pin_memory()`` route makes transient copies that can push a large base over the
host's page-locked ceiling.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

_ALIGN = 64  # bytes; keeps every view aligned for vectorised kernels and DMA

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
        return n * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class LayerLayout:
    """Where each tensor of one layer lives inside its flat byte buffer."""

    slots: dict[str, TensorSlot]  # local name (e.g. "self_attn.q_proj.weight") -> slot
    nbytes: int

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
        """Typed views of ``flat`` (a uint8 tensor at least ``nbytes`` long) for every tensor."""
        out = {}
        for name, slot in self.slots.items():
            raw = flat[slot.offset : slot.offset + slot.nbytes]
            out[name] = raw.view(slot.dtype).view(slot.shape)
        return out


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


def safetensors_files(directory: str) -> list[str]:
    """Weight files of a checkpoint directory: the index's shard list when present, else every file."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as fh:
            names = sorted(set(json.load(fh)["weight_map"].values()))
        return [os.path.join(directory, n) for n in names]
    return sorted(
        os.path.join(directory, n)
        for n in os.listdir(directory)
        if n.endswith(".safetensors") and not n.startswith("adapter_")
    )


def fingerprint(directory: str) -> str:
    """A digest of the source files' names, sizes and modification times.

    Anything cached from a checkpoint is keyed by this, never by the model's name, so a retrained
    checkpoint saved under the same name is never streamed stale.
    """
    digest = hashlib.sha256()
    names = [os.path.basename(p) for p in safetensors_files(directory)]
    for extra in ("config.json", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(directory, extra)):
            names.append(extra)
    for name in sorted(names):
        st = os.stat(os.path.join(directory, name))
        digest.update(f"{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _key_index(files: list[str]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """checkpoint key -> (file, shape, safetensors dtype), reading headers only."""
    from safetensors import safe_open

    where = {}
    for path in files:
        with safe_open(path, framework="pt") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                where[key] = (path, tuple(sl.get_shape()), sl.get_dtype())
    return where


# --------------------------------------------------------------------------- the store


class WeightStore:
    """Every decoder layer's base weights, in host memory, one flat tensor per layer.

    ``layer_keys[i]`` maps each local parameter name of layer ``i`` (as the module names it before
    any adapter is injected, e.g. ``self_attn.q_proj.weight``) to its checkpoint key.
    """

    def __init__(
        self,
        directory: str,
        layer_keys: list[dict[str, str]],
        dtype: torch.dtype,
        *,
        pin: bool | None = None,
        cache_dir: str | None = None,
        progress: bool = True,
    ):
        global CONSTRUCTED
        CONSTRUCTED += 1
        self.directory = directory
        self.dtype = dtype
        self.fingerprint = fingerprint(directory)
        self.pinned = False
        files = safetensors_files(directory)
        where = _key_index(files)
        missing = sorted(k for keys in layer_keys for k in keys.values() if k not in where)
        if missing:
            raise StreamingError(
                f"the checkpoint in {directory!r} lacks {len(missing)} decoder-layer weights the model "
                f"expects (first: {missing[0]!r}). Its tensor names do not follow the model's module "
                "names; re-save it with `save_pretrained` from a current transformers, or pass "
                "stream_layers=False."
            )
        self.layouts = [self._layout(keys, where) for keys in layer_keys]
        want_pin = torch.cuda.is_available() if pin is None else pin
        self.flat: list[torch.Tensor] = [self._allocate(lay.nbytes, want_pin) for lay in self.layouts]
        self.layer_keys = layer_keys
        cached = self._cache_path(cache_dir)
        if cached and os.path.isdir(cached) and self._read_cache(cached):
            return
        self._fill(files, progress)
        if cached:
            self._write_cache(cached)

    # -- construction helpers
    def _layout(self, keys: dict[str, str], where: dict) -> LayerLayout:
        entries = []
        for local, key in keys.items():
            _, shape, st_dtype = where[key]
            src_dtype = _SAFETENSORS_DTYPES.get(st_dtype, self.dtype)
            # floating weights take the training dtype; integer tensors keep theirs
            dtype = self.dtype if src_dtype.is_floating_point else src_dtype
            entries.append((local, shape, dtype))
        return LayerLayout.build(entries)

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

    def _fill(self, files: list[str], progress: bool) -> None:
        from safetensors import safe_open

        wanted: dict[str, tuple[int, str]] = {}
        for i, keys in enumerate(self.layer_keys):
            for local, key in keys.items():
                wanted[key] = (i, local)
        bar = _progress(total=sum(lay.nbytes for lay in self.layouts), enabled=progress)
        views = [lay.views(flat) for lay, flat in zip(self.layouts, self.flat)]
        for path in files:
            with safe_open(path, framework="pt") as fh:
                for key in fh.keys():
                    if key not in wanted:
                        continue
                    i, local = wanted[key]
                    dst = views[i][local]
                    dst.copy_(fh.get_tensor(key))
                    bar.update(dst.numel() * dst.element_size())
        bar.close()

    def _cache_path(self, cache_dir: str | None) -> str | None:
        if not cache_dir:
            return None
        dtype = str(self.dtype).replace("torch.", "")
        return os.path.join(cache_dir, f"{self.fingerprint}-{dtype}")

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

    def host_views(self, i: int) -> dict[str, torch.Tensor]:
        return self.layouts[i].views(self.flat[i])

    def close(self) -> None:
        self.flat = []


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled or total < 64 * 2**20:  # a bar for small models is noise
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="loading layers into host memory")
