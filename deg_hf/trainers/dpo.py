"""StreamedDPOTrainer: TRL's ``DPOTrainer`` over a streamed base.

The reference is the same streamed model with the adapter disabled (TRL's own PEFT path with
``ref_model=None``): no second model is ever built, in host or device memory. With
``prefix_sharing`` (the default) each pair's prompt runs once for both completions, in the
policy pass and in the reference pass alike.
"""

from __future__ import annotations

from trl import DPOTrainer

from deg_hf.trainers.mixin import StreamingSetupMixin


class StreamedDPOTrainer(StreamingSetupMixin, DPOTrainer):
    """A drop-in TRL ``DPOTrainer``: replace the class name, keep the script.

    DPO concatenates chosen and rejected completions, so each example is two rows in the memory
    estimate (one row of prompt + chosen + rejected under prefix sharing).
    """

    deg_task = "dpo"
    deg_fused_lm_head = True
    deg_rows_per_example = 2
    deg_stacked_pairs = True
    deg_loss_unit = "examples"
    deg_config_class = "StreamedDPOConfig"
    deg_prefix_capable = True

    def _deg_prompt_lens(self, inputs):
        from deg_hf.prefix.pack import prompt_lengths_from_mask

        if "completion_mask" not in inputs or "attention_mask" not in inputs:
            return None
        return prompt_lengths_from_mask(inputs["completion_mask"], inputs["attention_mask"])

    def _deg_shared_prompt_lens(self, inputs):
        from deg_hf.prefix.pack import NotPackable

        lens = self._deg_prompt_lens(inputs)
        if lens is None or getattr(self, "deg_prefix", None) is None:
            return None
        try:
            self.deg_prefix.plan(inputs["input_ids"], inputs["attention_mask"], lens)
        except NotPackable:
            return None
        return lens[: len(lens) // 2]

    def _compute_loss(self, model, inputs, return_outputs):
        with self._deg_pairs(self._deg_prompt_lens(inputs)):
            return super()._compute_loss(model, inputs, return_outputs)

    def compute_ref_log_probs(self, model, inputs):
        with self._deg_pairs(self._deg_prompt_lens(inputs)):
            return super().compute_ref_log_probs(model, inputs)
