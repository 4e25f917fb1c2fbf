"""Trainer checkpoints (``checkpoint-N``) that become visible only when complete.

The Trainer writes a checkpoint file by file: weights, optimizer, scheduler, RNG state, trainer
state, and deg_hf adds ``deg.json`` and the model card. A run killed, interrupted or out of disk
half way used to leave a ``checkpoint-N`` that ``resume_from_checkpoint=True`` picked and then
failed on (or, without an optimizer file, resumed with a fresh optimizer). Here the whole
checkpoint is written under ``OUTPUT_DIR/.deg-staging/checkpoint-N``, its files are flushed to disk,
and only then is it renamed to ``OUTPUT_DIR/checkpoint-N``: a rename within one directory tree is
atomic, so a ``checkpoint-N`` either does not exist or is complete.

:func:`checkpoint_problem` says what a directory lacks (for ``checkpoint-N`` directories left by an
older deg_hf, or copied in by hand), and :func:`newest_complete_checkpoint` is what
``resume_from_checkpoint=True`` resumes from. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zipfile

logger = logging.getLogger(__name__)

STAGING_DIR = ".deg-staging"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_TRAINER_STATE = "trainer_state.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "model.safetensors", "model.safetensors.index.json",
                 "pytorch_model.bin", "pytorch_model.bin.index.json")
_OPTIMIZER_FILES = ("optimizer.pt", "scheduler.pt")
# sharded engines keep weights and optimizer state in directories of their own
_ENGINE_MARKERS = re.compile(r"^(pytorch_model_fsdp|optimizer_\d|global_step\d+)|^zero_to_fp32\.py$")


def _torch_file_problem(path: str) -> str | None:
    """torch.save writes a zip archive: a truncated one has lost its central directory."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(2)
    except OSError as exc:
        return f"{os.path.basename(path)} cannot be read ({exc.strerror})"
    if magic == b"PK" and not zipfile.is_zipfile(path):
        return f"{os.path.basename(path)} is truncated"
    if not magic:
        return f"{os.path.basename(path)} is empty"
    return None


def checkpoint_problem(directory: str, *, optimizer: bool = True) -> str | None:
    """What keeps ``directory`` from being a complete Trainer checkpoint, or None when it is one.

    Complete means: ``trainer_state.json`` (the Trainer writes it last) parses; weights are present
    and whole; with ``optimizer=True`` (not ``save_only_model``), ``optimizer.pt`` and
    ``scheduler.pt`` are present and whole. Checkpoints of sharded engines (FSDP, DeepSpeed) are
    judged by their trainer state only."""
    from deg_hf.streaming.checks import ModelFileError, read_header

    if not os.path.isdir(directory):
        return "it is not a directory"
    names = set(os.listdir(directory))
    state = os.path.join(directory, _TRAINER_STATE)
    if _TRAINER_STATE not in names:
        return f"it has no {_TRAINER_STATE} (the Trainer writes it last)"
    try:
        with open(state, encoding="utf-8") as fh:
            if not isinstance(json.load(fh), dict):
                raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"its {_TRAINER_STATE} is unreadable ({exc})"
    if any(_ENGINE_MARKERS.match(n) for n in names):
        return None
    weights = [n for n in _WEIGHT_FILES if n in names]
    if not weights:
        return f"it has no weights ({', '.join(_WEIGHT_FILES[:2])})"
    for name in weights:
        path = os.path.join(directory, name)
        if name.endswith(".safetensors"):
            try:
                read_header(path)
            except ModelFileError as exc:
                return str(exc).split(";")[0]
        elif name.endswith(".bin"):
            problem = _torch_file_problem(path)
            if problem:
                return problem
    for name in sorted(n for n in names if n.startswith("rng_state") and n.endswith(".pth")):
        problem = _torch_file_problem(os.path.join(directory, name))
        if problem:
            return problem
    if optimizer:
        for name in _OPTIMIZER_FILES:
            if name not in names:
                return f"it has no {name}"
            problem = _torch_file_problem(os.path.join(directory, name))
            if problem:
                return problem
    return None


def checkpoint_dirs(output_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every ``checkpoint-N`` directory in ``output_dir``, newest step first."""
    if not output_dir or not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT_RE.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def newest_complete_checkpoint(output_dir: str, *, optimizer: bool = True) -> str | None:
    """The complete ``checkpoint-N`` with the highest step in ``output_dir`` (None when there is
    none); every newer incomplete one is skipped with a warning naming it and what it lacks."""
    for _, path in checkpoint_dirs(output_dir):
        problem = checkpoint_problem(path, optimizer=optimizer)
        if problem is None:
            return path
        logger.warning("skipping %s: it is not a complete checkpoint (%s); it was left by an interrupted save",
                       path, problem)
    return None


def _fsync_tree(directory: str) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class StagedCheckpoint:
    """One save of ``checkpoint-{step}`` into ``run_dir``: written under the staging directory,
    committed by a rename. Only the main process (``main=True``) creates, commits or removes
    anything; the other processes write their own files (their RNG state) into :attr:`staged`."""

    def __init__(self, run_dir: str, step: int, *, main: bool):
        self.run_dir = run_dir
        self.root = os.path.join(run_dir, STAGING_DIR)
        self.name = f"checkpoint-{step}"
        self.staged = os.path.join(self.root, self.name)
        self.final = os.path.join(run_dir, self.name)
        self.main = main
        self.push_after_commit = False

    def begin(self) -> None:
        """Clear what an interrupted save left in the staging directory (main process)."""
        if self.main and os.path.isdir(self.root):
            shutil.rmtree(self.root)

    def commit(self) -> None:
        """Flush the staged checkpoint to disk and rename it into place (main process). An existing
        ``checkpoint-N`` (a partial one from an older run) is moved aside first and removed after:
        at no moment is a half-written directory visible under the checkpoint's name."""
        if not self.main:
            return
        if not os.path.isdir(self.staged):
            raise FileNotFoundError(f"the staged checkpoint {self.staged} vanished before it was complete")
        _fsync_tree(self.staged)
        aside = None
        if os.path.lexists(self.final):
            aside = os.path.join(self.root, f"replaced-{self.name}")
            os.replace(self.final, aside)
        os.replace(self.staged, self.final)
        _fsync_dir(self.run_dir)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def abort(self) -> None:
        """Remove the staging directory after a failed save (main process); never raises."""
        if self.main:
            shutil.rmtree(self.root, ignore_errors=True)

    def final_path(self, path: str | None) -> str | None:
        """``path`` with the staged checkpoint's location replaced by its final one."""
        if path and os.path.normpath(path) == os.path.normpath(self.staged):
            return self.final
        return path
