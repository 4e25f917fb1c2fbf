"""StreamedSFTTrainer: TRL's ``SFTTrainer`` with layer streaming and memory planning."""

from __future__ import annotations

from trl import SFTTrainer

from deg_hf.trainers.mixin import StreamingSetupMixin


class StreamedSFTTrainer(StreamingSetupMixin, SFTTrainer):
    """A drop-in TRL ``SFTTrainer`` whose decoder layers stream from host memory.

    Replace ``SFTTrainer`` with ``StreamedSFTTrainer``; configure streaming with
    :class:`deg_hf.StreamedSFTConfig` (a plain ``SFTConfig`` works too).
    """

    deg_task = "sft"
    deg_fused_lm_head = True
    deg_config_class = "StreamedSFTConfig"
