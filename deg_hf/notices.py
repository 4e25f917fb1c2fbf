"""Upstream notices a deg_hf user did not cause and cannot act on, kept off their terminal.

Each filter is narrow (one message, one category) and says why it is here:

* transformers 5 renamed ``gradient_checkpointing*`` to ``activation_checkpointing*``. TRL's configs
  still default ``gradient_checkpointing=True`` and TRL's reference and generation helpers call the
  old model methods, so every DPO or KTO step would print the rename notice again from TRL's code.
* torch's DataLoader says that ``pin_memory`` does nothing without an accelerator, on every
  dataloader of a CPU run (the Trainer's default is ``dataloader_pin_memory=True``).

Filters are installed once, when deg_hf's trainer or config classes are first built.
"""

from __future__ import annotations

import warnings

_INSTALLED = False


def quiet_upstream_notices() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    warnings.filterwarnings(
        "ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated and will be removed in v6",
        category=FutureWarning,
    )
    warnings.filterwarnings(
        "ignore", message=r"'pin_memory' argument is set as true but no accelerator is found", category=UserWarning,
    )
    _INSTALLED = True
