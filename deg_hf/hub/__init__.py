"""Model cards and pushing checkpoints to the Hugging Face Hub.

``push_checkpoint`` (:mod:`deg_hf.hub.push`) uploads a deliberately short list of files from a
checkpoint directory (:mod:`deg_hf.hub.upload`): the adapter (a full fine-tune's model files
instead), the tokenizer, ``deg.json``, a ``README.md`` model card written from it
(:mod:`deg_hf.hub.card`) and the training log; optimizer, scheduler and RNG state only on request;
``training_args.bin`` (a pickle of the arguments, Hub token included) never. Everything is checked
before the first remote call: the repo id, the record, the adapter weights, and that no file to
upload holds a Hub token or a local path or is a symlink out of the checkpoint. The card is rendered
into the upload: a push never writes to the checkpoint directory.

huggingface_hub is imported inside the functions, so importing this package stays cheap.
"""

from __future__ import annotations

from deg_hf.hub.card import README, model_card, write_model_card
from deg_hf.hub.push import HubUnreachableError, is_network_error, push_checkpoint, unreachable
from deg_hf.hub.upload import (
    FULL_MODEL_FILES,
    NEVER_UPLOAD,
    OPTIMIZER_FILES,
    TRAIN_LOG,
    UPLOAD_FILES,
    scan_for_secrets,
    select_upload_files,
)

__all__ = [
    "README",
    "TRAIN_LOG",
    "UPLOAD_FILES",
    "FULL_MODEL_FILES",
    "OPTIMIZER_FILES",
    "NEVER_UPLOAD",
    "model_card",
    "write_model_card",
    "select_upload_files",
    "scan_for_secrets",
    "HubUnreachableError",
    "is_network_error",
    "unreachable",
    "push_checkpoint",
]
