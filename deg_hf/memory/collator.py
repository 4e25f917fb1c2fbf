"""MemoryPlanningCollator: the trainer's collator, plus what the planner needs per example."""

from __future__ import annotations

from deg_hf.memory import batch as mb

FEATURE_KEYS = ("deg_uid", "deg_lengths")
#: the training dataset's column of row ids (added by the trainer to the dataset its loader reads)
ROW_ID = "deg_uid"
UID_COLUMNS = (ROW_ID, "uid", "id", "example_id")


class RowIds:
    """A map-style dataset whose rows carry their index as ``deg_uid``, so the collator can say which
    dataset row every example of a micro-batch is (skipped examples are reported by it). Nothing is
    copied: rows are read from the wrapped dataset as the data loader asks for them; anything else
    (columns, ``column_names``, ...) is the wrapped dataset's."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        row = self.dataset[index]
        return {**row, ROW_ID: int(index)} if isinstance(index, int) and isinstance(row, dict) else row

    def __getitems__(self, indices):
        getitems = getattr(self.dataset, "__getitems__", None)
        rows = getitems(list(indices)) if callable(getitems) else [self.dataset[i] for i in indices]
        return [{**row, ROW_ID: int(i)} if isinstance(row, dict) else row for row, i in zip(rows, indices)]

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_row_ids(dataset):
    """``dataset`` as :class:`RowIds` when it is a map-style dataset of dict rows (has a length and is
    indexed by position); as it is otherwise (an iterable dataset: no row ids to give)."""
    if isinstance(dataset, RowIds) or not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        return dataset
    return RowIds(dataset)


class MemoryPlanningCollator:
    """Wraps a collator; adds ``deg_lengths`` (each example's true row lengths) and ``deg_uid`` (the
    example's dataset row id, :func:`with_row_ids`, else its ``uid``/``id`` column when the dataset
    keeps one, else None). The trainer strips both before the model sees the batch."""

    def __init__(self, collator, *, stacked_pairs: bool):
        self.collator = collator
        self.stacked_pairs = stacked_pairs

    def __call__(self, features):
        uids = [next((f[c] for c in UID_COLUMNS if isinstance(f, dict) and c in f), None) for f in features]
        features = [{k: v for k, v in f.items() if k != ROW_ID} if isinstance(f, dict) else f for f in features]
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
