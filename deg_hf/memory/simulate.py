"""A CPU stand-in for device memory, so the out-of-memory path runs in CI without a GPU.

While a part runs, every tensor autograd saves for the backward (seen through saved-tensor hooks)
is added to a running total; when the total passes ``budget_bytes`` the simulator raises
``torch.OutOfMemoryError`` from inside the forward, exactly where a real allocation would fail.
Under streaming, layers are checkpointed, so what it counts is what stays alive across the forward:
each layer's input, the LM head's inputs and the loss's tensors. It grows with rows x length, like
the real activation peak.
"""

from __future__ import annotations

import contextlib

import torch


class SimulatedDeviceMemory:
    def __init__(self, budget_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self.peaks: list[int] = []  # saved bytes of each part that ran to the end
        self.raised = 0  # parts stopped by the budget

    @contextlib.contextmanager
    def part(self, info=None):
        seen: set = set()
        state = {"bytes": 0}

        def pack(tensor):
            key = (tensor.untyped_storage().data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key not in seen and not isinstance(tensor, torch.nn.Parameter):
                seen.add(key)
                state["bytes"] += tensor.numel() * tensor.element_size()
                if state["bytes"] > self.budget_bytes:
                    self.raised += 1
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory. (simulated) {state['bytes']} bytes of saved activations "
                        f"exceed the simulated budget of {self.budget_bytes} bytes"
                    )
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self
        self.peaks.append(state["bytes"])
