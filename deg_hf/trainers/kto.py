"""StreamedKTOTrainer: TRL's ``KTOTrainer`` over a streamed base.

KTO's reference forward (and its KL forward) run through the trainer's own model with the adapter
disabled, so the reference is the same streamed base, as for DPO.
"""

from __future__ import annotations

from trl import KTOTrainer

from deg_hf.trainers.mixin import StreamingSetupMixin


class StreamedKTOTrainer(StreamingSetupMixin, KTOTrainer):
    """A drop-in TRL ``KTOTrainer``.

    One row per example for the main forward plus one for the KL forward (a mismatched completion
    per example); a per-device batch of at least 2 (the KL term needs another prompt).
    """

    deg_task = "kto"
    deg_rows_per_example = 1
    deg_kl_rows_per_example = 1
    deg_min_batch = 2
    deg_config_class = "StreamedKTOConfig"
