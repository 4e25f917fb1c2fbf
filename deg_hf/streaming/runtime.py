"""Device buffers and layer fetches: the moving part of layer streaming.

The runtime owns ``n_buffers`` flat device buffers, each as large as the largest layer. Layer ``i``
always lands in buffer ``i % n_buffers``; a buffer that already holds the requested layer is reused
without a copy (the last layer of a forward is the first of the backward recompute, and the first
layer of a backward is the first of the next forward).

On CUDA the next layer in the direction of travel is prefetched on a side stream: forward passes
walk up, backward recomputes walk down. Events order the copy after the compute that last read the
buffer, and the compute after the copy that fills it. On CPU the copies are plain ``copy_`` calls.

A 4-bit store's blocks are copied as they are (packed); each buffer then has a compute buffer beside
it, into which the fetch dequantizes the layer's 4-bit weights on the compute stream. A buffer that
still holds the layer's dequantized weights is reused as it is.
"""

from __future__ import annotations

import time
import weakref

import torch

from deg_hf.config import check_setting
from deg_hf.streaming.quant import SEP, dequantize_into
from deg_hf.streaming.store import WeightStore


class RuntimeClosed(RuntimeError):
    pass


class StreamRuntime:
    def __init__(self, store: WeightStore, device: torch.device | str, n_buffers: int = 2):
        check_setting("stream_buffers", n_buffers)
        self.store = store
        self.device = torch.device(device)
        self.n_buffers = n_buffers
        self.n_layers = store.n_layers
        self._cuda = self.device.type == "cuda"
        self.buffers = [
            torch.empty(store.max_layer_bytes, dtype=torch.uint8, device=self.device) for _ in range(n_buffers)
        ]
        self.compute = [
            torch.empty(store.max_compute_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(n_buffers if store.quantized else 0)
        ]
        self._holds: list[int | None] = [None] * n_buffers  # layer index each buffer holds
        self._dequantized: list[int | None] = [None] * n_buffers  # layer whose weights each compute buffer holds
        self._ready: list = [None] * n_buffers  # CUDA event: copy into buffer finished
        self._released: list = [None] * n_buffers  # CUDA event: compute done with buffer's last layer
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._last: int | None = None
        self.closed = False
        self.reset_stats()
        self._finalizer = weakref.finalize(self, _release, self.buffers, self.compute, store)

    # ------------------------------------------------------------------ stats
    def reset_stats(self) -> None:
        self.loads = 0  # layer copies host -> device
        self.hits = 0  # fetches served by a buffer that already held the layer
        self.bytes_moved = 0
        self.wait_s = 0.0  # CUDA: time the compute stream waited for a copy (measured, synchronising)
        if getattr(self.store, "disk", None) is not None:
            self.store.disk.reset_stats()
        self.dequantized = 0  # layers dequantized into a compute buffer
        self._dequant_s = 0.0
        self._dequant_events: list = []  # CUDA: (start, end) event pairs, summed by stats()
        self._in_flight_peak = 0

    def stats(self) -> dict:
        buffer_bytes = sum(b.numel() for b in self.buffers)
        compute_bytes = sum(b.numel() for b in self.compute)
        return {
            "n_layers": self.n_layers,
            "n_buffers": self.n_buffers,
            "store_bytes": self.store.nbytes if not self.closed else 0,
            "store_unquantized_bytes": self.store.unquantized_bytes,
            "store_pinned": self.store.pinned,
            # one store per node shared by its local ranks (how many), or this rank's own
            "store_shared": self.store.share_stats(),
            "quantization": self.store.quantization(),
            "buffer_bytes": buffer_bytes,
            "compute_buffer_bytes": compute_bytes,
            "loads": self.loads,
            "hits": self.hits,
            "bytes_moved": self.bytes_moved,
            "dequantized": self.dequantized,
            "dequantize_s": round(self.dequantize_seconds(), 6),
            "device_bytes": buffer_bytes + compute_bytes if not self.closed else 0,
            "device_bytes_peak": self.n_buffers * (self.store.max_layer_bytes + self.store.max_compute_bytes),
            "in_flight_peak": self._in_flight_peak,
            "fetch_wait_s": round(self.wait_s, 6),
            "tiers": self.store.tier_stats(),
            "closed": self.closed,
        }

    def dequantize_seconds(self) -> float:
        """Time spent dequantizing 4-bit weights (on CUDA measured with events, read here)."""
        if self._dequant_events:
            torch.cuda.synchronize(self.device)
            self._dequant_s += sum(a.elapsed_time(b) for a, b in self._dequant_events) / 1000.0
            self._dequant_events = []
        return self._dequant_s

    # ------------------------------------------------------------------ fetch
    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        """Views of layer ``i``'s weights on the device, valid until the buffer is reused."""
        if self.closed:
            raise RuntimeClosed("the streaming runtime is closed; build a new trainer to train again")
        slot = i % self.n_buffers
        if self._cuda:
            # everything enqueued so far belongs to earlier layers: once the compute stream reaches
            # this point, no buffer but the one being fetched is read any more
            released = torch.cuda.Event()
            released.record(torch.cuda.current_stream(self.device))
            for s in range(self.n_buffers):
                if s != slot:
                    self._released[s] = released
        ahead = self._ahead(i, 2)
        if self._holds[slot] == i:
            self.hits += 1
            self.store.prefetch(ahead)  # keep the disk loader ahead of the compute
        else:
            self._copy(i, slot, ahead)
        if self._cuda:
            t0 = time.perf_counter()
            torch.cuda.current_stream(self.device).wait_event(self._ready[slot])
            self.wait_s += time.perf_counter() - t0
            if self.n_buffers > 1 and ahead:
                self._prefetch(ahead[0], ahead[1:])
        self._in_flight_peak = max(self._in_flight_peak, sum(h is not None for h in self._holds))
        self._last = i
        layout = self.store.layouts[i]
        views = layout.views(self.buffers[slot])
        if not layout.quantized:
            return views
        computed = layout.compute.views(self.compute[slot])
        if self._dequantized[slot] != i:
            self._dequantize(layout, views, computed)
            self._dequantized[slot] = i
        weights = {n: v for n, v in views.items() if SEP not in n}
        weights.update(computed)
        return weights

    def _dequantize(self, layout, pieces: dict, out: dict) -> None:
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        for name, meta in layout.quantized.items():
            dequantize_into(name, meta, pieces, out[name])
        if self._cuda:
            end.record()
            self._dequant_events.append((start, end))
        else:
            self._dequant_s += time.perf_counter() - t0
        self.dequantized += 1

    def _ahead(self, i: int, k: int) -> list[int]:
        """The ``k`` layers expected after ``i``, nearest first. Forward passes walk up and backward
        recomputes walk down; at the top layer a pass with gradients turns into its backward, while
        one without gradients (a reference or evaluation pass) is followed by the next forward."""
        top = self.n_layers - 1
        if i == top:
            if not torch.is_grad_enabled():
                return [j for j in range(k) if j != i]
            step = -1
        elif i == 0:
            step = 1
        else:
            step = 1 if self._last is None or i > self._last else -1
        return [j for j in range(i + step, i + step * (k + 1), step) if 0 <= j <= top]

    def _prefetch(self, j: int, then: list[int]) -> None:
        # a block still on its way from disk is not waited for here: the compute would stall
        if self._holds[j % self.n_buffers] == j or not self.store.ready(j):
            return
        self._copy(j, j % self.n_buffers, then)

    def _copy(self, i: int, slot: int, ahead: list[int] = ()) -> None:
        src = self.store.block(i, ahead)
        dst = self.buffers[slot][: src.numel()]
        if self._cuda:
            stream = self._copy_stream
            if self._released[slot] is not None:
                stream.wait_event(self._released[slot])
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=src.is_pinned())
                ready = torch.cuda.Event()
                ready.record(stream)
            self._ready[slot] = ready
            self.store.release(i, ready)
        else:
            dst.copy_(src)
            self.store.release(i)
        self._holds[slot] = i
        self._dequantized[slot] = None
        self.loads += 1
        self.bytes_moved += src.numel()

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the device buffers and the host store. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._finalizer()
        self.buffers = []
        self.compute = []
        self._holds = [None] * self.n_buffers
        self._dequantized = [None] * self.n_buffers
        self._ready = [None] * self.n_buffers
        self._released = [None] * self.n_buffers
        self._copy_stream = None


def _release(buffers: list, compute: list, store: WeightStore) -> None:
    buffers.clear()
    compute.clear()
    store.close()
