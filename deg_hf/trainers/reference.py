"""An explicit ``ref_model`` passed to a streamed DPO or KTO trainer.

Under streaming the reference is the streamed base with the adapter disabled, so a second model
adds nothing but memory. Many scripts pass one anyway (a second ``from_pretrained`` of the same
base): it is accepted when it *is* the policy's base, and then released. It counts as the base when
its config matches and every tensor equals the base's (compared in the narrower of the two dtypes,
so a float32 copy of a bfloat16 checkpoint still matches); when the tensors cannot be compared (a
quantized or offloaded copy, or a base stored 4-bit), when it comes from the same source (same
name or path, same revision). Anything else (another checkpoint, edited weights, an adapter on it)
is refused with the difference named: silently replacing a different reference would change the
loss.
"""

from __future__ import annotations

import os

import torch

#: config entries that say how a model was loaded, not which model it is
_LOADING_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "use_cache", "pad_token_id", "_experts_implementation",
})


def release_if_base(ref_model, policy) -> str:
    """Check ``ref_model`` against the streamed ``policy`` (before any adapter is applied, or a
    ``PeftModel`` over the streamed base). When it is the base, free its weights and return a note
    saying why it was accepted; otherwise raise ``ValueError`` naming the difference."""
    from peft import PeftModel

    if isinstance(ref_model, PeftModel):
        raise ValueError(
            "ref_model carries a PEFT adapter, so it is not the streamed base the reference is taken from. "
            "Drop ref_model (the reference is the base with the adapter disabled), or set "
            "stream_layers=False to train resident against this reference."
        )
    if not isinstance(ref_model, torch.nn.Module):
        raise TypeError(f"ref_model must be a loaded model, got {type(ref_model).__name__}")
    base = policy.get_base_model() if isinstance(policy, PeftModel) else policy
    _check_config(ref_model, base)
    how = _same_tensors(ref_model, base)
    if how is None:
        how = _same_source(ref_model, base)
    free_weights(ref_model)
    return (
        f"ref_model is the streamed base ({how}): its weights were released, and the reference is the "
        "streamed base with the adapter disabled (no second model is kept)"
    )


def free_weights(module: torch.nn.Module) -> None:
    """Release the storage of every parameter and buffer of ``module``: each keeps its name, shape
    and dtype, on ``meta``."""
    torch.nn.Module.to_empty(module, device="meta")


def _check_config(ref_model, base) -> None:
    ref_cfg, base_cfg = getattr(ref_model, "config", None), getattr(base, "config", None)
    if ref_cfg is None or base_cfg is None:
        return
    if type(ref_model).__name__ != type(base).__name__:
        raise ValueError(
            f"ref_model is a {type(ref_model).__name__}, the streamed base a {type(base).__name__}: a "
            "different model is not the base. Drop ref_model, or set stream_layers=False to train "
            "resident against it."
        )
    ref_dict, base_dict = ref_cfg.to_dict(), base_cfg.to_dict()
    differs = sorted(
        k for k in set(ref_dict) | set(base_dict)
        if k not in _LOADING_KEYS and not k.startswith("_") and ref_dict.get(k) != base_dict.get(k)
    )
    if differs:
        key = differs[0]
        raise ValueError(
            f"ref_model's config differs from the streamed base's ({key}: {ref_dict.get(key)!r} vs "
            f"{base_dict.get(key)!r}{', and more' if len(differs) > 1 else ''}), so it is another model. "
            "Drop ref_model (the reference is the base with the adapter disabled), or set "
            "stream_layers=False to train resident against it."
        )


def _base_state(base) -> dict:
    """The base's tensors by checkpoint name (streamed layers as views of the host store)."""
    from deg_hf.streaming.layer import store_name

    out = {}
    for key, value in base.state_dict().items():
        if "lora_" in key or ".modules_to_save." in key:
            continue
        out[store_name(key)] = value
    return out


def _readable(ref_model, tensors: dict) -> bool:
    if getattr(ref_model, "is_quantized", False) or getattr(ref_model, "hf_device_map", None):
        return False
    return not any(t.is_meta for t in tensors.values())


def _same_tensors(ref_model, base) -> str | None:
    """A description when every tensor of ``ref_model`` equals the base's; None when they cannot be
    read; raises when they differ."""
    ref_state = ref_model.state_dict()
    if not _readable(ref_model, ref_state):
        return None
    base_state = _base_state(base)
    if any(t.is_meta for t in base_state.values()):
        return None  # weights the store holds 4-bit exist only packed: nothing to compare with
    missing = sorted(set(base_state) - set(ref_state))
    extra = sorted(set(ref_state) - set(base_state))
    if missing or extra:
        which = f"lacks {missing[0]!r}" if missing else f"has {extra[0]!r}, which the base does not"
        raise ValueError(
            f"ref_model {which}, so it is not the streamed base. Drop ref_model (the reference is the base "
            "with the adapter disabled), or set stream_layers=False to train resident against it."
        )
    for key, ours in base_state.items():
        theirs = ref_state[key]
        if theirs.shape != ours.shape or not _equal(theirs, ours):
            raise ValueError(
                f"ref_model's weights differ from the streamed base's (first: {key}), so it is not the base: "
                "another checkpoint, or weights changed in memory. Drop ref_model to use the base with the "
                "adapter disabled, or set stream_layers=False to train resident against this reference."
            )
    return f"all {len(base_state)} tensors equal the base's"


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal in the narrower of the two dtypes (a float32 copy of bfloat16 weights matches them)."""
    if a.dtype != b.dtype and a.is_floating_point() and b.is_floating_point():
        if a.element_size() == b.element_size():
            return False  # float16 vs bfloat16: no common rounding to compare in
        narrow = a.dtype if a.element_size() < b.element_size() else b.dtype
        a, b = a.to(narrow), b.to(narrow)
    return torch.equal(a.to(b.device), b)


def _source(model) -> tuple[str, str | None]:
    name = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    if name and os.path.isdir(name):
        name = os.path.realpath(name)
    return name, getattr(model.config, "_commit_hash", None)


def _same_source(ref_model, base) -> str:
    (ref_name, ref_rev), (base_name, base_rev) = _source(ref_model), _source(base)
    if ref_name and ref_name == base_name and (ref_rev is None or base_rev is None or ref_rev == base_rev):
        return f"its tensors cannot be compared here, but it was loaded from the same source, {ref_name}"
    raise ValueError(
        f"ref_model's weights cannot be compared with the streamed base's (quantized or offloaded), and it comes "
        f"from {ref_name or 'an unknown source'} rather than the base's {base_name or 'unknown source'}. Drop "
        "ref_model (the reference is the base with the adapter disabled), or set stream_layers=False."
    )
