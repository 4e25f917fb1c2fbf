"""StreamedORPOTrainer: TRL's ORPO trainer (``trl.experimental.orpo``) over a streamed base.

ORPO is reference-free: its odds-ratio term compares chosen and rejected under the policy alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from trl.experimental.orpo import ORPOTrainer  # noqa: E402

from deg_hf.trainers.mixin import StreamingSetupMixin  # noqa: E402


class StreamedORPOTrainer(StreamingSetupMixin, ORPOTrainer):
    """A drop-in TRL ``ORPOTrainer``; two rows (chosen and rejected) per example."""

    deg_task = "orpo"
    deg_rows_per_example = 2
    deg_loss_unit = "examples"
    deg_prefix_capable = True
    deg_config_class = "StreamedORPOConfig"

    def concatenated_forward(self, model, batch):
        from deg_hf.prefix.pack import prompt_lengths_of_pair_batch

        lens = None if self.is_encoder_decoder else prompt_lengths_of_pair_batch(batch)
        with self._deg_pairs(lens):
            return super().concatenated_forward(model, batch)

    def _deg_shared_prompt_lens(self, inputs):
        from deg_hf.prefix.pack import shared_prompt_lens_of_pair_batch

        return shared_prompt_lens_of_pair_batch(getattr(self, "deg_prefix", None), inputs)
