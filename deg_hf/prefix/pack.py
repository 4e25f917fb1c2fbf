"""Pack preference rows that share a prompt into one sequence with a tree attention mask.

A paired micro-batch arrives as ``R = 2B`` right-padded rows ``[chosen rows; rejected rows]``,
each ``prompt + completion``. Rows are grouped by their prompt tokens (a pair's two rows, and every
pair of a ranked dataset that repeats the prompt), and each group becomes one packed row::

    [ prompt | branch 1 | branch 2 | ... ]      positions  0..P-1 | P..P+n1-1 | P..P+n2-1 | ...

where a branch is a distinct completion. The mask lets a branch token see the prompt and the
earlier tokens of its own branch, never another branch, and the position ids restart at ``P`` for
every branch, so each branch token computes what it computes in its own row. :meth:`unpack` lays
the packed hidden states back out as the ``[R, L, H]`` rows the caller expects; the last prompt
position, which predicts the first token of every branch, is copied into each of its rows, so
it is scored once per row as in the ordinary forward, and its gradient is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class NotPackable(ValueError):
    """The rows cannot share a prefix; the message says why."""


@dataclass
class PackPlan:
    rows: int  # R, unpacked rows
    width: int  # L, unpacked padded width
    input_ids: torch.Tensor  # [G, T]
    position_ids: torch.Tensor  # [G, T]
    segments: torch.Tensor  # [G, T]: -1 padding, 0 prompt, k >= 1 branch k
    index: torch.Tensor  # [R, L] into the flattened [G * T] hidden states; G * T means "zero"
    groups: list  # per group: (prompt_len, [(offset, length), ...] per branch)
    prompt_lens: list  # per unpacked row
    row_lens: list  # per unpacked row (real tokens)

    @property
    def tokens_packed(self) -> int:
        """Real tokens the decoder processes packed (prompt once per group, each branch once)."""
        return sum(p + sum(n for _, n in branches) for p, branches in self.groups)

    @property
    def tokens_rows(self) -> int:
        """Real tokens of the rows as the ordinary forward processes them."""
        return sum(self.row_lens)

    def mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[G, 1, T, T]`` mask: 0 where attention is allowed, the dtype's minimum elsewhere."""
        seg = self.segments
        t = seg.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()
        same = seg[:, :, None] == seg[:, None, :]
        prompt_key = (seg == 0)[:, None, :]
        allowed = causal & (same | prompt_key)  # padding queries see earlier padding: never NaN
        out = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
        out.masked_fill_(~allowed, torch.finfo(dtype).min)
        return out[:, None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``[G, T, ...]`` packed states to the ``[R, L, ...]`` rows (zeros at padding)."""
        flat = packed.reshape(-1, *packed.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return flat[self.index.to(packed.device)]

    def to(self, device) -> PackPlan:
        for name in ("input_ids", "position_ids", "segments", "index"):
            setattr(self, name, getattr(self, name).to(device))
        return self


def prompt_lengths_from_mask(completion_mask: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """Per row, the tokens before its first completion token (the whole row when it has none)."""
    lens = []
    for comp, att in zip(completion_mask.tolist(), attention_mask.tolist()):
        n = int(sum(att))
        first = next((i for i, c in enumerate(comp) if c), n)
        lens.append(min(first, n))
    return lens


def prompt_lengths_from_labels(labels: torch.Tensor, attention_mask: torch.Tensor) -> list[int]:
    """Per row, the leading positions whose label is -100 (the prompt, for TRL's ORPO/CPO rows)."""
    lens = []
    for lab, att in zip(labels.tolist(), attention_mask.tolist()):
        n = int(sum(att))
        first = next((i for i, x in enumerate(lab) if x != -100), n)
        lens.append(min(first, n))
    return lens


def prompt_lengths_of_pair_batch(batch: dict) -> list[int] | None:
    """``[chosen rows; rejected rows]`` prompt lengths of a TRL ORPO/CPO batch (separate chosen and
    rejected tensors whose labels are -100 over the prompt)."""
    try:
        chosen = prompt_lengths_from_labels(batch["chosen_labels"], batch["chosen_attention_mask"])
        rejected = prompt_lengths_from_labels(batch["rejected_labels"], batch["rejected_attention_mask"])
    except KeyError:
        return None
    return chosen + rejected


def shared_prompt_lens_of_pair_batch(sharing, batch: dict) -> list[int] | None:
    """Per example, the prompt length of a TRL ORPO/CPO batch when ``sharing`` would pack it."""
    lens = prompt_lengths_of_pair_batch(batch)
    if lens is None or sharing is None:
        return None
    chosen, rejected = batch["chosen_input_ids"], batch["rejected_input_ids"]
    width = max(chosen.shape[1], rejected.shape[1])

    def padded(t, value):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    ids = torch.cat([padded(chosen, 0), padded(rejected, 0)])
    mask = torch.cat([padded(batch["chosen_attention_mask"], 0), padded(batch["rejected_attention_mask"], 0)])
    try:
        sharing.plan(ids, mask, lens)
    except NotPackable:
        return None
    return lens[: chosen.shape[0]]


def build(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, prompt_lens: list[int],
          pad_token_id: int = 0) -> PackPlan:
    """Plan the packing of ``R = 2B`` rows ``[chosen; rejected]``; raises :class:`NotPackable`."""
    rows, width = input_ids.shape
    if rows % 2 or len(prompt_lens) != rows:
        raise NotPackable(f"expected an even number of rows with a prompt length each, got {rows} rows")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.dim() != 2:
        raise NotPackable("the attention mask is not a 2-D padding mask")
    lens = attention_mask.sum(dim=1)
    right_padded = torch.arange(width, device=attention_mask.device)[None, :] < lens[:, None]
    if not torch.equal(attention_mask.bool(), right_padded):
        raise NotPackable("the rows are not right-padded")
    ids = input_ids.tolist()
    row_lens = [int(n) for n in lens.tolist()]
    b = rows // 2
    for i in range(b):
        p = prompt_lens[i]
        if p != prompt_lens[b + i] or ids[i][:p] != ids[b + i][:p]:
            raise NotPackable("the chosen and rejected rows of a pair do not share their prompt")

    group_of: dict[tuple, int] = {}
    prompts: list[list[int]] = []
    branches: list[list[list[int]]] = []
    branch_of: list[dict[tuple, int]] = []
    placement = []  # per row: (group, branch or None)
    for r in range(rows):
        p, n = prompt_lens[r], row_lens[r]
        key = tuple(ids[r][:p])
        g = group_of.get(key)
        if g is None:
            g = group_of[key] = len(prompts)
            prompts.append(list(key))
            branches.append([])
            branch_of.append({})
        tail = tuple(ids[r][p:n])
        k = None
        if tail:
            k = branch_of[g].get(tail)
            if k is None:
                k = branch_of[g][tail] = len(branches[g])
                branches[g].append(list(tail))
        placement.append((g, k))

    groups = []
    for g, prompt in enumerate(prompts):
        offset, spans = len(prompt), []
        for tail in branches[g]:
            spans.append((offset, len(tail)))
            offset += len(tail)
        groups.append((len(prompt), spans))
    t = max(max((o + n for o, n in spans), default=p) for p, spans in groups)
    t = max(t, 1)
    n_groups = len(groups)
    packed_ids = torch.full((n_groups, t), pad_token_id, dtype=input_ids.dtype)
    positions = torch.zeros((n_groups, t), dtype=torch.long)
    segments = torch.full((n_groups, t), -1, dtype=torch.long)
    for g, (p, spans) in enumerate(groups):
        packed_ids[g, :p] = torch.tensor(prompts[g], dtype=input_ids.dtype)
        positions[g, :p] = torch.arange(p)
        segments[g, :p] = 0
        for k, (o, n) in enumerate(spans):
            packed_ids[g, o:o + n] = torch.tensor(branches[g][k], dtype=input_ids.dtype)
            positions[g, o:o + n] = torch.arange(p, p + n)
            segments[g, o:o + n] = k + 1
    zero = n_groups * t
    index = torch.full((rows, width), zero, dtype=torch.long)
    for r, (g, k) in enumerate(placement):
        p, n = prompt_lens[r], row_lens[r]
        index[r, :p] = g * t + torch.arange(p)
        if k is not None:
            o, _ = groups[g][1][k]
            index[r, p:n] = g * t + o + torch.arange(n - p)
    device = input_ids.device
    return PackPlan(rows, width, packed_ids.to(device), positions.to(device), segments.to(device),
                    index.to(device), groups, list(prompt_lens), row_lens)
