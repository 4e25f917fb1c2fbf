"""deg_hf: Hugging Face trainers for models larger than the GPU.

Drop-in subclasses of ``transformers.Trainer`` and TRL's trainers that stream decoder layers from
host memory, plan micro-batches under a device-memory target, split and retry a step that runs
out of memory, and save checkpoints with a ``deg.json`` that records how they were made.

``import deg_hf`` is cheap: public names are resolved on first use, so the command line and
configuration code never pay for importing torch, transformers, TRL or PEFT.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # configuration
    "StreamConfig": "deg_hf.config",
    "StreamedTrainingArguments": "deg_hf.config",
    "StreamedSFTConfig": "deg_hf.config",
    "StreamedDPOConfig": "deg_hf.config",
    "StreamedKTOConfig": "deg_hf.config",
    "StreamedORPOConfig": "deg_hf.config",
    "SimPOConfig": "deg_hf.config",
    # trainers
    "StreamingSetupMixin": "deg_hf.trainers.mixin",
    "StreamedTrainer": "deg_hf.trainers.trainer",
    "StreamedSFTTrainer": "deg_hf.trainers.sft",
    "StreamedDPOTrainer": "deg_hf.trainers.dpo",
    "StreamedKTOTrainer": "deg_hf.trainers.kto",
    "StreamedORPOTrainer": "deg_hf.trainers.orpo",
    "StreamedSimPOTrainer": "deg_hf.trainers.simpo",
    # streaming
    "WeightStore": "deg_hf.streaming.store",
    "StreamRuntime": "deg_hf.streaming.runtime",
    "build_streamed_model": "deg_hf.streaming.build",
    # memory planning
    "MemCoef": "deg_hf.memory.coef",
    "MemPlanner": "deg_hf.memory.planner",
    # checkpoints and the Hub
    "load": "deg_hf.checkpoint",
    "read_deg_json": "deg_hf.checkpoint",
    "push_checkpoint": "deg_hf.hub",
}

__all__ = sorted(_LAZY) + ["__version__", "assets"]


def __getattr__(name: str) -> Any:
    if name == "assets":
        return importlib.import_module("deg_hf.assets")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'deg_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from deg_hf.config import (  # noqa: F401
        SimPOConfig,
        StreamConfig,
        StreamedDPOConfig,
        StreamedKTOConfig,
        StreamedORPOConfig,
        StreamedSFTConfig,
        StreamedTrainingArguments,
    )
