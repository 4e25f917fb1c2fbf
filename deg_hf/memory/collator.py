"""MemoryPlanningCollator: the trainer's collator, plus what the planner needs per example."""

from __future__ import annotations

from deg_hf.memory import batch as mb

FEATURE_KEYS = ("deg_uid", "deg_lengths")
UID_COLUMNS = ("uid", "id", "example_id")


class MemoryPlanningCollator:
    """Wraps a collator; adds ``deg_lengths`` (each example's true row lengths) and ``deg_uid`` (the
    example's ``uid``/``id`` column when the dataset keeps one, else None). The trainer strips both
    before the model sees the batch."""

    def __init__(self, collator, *, stacked_pairs: bool):
        self.collator = collator
        self.stacked_pairs = stacked_pairs

    def __call__(self, features):
        uids = [next((f[c] for c in UID_COLUMNS if isinstance(f, dict) and c in f), None) for f in features]
        batch = self.collator(features)
        if not isinstance(batch, dict):
            return batch
        try:
            batch["deg_lengths"] = mb.row_lengths(batch, self.stacked_pairs)
        except ValueError:
            return batch
        batch["deg_uid"] = uids
        return batch

    def __getattr__(self, name):  # anything else (pad_token_id, ...) is the wrapped collator's
        return getattr(self.collator, name)


def strip(inputs: dict) -> dict:
    if not any(k in inputs for k in FEATURE_KEYS):
        return inputs
    return {k: v for k, v in inputs.items() if k not in FEATURE_KEYS}
