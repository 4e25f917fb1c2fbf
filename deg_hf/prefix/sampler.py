"""Shuffle prompts rather than pairs, so the pairs of one prompt sit next to each other.

Ranked data turned into pairs repeats each prompt in several pairs. With ``group_by_prompt=True``
the training order is a seeded shuffle of the distinct prompts, each followed by all its pairs (in a
seeded order), so consecutive micro-batch slots hold pairs of one prompt and the packed forward runs
that prompt once for all of them. Every example is still seen once per epoch.
"""

from __future__ import annotations

import torch

PROMPT_COLUMNS = ("prompt_ids", "prompt_input_ids", "prompt")


def prompt_keys(dataset) -> list | None:
    """One hashable key per example (its prompt), or None when the dataset has no prompt column."""
    names = getattr(dataset, "column_names", None) or []
    column = next((c for c in PROMPT_COLUMNS if c in names), None)
    if column is None:
        return None
    return [_key(v) for v in dataset[column]]


def _key(value):
    if isinstance(value, list):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    return value


class PromptGroupedSampler(torch.utils.data.Sampler):
    def __init__(self, keys: list, seed: int = 0):
        groups: dict = {}
        for index, key in enumerate(keys):
            groups.setdefault(key, []).append(index)
        self.groups = list(groups.values())
        self.n = len(keys)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1  # a sampler nobody sets the epoch on still reshuffles next time
        for g in torch.randperm(len(self.groups), generator=gen).tolist():
            members = self.groups[g]
            for i in torch.randperm(len(members), generator=gen).tolist():
                yield members[i]
