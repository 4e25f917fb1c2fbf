"""PrefixSharing: the decoder backbone runs each shared prompt once per paired forward.

It sits on the backbone (``LlamaModel`` under ``LlamaForCausalLM``...), below TRL's LM head and
loss code: the trainer says which rows are pairs and how long their prompts are
(:meth:`PrefixSharing.pairs`), the backbone call is packed (:mod:`deg_hf.prefix.pack`), and the
hidden states come back in the caller's ``[chosen rows; rejected rows]`` layout. So TRL's fused
LM head, its loss zoo, its metrics and its reference pass (the same call, adapter disabled) run
unchanged, and streaming sees one layer sweep per pass.

Where a tree mask cannot be honoured it runs the ordinary forward and says why, once per reason:
attention kernels without arbitrary masks, hybrid (linear-attention) layers, a sliding window
shorter than the rows, pairs whose rows do not share their prompt, and calls it does not
understand (extra inputs such as images, MoE router logits).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections import Counter

import torch

from deg_hf.prefix import pack, trunk

logger = logging.getLogger(__name__)

_MASKABLE_ATTN = ("eager", "sdpa")
_PASSED_KWARGS = ("use_cache", "return_dict", "cache_position")


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def static_reason(config) -> str | None:
    """Why this model can never take the tree mask, or None."""
    text = _text_config(config)
    impl = getattr(config, "_attn_implementation", None) or getattr(text, "_attn_implementation", None) or "eager"
    if impl not in _MASKABLE_ATTN:
        return f"the {impl} attention implementation takes no arbitrary attention mask"
    odd = sorted({t for t in (getattr(text, "layer_types", None) or [])
                  if t not in ("full_attention", "sliding_attention")})
    if odd:
        return f"hybrid layers ({', '.join(odd)}) cannot take a tree attention mask"
    if getattr(text, "is_encoder_decoder", False):
        return "encoder-decoder models have no shared decoder prefix"
    return None


def sliding_window(config) -> int | None:
    """The sliding window some layer applies, or None."""
    text = _text_config(config)
    window = getattr(text, "sliding_window", None)
    if not window:
        return None
    types = getattr(text, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    if getattr(text, "use_sliding_window", True) is False:
        return None
    return int(window)


class PrefixSharing:
    def __init__(self, model, *, trainable=None, fault=None, resident_layers=()):
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        backbone = getattr(causal, "base_model", causal)
        self.config = causal.config
        self.backbone = backbone
        self.reason = static_reason(self.config)
        if backbone is causal:
            self.reason = self.reason or "the model exposes no separate decoder backbone"
        self.window = sliding_window(self.config)
        self._original = backbone.forward
        params = inspect.signature(self._original).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.pad_token_id = getattr(_text_config(self.config), "pad_token_id", None) or 0
        self.attn = getattr(self.config, "_attn_implementation", None) or "eager"
        self.trainable = trainable or (lambda: [p for p in model.parameters() if p.requires_grad])
        self.fault = fault
        self.resident_layers = list(resident_layers)
        self.mode = "packed"
        self.prompt_lens: list[int] | None = None
        self.stats: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self._plan_key = None
        self._plan = None
        backbone.forward = self._forward

    @property
    def available(self) -> bool:
        return self.reason is None

    # ------------------------------------------------------------------ the trainer's side
    @contextlib.contextmanager
    def pairs(self, prompt_lens: list[int]):
        """Backbone calls on ``len(prompt_lens)`` rows inside this block are paired rows
        ``[chosen; rejected]`` whose first ``prompt_lens[r]`` tokens are the prompt."""
        previous = self.prompt_lens
        self.prompt_lens = list(prompt_lens)
        try:
            yield
        finally:
            self.prompt_lens = previous

    @contextlib.contextmanager
    def use_mode(self, mode: str):
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous

    def plan(self, input_ids, attention_mask, prompt_lens) -> pack.PackPlan:
        """The pack plan for these rows; raises :class:`pack.NotPackable` with the reason."""
        if self.reason is not None:
            raise pack.NotPackable(self.reason)
        key = (input_ids.data_ptr(), tuple(input_ids.shape), tuple(prompt_lens),
               None if attention_mask is None else attention_mask.data_ptr())
        if key == self._plan_key and torch.equal(self._plan_ids, input_ids):
            return self._plan
        plan = pack.build(input_ids, attention_mask, prompt_lens, self.pad_token_id)
        if self.window is not None and max(plan.row_lens, default=0) >= self.window:
            raise pack.NotPackable(
                f"sliding-window attention (window {self.window}) is shorter than the longest row "
                f"({max(plan.row_lens)} tokens)")
        self._plan_key, self._plan, self._plan_ids = key, plan, input_ids.clone()
        return plan

    def note_fallback(self, reason: str) -> None:
        if reason not in self.fallbacks:
            logger.warning("prefix sharing off: %s; running the ordinary forward", reason)
        self.fallbacks[reason] += 1
        self.stats["fallback_calls"] += 1

    # ------------------------------------------------------------------ the backbone's side
    def _forward(self, *args, **kwargs):
        lens = self.prompt_lens
        if lens is None:
            return self._original(*args, **kwargs)
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
            args = args[1:]
        input_ids = kwargs.get("input_ids")
        if input_ids is None or args or input_ids.dim() != 2 or input_ids.shape[0] != len(lens):
            return self._original(*args, **kwargs)
        unknown = sorted(k for k, v in kwargs.items()
                         if k not in ("input_ids", "attention_mask", *_PASSED_KWARGS)
                         and v is not None and v is not False)
        try:
            if unknown:
                raise pack.NotPackable(f"the forward also takes {', '.join(unknown)}")
            plan = self.plan(input_ids, kwargs.get("attention_mask"), lens)
        except pack.NotPackable as exc:
            self.note_fallback(str(exc))
            return self._original(*args, **kwargs)
        rest = {k: v for k, v in kwargs.items() if k in ("return_dict",)}
        self.stats["tokens_packed"] += plan.tokens_packed
        self.stats["tokens_rows"] += plan.tokens_rows
        if self.mode == "trunk_forks":
            self.stats["trunk_forks_calls"] += 1
            runner = trunk.TrunkForks(
                plan, lambda ids, pos, prefix, cache: self._call(ids, pos, prefix, cache, rest),
                params=self.trainable, fault=self._fault, stats=self.stats)
            packed = trunk.run(runner)
        else:
            self.stats["packed_calls"] += 1
            mask = self._tree_mask(plan)
            out = self._original(input_ids=plan.input_ids, attention_mask=mask, position_ids=plan.position_ids,
                                 use_cache=False, **rest)
            packed = out.last_hidden_state
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=plan.unpack(packed))

    def _dtype(self):
        embed = self.backbone.get_input_embeddings()
        return embed.weight.dtype if embed is not None else torch.float32

    def _tree_mask(self, plan):
        mask = plan.mask(self._dtype())
        return mask == 0 if self.attn == "sdpa" else mask

    def _causal(self, n, prefix, device):
        allowed = torch.ones(n, prefix + n, dtype=torch.bool, device=device).tril(diagonal=prefix)
        if self.attn == "sdpa":
            return allowed[None, None]
        dtype = self._dtype()
        out = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        return out[None, None]

    def _call(self, ids, positions, prefix, cache, rest):
        mask = self._causal(ids.shape[1], prefix, ids.device)
        kwargs = dict(rest)
        if cache is not None:
            kwargs[self.cache_kw] = cache
        with self._layers_keep_cache():
            out = self._original(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                                 **kwargs)
        return out.last_hidden_state

    @contextlib.contextmanager
    def _layers_keep_cache(self):
        """Resident layers under transformers' checkpointing drop a cache unless told it is safe to
        keep (ours are replay-safe); under reentrant checkpointing the recorded keys/values would
        carry no graph, so checkpointing is off for those calls."""
        changed = []
        for layer in self.resident_layers:
            if not getattr(layer, "gradient_checkpointing", False):
                continue
            func = getattr(layer, "_gradient_checkpointing_func", None)
            reentrant = getattr(func, "keywords", {}).get("use_reentrant", True)
            if reentrant:
                changed.append((layer, "gradient_checkpointing", layer.__dict__.get("gradient_checkpointing")))
                layer.gradient_checkpointing = False
            else:
                changed.append((layer, "_can_checkpoint_with_cache", layer.__dict__.get("_can_checkpoint_with_cache")))
                layer._can_checkpoint_with_cache = True
        try:
            yield
        finally:
            for layer, name, old in changed:
                if old is None:
                    layer.__dict__.pop(name, None)
                else:
                    setattr(layer, name, old)

    def _fault(self, phase: str) -> None:
        if self.fault is not None:
            self.fault(phase)

    def summary(self) -> dict:
        out = dict(self.stats)
        out["enabled"] = self.available
        if self.reason:
            out["reason"] = self.reason
        if self.fallbacks:
            out["fallbacks"] = dict(self.fallbacks)
        return out
