"""Where each layer's block lives between fetches: host RAM, or the disk cache (read each sweep).

``plan_placement`` (in :mod:`deg_hf.streaming.host`) keeps as many layers in RAM as the host budget
holds and puts the rest on disk.
:class:`DiskTier` streams the disk layers: a background thread reads them, ahead in the direction of
travel, into a small ring of staging buffers (pinned on CUDA), straight from the kernel into the
buffers' memory, telling the kernel the reads are sequential and dropping the pages behind each read.
"""

from __future__ import annotations

import os
import threading
import time

import torch

from deg_hf.streaming.cache import LayerCache, read_file_into
from deg_hf.streaming.sources import bytes_of

#: staging buffers of the disk tier: one being copied to the device, two being read ahead
DEFAULT_RING = 3


class DiskTier:
    """The disk layers of a store, read by a background loader into a ring of staging buffers.

    The runtime calls :meth:`acquire` (layer ``i`` and the layers it expects next), copies the
    returned block to the device, and calls :meth:`release` with, on CUDA, the event that marks the
    end of that copy: the loader refills a staging buffer only once its copy is done."""

    def __init__(self, cache: LayerCache, layers: list[int], *, ring: int = DEFAULT_RING, pin: bool = False):
        self.cache = cache
        self.layers = set(layers)
        self.sizes = {i: cache.layer_bytes[i] for i in layers}
        self.ring = max(2, ring)
        size = max(self.sizes.values())
        self.pinned = False
        self.buffers = [self._allocate(size, pin) for _ in range(self.ring)]
        self._holds: list[int | None] = [None] * self.ring  # layer whose bytes a buffer holds (complete)
        self._reading: list[int | None] = [None] * self.ring
        self._busy = [False] * self.ring  # handed to the runtime, not released yet
        self._after: list = [None] * self.ring  # CUDA event: the device copy out of the buffer is done
        self._used = [0.0] * self.ring
        self._want: list[int] = []
        self._error: BaseException | None = None
        self._fds: dict[int, int] = {}
        self.closed = False
        self.bytes_read = 0
        self.reads = 0
        self.read_s = 0.0
        self.wait_s = 0.0
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="deg-hf-disk-loader", daemon=True)
        self._thread.start()

    @property
    def ring_bytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def _allocate(self, nbytes: int, pin: bool) -> torch.Tensor:
        if pin:
            try:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
                return buf
            except RuntimeError:
                pass
        return torch.empty(nbytes, dtype=torch.uint8)

    # ------------------------------------------------------------------ the runtime's side
    def acquire(self, i: int, ahead: list[int] = ()) -> torch.Tensor:
        """Layer ``i``'s block in a staging buffer, waiting for the loader if needed; ``ahead`` (the
        layers expected next, nearest first) is read next."""
        with self._cv:
            self._want = [i] + [j for j in ahead if j in self.layers and j != i][: self.ring - 1]
            self._cv.notify_all()
            t0 = time.perf_counter()
            while True:
                self._raise_if_failed()
                slot = self._slot_of(i)
                if slot is not None:
                    break
                self._cv.wait()
            self.wait_s += time.perf_counter() - t0
            self._busy[slot] = True
            self._used[slot] = time.perf_counter()
            return self.buffers[slot][: self.sizes[i]]

    def release(self, i: int, after=None) -> None:
        """The runtime is done reading layer ``i``'s staging buffer (on CUDA: once ``after`` completes)."""
        with self._cv:
            slot = self._slot_of(i)
            if slot is not None:
                self._busy[slot] = False
                self._after[slot] = after
                self._cv.notify_all()

    def ready(self, i: int) -> bool:
        with self._cv:
            return self._slot_of(i) is not None and not self._busy[self._slot_of(i)]

    def prefetch(self, layers: list[int]) -> None:
        """Read these layers next (nearest first) without waiting for them."""
        with self._cv:
            self._want = [j for j in layers if j in self.layers][: self.ring - 1]
            self._cv.notify_all()

    def _slot_of(self, i: int) -> int | None:
        for s, held in enumerate(self._holds):
            if held == i:
                return s
        return None

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the disk loader failed: {self._error}") from self._error
        if self.closed:
            raise RuntimeError("the disk tier is closed")

    # ------------------------------------------------------------------ the loader thread
    def _next_job(self) -> tuple[int, int] | None:
        """(layer, buffer) to read next, or None when there is nothing to do (called under the lock)."""
        for j in self._want:
            if self._slot_of(j) is not None or j in self._reading:
                continue
            free = [s for s in range(self.ring)
                    if not self._busy[s] and self._reading[s] is None and self._holds[s] not in self._want]
            if not free:
                return None
            slot = min(free, key=lambda s: (self._holds[s] is not None, self._used[s]))
            return j, slot
        return None

    def _run(self) -> None:
        while True:
            with self._cv:
                job = None
                while not self.closed and (job := self._next_job()) is None:
                    self._cv.wait()
                if self.closed:
                    return
                j, slot = job
                self._holds[slot] = None
                self._reading[slot] = j
                after, self._after[slot] = self._after[slot], None
            try:
                if after is not None:
                    after.synchronize()  # the device copy out of this buffer has finished
                t0 = time.perf_counter()
                read_file_into(self._fd(j), bytes_of(self.buffers[slot])[: self.sizes[j]], self.cache.layer_path(j))
                elapsed = time.perf_counter() - t0
            except BaseException as exc:  # surfaced to the runtime by acquire()
                with self._cv:
                    self._error = exc
                    self._reading[slot] = None
                    self._cv.notify_all()
                return
            with self._cv:
                self._reading[slot] = None
                self._holds[slot] = j
                self._used[slot] = time.perf_counter()
                self.bytes_read += self.sizes[j]
                self.reads += 1
                self.read_s += elapsed
                self._cv.notify_all()

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(self.cache.layer_path(i), os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    # ------------------------------------------------------------------ lifetime
    def stats(self) -> dict:
        return {
            "layers": len(self.layers),
            "bytes": sum(self.sizes.values()),
            "cache_dir": self.cache.path,
            "ring_bytes": self.ring_bytes,
            "reads": self.reads,
            "bytes_read": self.bytes_read,
            "read_s": round(self.read_s, 6),
            "wait_s": round(self.wait_s, 6),
            "read_gb_per_s": round(self.bytes_read / self.read_s / 1e9, 3) if self.read_s > 0 else None,
        }

    def reset_stats(self) -> None:
        self.bytes_read, self.reads, self.read_s, self.wait_s = 0, 0, 0.0, 0.0

    def close(self) -> None:
        """Stop the loader thread and close every file. Idempotent."""
        with self._cv:
            if self.closed:
                return
            self.closed = True
            self._cv.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}
        self.buffers = []
