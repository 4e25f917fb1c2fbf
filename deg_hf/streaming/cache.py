"""The on-disk copy of a store: one flat file per layer, exactly the bytes of the layer's block.

It serves two purposes: a later run reads the store back instead of converting (and quantizing)
the checkpoint again, and the disk tier streams the layers that do not fit in host memory from it.

A cache directory is keyed by the source's fingerprint, the training dtype and the quantization
settings (``<fingerprint>-<dtype>[-<quant>]``), so a retrained checkpoint or another setting never
reads stale bytes. Each layer file is written under a temporary name and renamed when complete;
``manifest.json`` (the key, every layer's size and its xxh3 checksum) is written last. A directory
without a manifest - a run killed while writing - is never read: it is rebuilt. A layer whose bytes
no longer match its checksum is rebuilt from the source.
"""

from __future__ import annotations

import json
import os

import torch

from deg_hf.streaming.sources import bytes_of

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 64 * 2**20  # bytes per read or write call when streaming a file through a buffer


def default_cache_root() -> str:
    """Where layer files go when no ``stream_cache_dir`` is given: under the Hugging Face cache home."""
    from huggingface_hub import constants

    return os.path.join(constants.HF_HOME, "deg_hf", "stream-cache")


def checksum(view: memoryview) -> str:
    import xxhash

    return xxhash.xxh3_64(view).hexdigest()


def drop_page_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to forget cached pages of a file range (clean pages go at once), so a store
    streamed from disk does not quietly live on in the page cache."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def read_file_into(fd: int, view: memoryview, path: str) -> None:
    """Read a whole file into ``view`` (a tensor's memory), straight from the kernel, then drop the
    file's pages from the page cache."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + _CHUNK]], done)
        if n <= 0:
            raise OSError(f"{path}: unexpected end of file after {done} of {len(view)} bytes")
        done += n
    drop_page_cache(fd)


class LayerCache:
    """One cache directory: ``layer-00000.bin`` ... and ``manifest.json``."""

    def __init__(self, root: str, key: str, layer_bytes: list[int]):
        self.root = root
        self.key = key
        self.path = os.path.join(root, key)
        self.layer_bytes = list(layer_bytes)
        self.checksums: list[str | None] = [None] * len(layer_bytes)
        self.manifest_ok = self._read_manifest()

    def layer_path(self, i: int) -> str:
        return os.path.join(self.path, f"layer-{i:05d}.bin")

    def _read_manifest(self) -> bool:
        try:
            with open(os.path.join(self.path, MANIFEST), encoding="utf-8") as fh:
                manifest = json.load(fh)
        except (OSError, ValueError):
            return False
        layers = manifest.get("layers") or []
        if (manifest.get("format") != FORMAT or manifest.get("key") != self.key
                or [entry.get("bytes") for entry in layers] != self.layer_bytes):
            return False
        for i, entry in enumerate(layers):
            try:
                if os.path.getsize(self.layer_path(i)) != self.layer_bytes[i]:
                    return False
            except OSError:
                return False
            self.checksums[i] = entry.get("xxh3")
        return True

    def missing_bytes(self) -> int:
        """Bytes still to write for this cache to be complete."""
        if self.manifest_ok:
            return 0
        return sum(self.layer_bytes)

    # -- reading
    def read_layer(self, i: int, dst: torch.Tensor) -> bool:
        """Read layer ``i`` into ``dst``; False (nothing to trust) when its bytes fail their checksum."""
        if not self.manifest_ok:
            return False
        fd = os.open(self.layer_path(i), os.O_RDONLY)
        try:
            view = bytes_of(dst)[: self.layer_bytes[i]]
            read_file_into(fd, view, self.layer_path(i))
        finally:
            os.close(fd)
        return checksum(view) == self.checksums[i]

    def verify_layer(self, i: int, scratch: torch.Tensor) -> bool:
        """Check layer ``i``'s file against its checksum, reading it through ``scratch``."""
        return self.read_layer(i, scratch)

    # -- writing
    def begin(self) -> None:
        """Invalidate (remove the manifest) before any layer file changes: a run killed from here on
        leaves a directory that is never read."""
        os.makedirs(self.path, exist_ok=True)
        try:
            os.remove(os.path.join(self.path, MANIFEST))
        except FileNotFoundError:
            pass
        self.manifest_ok = False

    def write_layer(self, i: int, block: torch.Tensor) -> None:
        view = bytes_of(block)[: self.layer_bytes[i]]
        tmp = os.path.join(self.path, f".layer-{i:05d}.bin.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.write(fd, view[done : done + _CHUNK])
            os.fsync(fd)
            drop_page_cache(fd)  # written back by the fsync, so the pages can go
        finally:
            os.close(fd)
        os.replace(tmp, self.layer_path(i))
        self.checksums[i] = checksum(view)

    def finish(self) -> None:
        """Write the manifest, last: only now is the directory a cache."""
        manifest = {
            "format": FORMAT,
            "key": self.key,
            "layers": [{"bytes": n, "xxh3": c} for n, c in zip(self.layer_bytes, self.checksums)],
        }
        tmp = os.path.join(self.path, f".{MANIFEST}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(self.path, MANIFEST))
        self.manifest_ok = True
