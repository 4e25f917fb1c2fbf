"""Trunk and forks: a packed group that does not fit runs as its prompt once, then each branch.

The trunk (the shared prompt) runs once and leaves its keys and values of every layer behind;
each fork (one completion) then runs only its own tokens, attending to those keys and values
through a cache, so no piece ever holds more than one of prompt, chosen, rejected.

Because the preference loss couples the forks, the exact gradient of the whole group needs each
fork's upstream gradient before any fork backpropagates. :class:`TrunkForksFunction` gets it from
autograd itself: its forward computes the group's final hidden states without a graph (trunk,
then forks), the trainer's own loss runs on them, and the loss's backward hands this function the
gradient with respect to every hidden state. Only then are the pieces recomputed with a graph:

1. the trunk, with its per-layer keys/values recorded;
2. each fork against detached copies of those keys/values (leaves), backpropagating its slice of
   the gradient into the adapters and into the leaves, then freed;
3. one trunk backward, from the trunk's own hidden-state gradient plus the leaves' accumulated
   gradients.

An out-of-memory error in any of these puts the adapters' gradients back as they were and runs
each fork as a full ``prompt + completion`` sequence instead (the prompt's gradient goes with the
first fork of its group), which gives the same gradient.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

logger = logging.getLogger(__name__)


class RecordingCache:
    """Records the first keys/values each layer produces and passes them through unchanged.

    A checkpointed layer runs twice (forward and recompute); the recompute's update is not
    recorded again, so the cache is safe to hand to checkpointed layers (``deg_replay_safe``)."""

    deg_replay_safe = True

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.kv.setdefault(layer_idx, (key_states, value_states))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class PrefixCache:
    """Read-only keys/values of a trunk, put in front of each layer's own (replay-safe)."""

    deg_replay_safe = True

    def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.kv = kv

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.kv[layer_idx]
        return torch.cat([k, key_states], dim=-2), torch.cat([v, value_states], dim=-2)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return next(iter(self.kv.values()))[0].shape[-2] if self.kv else 0


class TrunkForks:
    """Runs one packed plan as trunks and forks. ``call(ids, positions, prefix, cache)`` runs the
    decoder backbone on ``ids`` placed after ``prefix`` cached tokens and returns its final
    hidden states."""

    def __init__(self, plan, call, *, params, fault=None, stats=None):
        self.plan = plan
        self.call = call
        self.params = params  # callable: the trainable parameters (their grads are snapshotted)
        self.fault = fault or (lambda phase: None)
        self.stats = stats if stats is not None else Counter()

    # ------------------------------------------------------------------ pieces
    def _pieces(self, g):
        p, spans = self.plan.groups[g]
        ids = self.plan.input_ids[g]
        return p, ids[:p], [(o, n, ids[o:o + n]) for o, n in spans]

    def _positions(self, start, n, device):
        return torch.arange(start, start + n, device=device)[None]

    def _trunk(self, prompt):
        cache = RecordingCache()
        h = self.call(prompt[None], self._positions(0, prompt.numel(), prompt.device), 0, cache)
        return h, cache.kv

    def _fork(self, p, tail, kv):
        cache = PrefixCache(kv) if p else None
        return self.call(tail[None], self._positions(p, tail.numel(), tail.device), p, cache)

    # ------------------------------------------------------------------ no-graph forward
    def forward(self) -> torch.Tensor:
        """The packed ``[G, T, H]`` final hidden states, computed trunk then forks."""
        out = None
        for g in range(len(self.plan.groups)):
            p, prompt, forks = self._pieces(g)
            kv = {}
            if p:
                h, kv = self._trunk(prompt)
                out = self._place(out, g, 0, h)
            for o, _, tail in forks:
                out = self._place(out, g, o, self._fork(p, tail, kv))
        return out

    def _place(self, out, g, offset, h):
        if out is None:
            groups, t = self.plan.input_ids.shape
            out = h.new_zeros(groups, t, h.shape[-1])
        out[g, offset:offset + h.shape[1]] = h[0]
        return out

    # ------------------------------------------------------------------ backward
    def backward(self, grad: torch.Tensor) -> None:
        from deg_hf.memory.split_retry import is_oom

        params = list(self.params())
        snapshot = [None if q.grad is None else q.grad.detach().clone() for q in params]
        with torch.enable_grad():
            try:
                self._trunk_backward(grad)
                self.stats["trunk_forks"] += 1
                return
            except Exception as exc:
                if not is_oom(exc):
                    raise
                for q, saved in zip(params, snapshot):
                    q.grad = saved
                del snapshot
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.stats["fork_fallbacks"] += 1
                logger.warning("trunk-and-forks ran out of memory (%s); running each completion as a full "
                               "sequence instead", str(exc).splitlines()[0][:120])
            self._rows_backward(grad)

    def _trunk_backward(self, grad):
        for g in range(len(self.plan.groups)):
            p, prompt, forks = self._pieces(g)
            if not p:
                for o, n, tail in forks:
                    self.fault("fork_forward")
                    h = self._fork(0, tail, {})
                    torch.autograd.backward(h, grad[g, o:o + n][None])
                    self.fault("fork_backward")
                continue
            h_trunk, kv = self._trunk(prompt)
            leaves = {i: (k.detach().requires_grad_(), v.detach().requires_grad_()) for i, (k, v) in kv.items()}
            for o, n, tail in forks:
                self.fault("fork_forward")
                h = self._fork(p, tail, leaves)
                torch.autograd.backward(h, grad[g, o:o + n][None])
                del h
                self.fault("fork_backward")
            self.fault("trunk_backward")
            tensors, grads = [h_trunk], [grad[g, :p][None]]
            for i, (k, v) in kv.items():
                for t, leaf in ((k, leaves[i][0]), (v, leaves[i][1])):
                    if leaf.grad is not None:
                        tensors.append(t)
                        grads.append(leaf.grad)
            torch.autograd.backward(tensors, grads)

    def _rows_backward(self, grad):
        for g in range(len(self.plan.groups)):
            p, prompt, forks = self._pieces(g)
            if not forks:
                h = self.call(prompt[None], self._positions(0, p, prompt.device), 0, None)
                torch.autograd.backward(h, grad[g, :p][None])
                continue
            for k, (o, n, tail) in enumerate(forks):
                ids = torch.cat([prompt, tail])
                h = self.call(ids[None], self._positions(0, p + n, ids.device), 0, None)
                head = grad[g, :p] if k == 0 else torch.zeros_like(grad[g, :p])
                torch.autograd.backward(h, torch.cat([head, grad[g, o:o + n]])[None])


class TrunkForksFunction(torch.autograd.Function):
    """Forward: the no-graph packed hidden states. Backward: the pieces with a graph (see module)."""

    @staticmethod
    def forward(ctx, anchor, runner):
        ctx.runner = runner
        with torch.no_grad():
            return runner.forward()

    @staticmethod
    def backward(ctx, grad):
        ctx.runner.backward(grad)
        ctx.runner = None
        return None, None


def run(runner: TrunkForks) -> torch.Tensor:
    if not torch.is_grad_enabled():
        return runner.forward()
    anchor = torch.zeros((), requires_grad=True)  # puts the function in the graph
    return TrunkForksFunction.apply(anchor, runner)
