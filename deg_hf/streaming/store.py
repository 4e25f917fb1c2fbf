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

import logging
import os
import shutil
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from deg_hf.streaming import host, shared, tiers
from deg_hf.streaming import quant as q
from deg_hf.streaming.cache import LayerCache, default_cache_root
from deg_hf.streaming.sources import CheckpointSource, fingerprint, safetensors_files

logger = logging.getLogger(__name__)

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
    """Every decoder layer's base weights, one flat block per layer, in host RAM or on disk.

    ``source`` is a checkpoint directory or a tensor source (:mod:`deg_hf.streaming.sources`).
    ``layer_keys[i]`` maps each local parameter name of layer ``i`` (as the module names it before
    any adapter is injected, e.g. ``self_attn.q_proj.weight``) to its source key. ``dtype`` is the
    training dtype. With ``quant``, the local names in ``quantize[i]`` are stored 4-bit; weights the
    source already holds 4-bit (a pre-quantized checkpoint) are stored 4-bit whatever ``quant`` says.

    ``tier`` (``auto``, ``ram``, ``disk``) and ``host_mem_gb`` decide where each block lives
    (:func:`deg_hf.streaming.host.plan_placement`); disk blocks live in the layer cache
    (``cache_dir``, else under the Hugging Face cache home) and are read each sweep by a loader
    thread. Before any weight is read, a store that fits neither the RAM budget nor the cache
    directory's free space is refused with the figures.

    With ``share`` (this process's :class:`~deg_hf.streaming.shared.NodeRanks` in a run with several
    local ranks) the node holds one store: local rank 0 builds the RAM blocks into a shared-memory
    file and the other local ranks map it read-only, taking its placement (:mod:`deg_hf.streaming.shared`).
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
        tier: str = "ram",
        host_mem_gb: float | None = None,
        disk_free=None,
        ring: int = tiers.DEFAULT_RING,
        share: shared.NodeRanks | None = None,
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
        self.disk: tiers.DiskTier | None = None
        missing = sorted(k for keys in layer_keys for k in keys.values() if k not in source)
        if missing:
            raise StreamingError(
                f"the checkpoint in {self.directory!r} lacks {len(missing)} decoder-layer weights the model "
                f"expects (first: {missing[0]!r}). Its tensor names do not follow the model's module "
                "names; re-save it with `save_pretrained` from a current transformers, or pass "
                "stream_layers=False."
            )
        quantize = quantize if quant is not None and quantize is not None else [set() for _ in layer_keys]
        self._prequantized = False
        self.layouts = [self._layout(keys, names) for keys, names in zip(layer_keys, quantize)]
        self.quantized = any(lay.quantized for lay in self.layouts)
        if self.quantized:
            q.require_bitsandbytes()
        self._qdevice = torch.device(quantize_device) if quantize_device is not None else torch.device("cpu")
        want_pin = torch.cuda.is_available() if pin is None else pin
        self.shared: shared.SharedSegment | None = None
        if share is not None and not share.builder:
            self._attach_shared(share, want_pin, ring)
            return

        # where each block lives, decided (and refused) before any weight is read
        sizes = [lay.nbytes for lay in self.layouts]
        budget = host.host_budget(host_mem_gb)
        self.placement = host.plan_placement(tier, sizes, budget)
        on_disk = [i for i, where in enumerate(self.placement) if where == "disk"]
        self.host_budget = budget
        cache = None
        if cache_dir or on_disk:
            cache = LayerCache(cache_dir or default_cache_root(), self._cache_key(), sizes)
        self.cache = cache
        try:
            self._check_host(tier, host_mem_gb, sizes, budget, cache, disk_free, on_disk)
        except BaseException as exc:
            if share is not None:  # the node's other ranks are waiting for this store: tell them why
                shared.report_failure(share, self._share_key(), exc)
            raise
        if cache is not None and not on_disk and cache.missing_bytes():
            free = (disk_free or _disk_free)(cache.root)
            if free < cache.missing_bytes():  # a convenience cache only: the run does not need it
                warnings.warn(
                    f"not writing the layer cache to {cache.path}: it needs {_gib(cache.missing_bytes())} and "
                    f"the disk has {_gib(free)} free. The store stays in RAM.", stacklevel=3,
                )
                self.cache = cache = None
        if on_disk and tier == "disk":
            # said at warning level: it writes the store's size to that drive
            logger.warning("deg_hf: stream_tier='disk': %d of %d decoder layers (%s) stream from the layer cache at %s.",
                           len(sizes), len(sizes), _gib(sum(sizes)), cache.path)
        elif on_disk:
            logger.warning(
                "deg_hf: %d of %d decoder layers (%s of %s) do not fit the host-memory budget of %s and "
                "stream from the layer cache at %s (%s).", len(on_disk), len(sizes),
                _gib(sum(sizes[i] for i in on_disk)), _gib(sum(sizes)), _gib(budget), cache.path,
                host.describe_placement(self.placement),
            )

        segment = None
        if share is not None:
            try:
                segment = self._create_shared(share, budget)
            except BaseException as exc:
                shared.report_failure(share, self._share_key(), exc)
                raise
        if segment is None:
            self.flat: list[torch.Tensor | None] = [
                self._allocate(lay.nbytes, want_pin) if where == "ram" else None
                for lay, where in zip(self.layouts, self.placement)
            ]
        try:
            scratch = torch.empty(max((sizes[i] for i in on_disk), default=0), dtype=torch.uint8)
            stale = self._read_back(cache, scratch) if cache is not None else list(range(self.n_layers))
            if stale:
                if cache is not None:
                    cache.begin()
                self._fill(stale, cache, scratch, progress)
                if cache is not None:
                    cache.finish()
            del scratch
            if segment is not None:
                segment.publish()  # remapped read-only: the blocks are views of the new mapping
                self.flat = self._shared_blocks(segment)
                self.pinned = segment.pin() if want_pin else False
                segment.wait_for_ranks(shared.share_timeout())
        except BaseException as exc:
            if segment is not None:
                self.flat = [None] * self.n_layers
                segment.fail(exc)
            raise
        self._release_source()
        if on_disk:
            self.disk = tiers.DiskTier(cache, on_disk, ring=ring, pin=want_pin)

    # -- the node-shared store
    def _share_key(self) -> str:
        """What the ranks must agree on to share: the cache key and every block's size."""
        import hashlib

        sizes = ",".join(str(lay.nbytes) for lay in self.layouts)
        return f"{self._cache_key()}-{hashlib.sha256(sizes.encode()).hexdigest()[:12]}"

    def _create_shared(self, ranks: shared.NodeRanks, budget: int) -> shared.SharedSegment:
        """The builder's segment, sized for the RAM-placed blocks; ``self.flat`` are views of it."""
        offsets, total = {}, 0
        for i, (lay, where) in enumerate(zip(self.layouts, self.placement)):
            if where == "ram":
                offsets[i] = total
                total += (lay.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        extra = {"placement": self.placement, "host_budget": budget,
                 "cache_root": self.cache.root if self.cache is not None else None}
        segment = shared.SharedSegment.create(ranks, self._share_key(), offsets, total, extra)
        self.shared = segment
        self.flat = self._shared_blocks(segment)
        return segment

    def _shared_blocks(self, segment: shared.SharedSegment) -> list[torch.Tensor | None]:
        return [segment.block(i, lay.nbytes) if where == "ram" else None
                for i, (lay, where) in enumerate(zip(self.layouts, self.placement))]

    def _attach_shared(self, ranks: shared.NodeRanks, want_pin: bool, ring: int) -> None:
        """Map the store local rank 0 built, read-only; its placement and cache are the builder's."""
        segment = shared.SharedSegment.attach(ranks, self._share_key(), shared.share_timeout())
        self.shared = segment
        header = segment.header
        self.placement = list(header["placement"])
        self.host_budget = int(header["host_budget"])
        sizes = [lay.nbytes for lay in self.layouts]
        root = header.get("cache_root")
        self.cache = LayerCache(root, self._cache_key(), sizes) if root else None
        self.flat = self._shared_blocks(segment)
        self.pinned = segment.pin() if want_pin else False
        self._release_source()
        on_disk = [i for i, where in enumerate(self.placement) if where == "disk"]
        if on_disk:
            self.disk = tiers.DiskTier(self.cache, on_disk, ring=ring, pin=want_pin)

    def share_stats(self) -> dict:
        """Whether this node's ranks share the store (and by how many), from this rank's side."""
        if self.shared is None:
            return {"shared": False, "ranks": 1}
        return self.shared.stats()

    # -- construction helpers
    def _layout(self, keys: dict[str, str], quantize: set[str]) -> LayerLayout:
        entries, quantized = [], {}
        for local, key in keys.items():
            shape, src_dtype = self.source.meta(key)
            if q.prequantized_state_key(self.source, key) is not None:
                meta = q.read_prequantized_meta(self.source, key)
                self._prequantized = True
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

    def _cache_key(self) -> str:
        """Every setting that changes the stored bytes: source fingerprint, dtype, 4-bit settings."""
        dtype = str(self.dtype).replace("torch.", "")
        tag = "".join(sorted({f"-{m.quant_type}-b{m.blocksize}-{'dq' if m.nested else 'sq'}"
                              for lay in self.layouts for m in lay.quantized.values()}))
        if self.quant is not None and self.quant.skip_modules is not None:
            tag += "-skip" + ",".join(sorted(self.quant.skip_modules))
        return f"{self.fingerprint}-{dtype}{tag}"

    def _check_host(self, tier, host_mem_gb, sizes, budget, cache, disk_free, on_disk) -> None:
        total = sum(sizes)
        if tier == "ram" and total > budget:
            raise StreamingError(
                f"the layer store needs {_gib(total)} of host memory and stream_tier='ram' allows "
                f"{_gib(budget)} ({'host_mem_gb' if host_mem_gb is not None else 'available memory less a margin'}). "
                "Use stream_tier='auto' to stream the layers that do not fit from disk, raise host_mem_gb, "
                "or use stream_quantization='nf4' (a quarter of the bf16 bytes)."
            )
        if not on_disk:
            return
        need, free = cache.missing_bytes(), (disk_free or _disk_free)(cache.root)
        if need > free:
            in_ram = sum(n for n, where in zip(sizes, self.placement) if where == "ram")
            raise StreamingError(
                f"the layer store ({_gib(total)}) fits neither tier: host memory holds {_gib(in_ram)} of it "
                f"(budget {_gib(budget)}), and the layer cache at {cache.path} needs {_gib(need)} of disk where "
                f"{_gib(free)} is free. Free disk space or point stream_cache_dir at a larger drive, raise "
                "host_mem_gb, or use stream_quantization='nf4' (a quarter of the bf16 bytes)."
            )

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

    def _read_back(self, cache: LayerCache, scratch: torch.Tensor) -> list[int]:
        """Fill the RAM blocks from a complete cache and check the disk blocks' checksums; the layers
        whose bytes cannot be trusted (all of them without a complete cache)."""
        if not cache.manifest_ok:
            return list(range(self.n_layers))
        stale = []
        for i, where in enumerate(self.placement):
            ok = cache.read_layer(i, self.flat[i]) if where == "ram" else cache.verify_layer(i, scratch)
            if not ok:
                stale.append(i)
        if stale:
            logger.warning(
                "deg_hf: %d layer file(s) of the cache at %s do not match their checksums (first: %s); "
                "rebuilding them from the checkpoint.", len(stale), cache.path, cache.layer_path(stale[0]),
            )
        return stale

    def _fill(self, layers: list[int], cache: LayerCache | None, scratch: torch.Tensor, progress: bool) -> None:
        """Read (and quantize) ``layers`` from the source, one layer at a time; write each to the cache."""
        desc = "quantizing layers into host memory" if self.quantized else "loading layers into host memory"
        bar = _progress(total=sum(self.layouts[i].nbytes for i in layers), enabled=progress, desc=desc)
        for i in layers:
            layout = self.layouts[i]
            block = self.flat[i] if self.flat[i] is not None else scratch[: layout.nbytes]
            views = layout.views(block)
            for local, key in self.layer_keys[i].items():
                meta = layout.quantized.get(local)
                if meta is None:
                    dst = views[local]
                    got = self.source.read(key, out=dst)
                    if got.data_ptr() != dst.data_ptr():
                        dst.copy_(got.view(dst.shape))
                elif q.prequantized_state_key(self.source, key) is not None:
                    q.read_prequantized_into(self.source, key, local, meta, views)
                else:
                    self._quantize(self.source.read(key), local, meta, views)
            if cache is not None:
                cache.write_layer(i, block)
            bar.update(layout.nbytes)
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

    # -- use
    @property
    def n_layers(self) -> int:
        return len(self.layouts)

    @property
    def nbytes(self) -> int:
        """The whole store's bytes, in RAM and on disk."""
        return sum(lay.nbytes for lay in self.layouts)

    @property
    def ram_bytes(self) -> int:
        return sum(f.numel() for f in self.flat if f is not None)

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

    def block(self, i: int, ahead: list[int] = ()) -> torch.Tensor:
        """Layer ``i``'s flat host block. A disk layer comes from the loader's staging ring (waiting
        for it if needed; ``ahead`` lists the layers expected next) and must be :meth:`release`-d."""
        if self.flat[i] is not None:
            return self.flat[i]
        return self.disk.acquire(i, list(ahead))

    def release(self, i: int, after=None) -> None:
        """Done copying layer ``i``'s block (``after``: the CUDA event that ends the copy)."""
        if self.disk is not None and self.flat[i] is None:
            self.disk.release(i, after)

    def ready(self, i: int) -> bool:
        """Whether layer ``i``'s block can be had without waiting for the disk."""
        return self.flat[i] is not None or self.disk.ready(i)

    def prefetch(self, layers: list[int]) -> None:
        if self.disk is not None:
            self.disk.prefetch(layers)

    def host_views(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s full-precision tensors held in RAM, as views of its block (4-bit weights and
        layers on disk left out: they exist only packed, or only in their file)."""
        if self.flat[i] is None:
            return {}
        return self.layouts[i].plain_views(self.flat[i])

    def tier_stats(self) -> dict:
        in_ram = [i for i, where in enumerate(self.placement) if where == "ram"]
        out = {
            "placement": host.describe_placement(self.placement),
            "host_budget_bytes": self.host_budget,
            "ram": {"layers": len(in_ram), "bytes": sum(self.layouts[i].nbytes for i in in_ram)},
            "disk": self.disk.stats() if self.disk is not None else {"layers": 0, "bytes": 0},
        }
        if self.cache is not None:
            out["cache_dir"] = self.cache.path
        return out

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
            "prequantized": self._prequantized,
        }

    def close(self) -> None:
        """Stop the disk loader, close its files, free the RAM blocks. Idempotent."""
        if self.disk is not None:
            self.disk.close()
        self.flat = [None] * len(self.layouts)
        if self.shared is not None:
            self.shared.close()


def _disk_free(path: str) -> int:
    """Free bytes on the drive that holds ``path`` (or would: the nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    return shutil.disk_usage(probe).free


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


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
