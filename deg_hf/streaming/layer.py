"""Make a decoder layer whose base weights live on ``meta`` run with streamed weights.

The layer object itself stays in the model (so it stays attribute-transparent: transformers reads
things like ``attention_type`` straight off it, and state-dict names do not change). Two instance
attributes are set on it, the way accelerate's hooks do:

* ``forward`` fetches the layer's base weights from the runtime and runs the layer's own, unmodified
  forward through ``torch.func.functional_call`` with those weights. With gradients enabled this
  runs under non-reentrant activation checkpointing, so the backward recomputes the layer and
  fetches its weights a second time instead of keeping activations of every layer.
* ``_apply`` (what ``.to()``, ``.cuda()``, ``.float()`` use) leaves ``meta`` parameters alone, so the
  model passes ``Trainer.__init__`` and ``accelerate.prepare`` moving it to the device.

LoRA parameters injected by PEFT are ordinary parameters of the layer: ``functional_call`` only
substitutes the base weights, so adapters run, receive gradients, and can be disabled as usual.
"""

from __future__ import annotations

import threading

import torch
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from deg_hf.streaming.runtime import StreamRuntime

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")

_state = threading.local()  # .inside: the layer's own forward is running under functional_call


def _meta_parameter_names(layer: torch.nn.Module) -> list[str]:
    return [name for name, p in layer.named_parameters() if p.is_meta]


def store_name(name: str) -> str:
    """The checkpoint-side local name of a parameter after PEFT wrapped its module."""
    return name.replace(".base_layer.", ".")


class LayerStream:
    """The streaming state of one decoder layer (kept on the layer as ``_deg_stream``)."""

    def __init__(self, layer: torch.nn.Module, index: int, runtime: StreamRuntime):
        self.index = index
        self.runtime = runtime
        self.layer_ref = layer
        self.calls = 0  # forward passes through this layer (policy, reference, recompute)

    def run(self, *args, **kwargs):
        layer = self.layer_ref
        if getattr(_state, "inside", False):
            # called back by functional_call: the real forward, without transformers' own
            # checkpointing (the streamed call is the checkpoint boundary)
            previous = layer.__dict__.get("gradient_checkpointing", False)
            layer.gradient_checkpointing = False
            try:
                return type(layer).forward(layer, *args, **kwargs)
            finally:
                layer.gradient_checkpointing = previous
        if torch.is_grad_enabled():
            # a KV cache would be written twice (forward and recompute), as in transformers' own
            # checkpointed layers: training does not use one, except the prefix-sharing caches,
            # which are built to be replayed (``deg_replay_safe``)
            for key in _CACHE_KWARGS:
                value = kwargs.get(key)
                if value is not None and not getattr(value, "deg_replay_safe", False):
                    kwargs[key] = None
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            return checkpoint(self._fetch_and_run, *args, use_reentrant=False, **kwargs)
        return self._fetch_and_run(*args, **kwargs)

    def _fetch_and_run(self, *args, **kwargs):
        layer = self.layer_ref
        views = self.runtime.fetch(self.index)
        weights = {name: views[store_name(name)] for name in _meta_parameter_names(layer) if store_name(name) in views}
        self.calls += 1
        _state.inside = True
        try:
            return functional_call(layer, weights, args, kwargs, strict=False)
        finally:
            _state.inside = False

    def apply_keeping_meta(self, fn, recurse: bool = True):
        layer = self.layer_ref
        stash = []
        for module in layer.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    stash.append((module, name, p))
                    module._parameters[name] = None
        try:
            return type(layer)._apply(layer, fn, recurse)
        finally:
            for module, name, p in stash:
                module._parameters[name] = p


    def fill_state_dict(self, module, state_dict, prefix, local_metadata):
        """``state_dict()`` shows the base weights from the host store (views, no copies) rather
        than ``meta`` placeholders, so code that reads or hashes a model's state works on a
        streamed one too."""
        if self.runtime.closed:
            return
        views = self.runtime.store.host_views(self.index)
        for name in _meta_parameter_names(self.layer_ref):
            key = prefix + name
            if key not in state_dict:
                continue
            if store_name(name) in views:
                state_dict[key] = views[store_name(name)]
            else:  # an adapter created on meta, not materialised yet: it has no values to show
                del state_dict[key]


def attach(layer: torch.nn.Module, index: int, runtime: StreamRuntime) -> LayerStream:
    stream = LayerStream(layer, index, runtime)
    layer._deg_stream = stream
    layer.forward = stream.run
    layer._apply = stream.apply_keeping_meta

    def state_dict_hook(module, state_dict, prefix, local_metadata):  # torch tags the hook function
        stream.fill_state_dict(module, state_dict, prefix, local_metadata)

    layer.register_state_dict_post_hook(state_dict_hook)
    return stream


def is_streamed(layer: torch.nn.Module) -> bool:
    return isinstance(getattr(layer, "_deg_stream", None), LayerStream)
