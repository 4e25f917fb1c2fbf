"""Prefix sharing for TRL's ORPO and CPO/SimPO trainers, whose batches keep chosen and rejected apart.

Both run chosen and rejected through ``concatenated_forward``; the prompt lengths come from their
labels (-100 over the prompt), and the backbone call inside is packed by :mod:`deg_hf.prefix`.
"""

from __future__ import annotations


class SeparatePairsPrefixMixin:
    """Put before :class:`~deg_hf.trainers.mixin.StreamingSetupMixin` in the class bases."""

    deg_prefix_capable = True

    def concatenated_forward(self, model, batch):
        from deg_hf.prefix.pack import prompt_lengths_of_pair_batch

        lens = None if self.is_encoder_decoder else prompt_lengths_of_pair_batch(batch)
        with self._deg_pairs(lens):
            return super().concatenated_forward(model, batch)

    def _deg_shared_prompt_lens(self, inputs):
        from deg_hf.prefix.pack import shared_prompt_lens_of_pair_batch

        return shared_prompt_lens_of_pair_batch(getattr(self, "deg_prefix", None), inputs)
