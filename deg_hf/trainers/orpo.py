"""StreamedORPOTrainer: TRL's ORPO trainer (``trl.experimental.orpo``) over a streamed base.

ORPO is reference-free: its odds-ratio term compares chosen and rejected under the policy alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.orpo import ORPOTrainer  # noqa: E402

from deg_hf.trainers.mixin import StreamingSetupMixin  # noqa: E402
from deg_hf.trainers.paired import SeparatePairsPrefixMixin  # noqa: E402


class StreamedORPOTrainer(SeparatePairsPrefixMixin, StreamingSetupMixin, ORPOTrainer):
    """A drop-in TRL ``ORPOTrainer``; two rows (chosen and rejected) per example."""

    deg_task = "orpo"
    deg_rows_per_example = 2
    deg_loss_unit = "examples"
    deg_config_class = "StreamedORPOConfig"
