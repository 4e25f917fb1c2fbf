"""StreamedSimPOTrainer: SimPO through TRL's CPO trainer (``trl.experimental.cpo``) over a streamed base.

SimPO is reference-free: a length-normalised log-probability margin with a target gap. Configure it
with :class:`deg_hf.SimPOConfig`, which sets ``loss_type="simpo"`` and ``cpo_alpha=0``.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.cpo import CPOTrainer  # noqa: E402

from deg_hf.trainers.mixin import StreamingSetupMixin  # noqa: E402
from deg_hf.trainers.paired import SeparatePairsPrefixMixin  # noqa: E402


class StreamedSimPOTrainer(SeparatePairsPrefixMixin, StreamingSetupMixin, CPOTrainer):
    """SimPO (or any CPO loss) with a streamed base; two rows per example."""

    deg_task = "simpo"
    deg_rows_per_example = 2
    deg_loss_unit = "examples"
    deg_config_class = "SimPOConfig"
