"""StreamedDPOTrainer: TRL's ``DPOTrainer`` over a streamed base.

The reference is the same streamed model with the adapter disabled (TRL's own PEFT path with
``ref_model=None``): no second model is ever built, in host or device memory.
"""

from __future__ import annotations

from trl import DPOTrainer

from deg_hf.trainers.mixin import StreamingSetupMixin


class StreamedDPOTrainer(StreamingSetupMixin, DPOTrainer):
    """A drop-in TRL ``DPOTrainer``: replace the class name, keep the script.

    DPO concatenates chosen and rejected completions, so each example is two rows in the memory
    estimate.
    """

    deg_task = "dpo"
    deg_rows_per_example = 2
    deg_stacked_pairs = True
    deg_loss_unit = "examples"
    deg_config_class = "StreamedDPOConfig"
