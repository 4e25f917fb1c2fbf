"""StreamedTrainer: ``transformers.Trainer`` with layer streaming and memory planning."""

from __future__ import annotations

from transformers import Trainer

from deg_hf.trainers.mixin import StreamingSetupMixin


class StreamedTrainer(StreamingSetupMixin, Trainer):
    """A drop-in ``transformers.Trainer`` for causal-LM LoRA training of models larger than the device.

    ``model`` may be a Hub id, a local path or a loaded ``PreTrainedModel``; ``peft_config`` (a PEFT
    ``LoraConfig``) is applied with ``get_peft_model``. Streamed, it defaults to LoRA on every linear
    projection (the base stays frozen); resident without one, every weight trains, as upstream. Configure streaming with
    :class:`deg_hf.StreamedTrainingArguments` (a plain ``TrainingArguments`` works too).
    """

    deg_task = "sft"
    deg_config_class = "StreamedTrainingArguments"
    deg_upstream_loads_ids = False
