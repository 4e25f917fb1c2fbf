"""Where a weight store's tensors come from.

A store fills itself from a *tensor source*: an object with

* ``keys()`` - the tensor names it holds (checkpoint names, e.g. ``model.layers.0.mlp.up_proj.weight``);
* ``meta(key)`` - ``(shape, dtype)`` of one tensor, without reading its data;
* ``read(key, out=None)`` - the tensor's values. When ``out`` is given and has the tensor's dtype and
  element count, the values are written into it (no temporary) and ``out`` is returned; otherwise a
  new tensor comes back (the caller casts or copies it);
* ``fingerprint`` - a short digest that changes whenever the values may have changed;
* ``close()``.

:class:`CheckpointSource` reads safetensors files. It parses their headers itself and reads each
tensor with ``preadv`` straight into the destination's memory: no memory map, so filling a store
from a file larger than RAM never shows that file in the process's resident set, and no copy through
Python buffers.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable

import torch

#: safetensors dtype tags -> torch dtypes
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

_HEADER_LIMIT = 100 * 2**20  # safetensors caps its JSON header at 100 MB


class SourceError(ValueError):
    """A weight file that cannot be read as it claims to be (truncated, corrupt, unknown dtype)."""


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


class _Entry:
    __slots__ = ("path", "shape", "dtype", "start", "nbytes")

    def __init__(self, path, shape, dtype, start, nbytes):
        self.path, self.shape, self.dtype, self.start, self.nbytes = path, shape, dtype, start, nbytes


def read_header(path: str) -> dict[str, _Entry]:
    """Tensor name -> where its bytes are, from one safetensors file's header (data not read)."""
    size = os.path.getsize(path)
    name = os.path.basename(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise SourceError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise SourceError(f"{path}: not a safetensors file or truncated (header of {n} bytes, file of {size})")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SourceError(f"{path}: corrupt safetensors header ({exc})") from exc
    base = 8 + n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SourceError(f"{path}: tensor {key!r} has dtype {info.get('dtype')!r}, which deg_hf cannot read")
        begin, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * dtype.itemsize or base + end > size:
            raise SourceError(
                f"{name}: tensor {key!r} ({list(shape)}, {info['dtype']}) does not fit the file: the file is "
                f"truncated or corrupt ({size} bytes, the tensor ends at byte {base + end}). Download or "
                "save the checkpoint again."
            )
        out[key] = _Entry(path, shape, dtype, base + begin, end - begin)
    return out


def _read_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise SourceError(f"{path}: unexpected end of file at byte {offset + done}; the file is truncated")
        done += n


def bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class CheckpointSource:
    """The tensors of a directory of safetensors files (a ``save_pretrained`` checkpoint)."""

    def __init__(self, directory: str, files: Iterable[str] | None = None):
        self.directory = directory
        self.files = list(files) if files is not None else safetensors_files(directory)
        self._entries: dict[str, _Entry] = {}
        for path in self.files:
            self._entries.update(read_header(path))
        self._fds: dict[str, int] = {}
        self.fingerprint = fingerprint(directory)

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        e = self._entries[key]
        return e.shape, e.dtype

    def file_of(self, key: str) -> str:
        return self._entries[key].path

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        e = self._entries[key]
        numel = e.nbytes // e.dtype.itemsize if e.dtype.itemsize else 0
        if out is None or out.dtype != e.dtype or out.numel() != numel or not out.is_contiguous() or out.device.type != "cpu":
            out = torch.empty(e.shape, dtype=e.dtype)
        if e.nbytes:
            _read_exact(self._fd(e.path), bytes_of(out), e.start, e.path)
        return out.view(e.shape) if out.shape != torch.Size(e.shape) else out

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class ModuleSource:
    """The decoder-layer tensors of a model already in memory, *moved* into the store.

    ``layers`` are ``(prefix, module)`` pairs (``("model.layers.0", layer)``); ``keys()`` names each
    base tensor ``prefix.local_name`` as a checkpoint would. Adapter tensors injected by PEFT are not
    base weights and are left out, and left in place. ``read`` hands out the module's own tensor and
    then frees it from the module (the parameter is replaced by one on ``meta`` of the same shape and
    dtype), so filling a store from a loaded model holds at most one extra tensor at a time and reads
    nothing from disk. In-memory values (edits, a dtype chosen at load time) are what gets stored.

    Its ``fingerprint`` is None: nothing on disk identifies the values, so no cache is keyed by them.
    """

    fingerprint = None
    directory = None

    def __init__(self, layers: Iterable[tuple[str, torch.nn.Module]]):
        self._where: dict[str, tuple[torch.nn.Module, str]] = {}
        for prefix, layer in layers:
            adapters = _adapter_parameter_ids(layer)
            for name, module in layer.named_modules():
                for pname, p in module.named_parameters(recurse=False):
                    if p is None or id(p) in adapters:
                        continue
                    key = f"{prefix}.{name}.{pname}" if name else f"{prefix}.{pname}"
                    self._where[key] = (module, pname)

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        module, name = self._where[key]
        p = module._parameters[name]
        return tuple(p.shape), p.dtype

    def read(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        module, name = self._where[key]
        p = module._parameters[name]
        if p.is_meta:
            raise SourceError(f"{key} has no values (it is on meta): the model was not fully loaded")
        value = p.detach()
        if out is not None and out.dtype == value.dtype and out.numel() == value.numel():
            out.view(value.shape).copy_(value)
            value = out
        module._parameters[name] = torch.nn.Parameter(
            torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False
        )
        return value

    def close(self) -> None:
        self._where = {}


def _adapter_parameter_ids(layer: torch.nn.Module) -> set[int]:
    """ids of the PEFT adapter parameters inside ``layer`` (every adapter, active or not)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no PEFT: nothing was injected
        return set()
    ids = set()
    for module in layer.modules():
        if isinstance(module, BaseTunerLayer):
            for attr in (*module.adapter_layer_names, *getattr(module, "other_param_names", ())):
                container = getattr(module, attr, None)
                if isinstance(container, torch.nn.Module):
                    ids.update(id(p) for p in container.parameters())
    return ids
