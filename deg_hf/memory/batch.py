"""Cutting a collated micro-batch into examples, whatever trainer collated it.

Every tensor (or list) whose first dimension is the number of examples ``B`` is indexed by
example. TRL's DPO stacks ``[chosen rows; rejected rows]``, so its row tensors have ``2 * B`` rows
and example ``i`` owns rows ``i`` and ``B + i``. After selecting examples, columns that are padding
in every remaining row are trimmed, so a part is exactly what the collator would have produced for
those examples alone.
"""

from __future__ import annotations

from typing import Any

import torch

_ROW_KEYS = ("input_ids", "attention_mask", "labels", "completion_mask", "position_ids", "token_type_ids",
             "loss_mask", "assistant_masks", "shift_labels")


def main_key(inputs: dict) -> str:
    for key in ("input_ids", "chosen_input_ids", "prompt_input_ids"):
        if isinstance(inputs.get(key), torch.Tensor):
            return key
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return key
    raise ValueError("cannot find the batch dimension: no tensor in the micro-batch")


def n_examples(inputs: dict, stacked_pairs: bool) -> int:
    rows = inputs[main_key(inputs)].shape[0]
    if stacked_pairs and main_key(inputs) == "input_ids":
        if rows % 2:
            raise ValueError(f"a stacked-pairs batch has an even number of rows, got {rows}")
        return rows // 2
    return rows


def select(inputs: dict, idx: list[int], stacked_pairs: bool) -> dict:
    """The micro-batch restricted to examples ``idx`` (in that order), padding trimmed."""
    b = n_examples(inputs, stacked_pairs)
    index = torch.as_tensor(idx, dtype=torch.long)
    pair_index = torch.cat([index, index + b]) if stacked_pairs else index
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            if stacked_pairs and value.shape[0] == 2 * b:
                out[key] = value.index_select(0, pair_index.to(value.device))
            elif value.shape[0] == b:
                out[key] = value.index_select(0, index.to(value.device))
            else:
                out[key] = value
        elif isinstance(value, (list, tuple)) and len(value) == b:
            out[key] = type(value)(value[i] for i in idx)
        else:
            out[key] = value
    return trim_padding(out)


def _groups(inputs: dict) -> list[tuple[str, list[str]]]:
    """(mask key, keys padded along with it) for every attention mask in the batch."""
    groups = []
    for key, value in inputs.items():
        if not key.endswith("attention_mask") or not isinstance(value, torch.Tensor) or value.dim() != 2:
            continue
        prefix = key[: -len("attention_mask")]
        members = [
            k for k, v in inputs.items()
            if k.startswith(prefix) and k[len(prefix):] in _ROW_KEYS
            and isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape == value.shape
        ]
        groups.append((key, members))
    return groups


def trim_padding(inputs: dict) -> dict:
    out = dict(inputs)
    for mask_key, members in _groups(inputs):
        mask = inputs[mask_key]
        used = mask.bool().any(dim=0).nonzero()
        if used.numel() == 0:
            continue
        lo, hi = int(used.min()), int(used.max()) + 1
        if lo == 0 and hi == mask.shape[1]:
            continue
        for key in members:
            out[key] = inputs[key][:, lo:hi]
    return out


def row_lengths(inputs: dict, stacked_pairs: bool) -> list[tuple[int, ...]]:
    """Per example, the true (unpadded) length of each of its rows."""
    b = n_examples(inputs, stacked_pairs)
    if stacked_pairs and "attention_mask" in inputs:
        lengths = inputs["attention_mask"].sum(dim=1).tolist()
        return [(int(lengths[i]), int(lengths[b + i])) for i in range(b)]
    masks = [k for k in inputs if k.endswith("attention_mask") and isinstance(inputs[k], torch.Tensor)
             and inputs[k].dim() == 2 and inputs[k].shape[0] == b]
    if not masks:
        width = inputs[main_key(inputs)].shape[-1]
        return [(int(width),) for _ in range(b)]
    # one row per mask group (ORPO/CPO keep chosen and rejected in separate tensors; KTO has KL rows)
    per_mask = [inputs[k].sum(dim=1).tolist() for k in masks if not k.startswith("prompt_")]
    per_mask = per_mask or [inputs[masks[0]].sum(dim=1).tolist()]
    return [tuple(max(1, int(m[i])) for m in per_mask) for i in range(b)]


def label_tokens(inputs: dict, stacked_pairs: bool, idx: list[int] | None = None) -> int:
    """Labelled (loss-bearing) tokens of the examples ``idx``, counted as a causal LM counts them."""
    part = inputs if idx is None else select(inputs, idx, stacked_pairs)
    if isinstance(part.get("shift_labels"), torch.Tensor):
        return int(part["shift_labels"].ne(-100).sum())
    if isinstance(part.get("labels"), torch.Tensor):
        return int(part["labels"][..., 1:].ne(-100).sum())
    if isinstance(part.get("completion_mask"), torch.Tensor):
        return int(part["completion_mask"][..., 1:].sum())
    return int(part[main_key(part)].numel())
