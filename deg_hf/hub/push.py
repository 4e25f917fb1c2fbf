"""Pushing a checkpoint to the Hub in one commit, and what a network failure is told as."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from deg_hf.checkpoint import DegJsonError, check_checkpoint, read_deg_json
from deg_hf.hub.card import README, _has_tokenizer, model_card
from deg_hf.hub.upload import scan_for_secrets, select_upload_files


class HubUnreachableError(ConnectionError):
    """The Hub could not be reached (no network, offline mode, a wrong endpoint)."""


def is_network_error(exc: BaseException) -> bool:
    """True for the failures of reaching a server at all (not for answers such as 404 or 401)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(exc, (OfflineModeIsEnabled, TimeoutError, ConnectionError)):
        return True
    # huggingface_hub's HTTP client (httpx) raises its own transport errors
    return any(c.__name__ in ("TransportError", "TimeoutException") for c in type(exc).__mro__)


def unreachable(exc: BaseException, what: str) -> HubUnreachableError:
    """One line naming the endpoint and what to check, for a network failure ``exc`` during ``what``."""
    from huggingface_hub import constants
    from huggingface_hub.errors import OfflineModeIsEnabled

    endpoint = constants.ENDPOINT
    reason = " ".join(str(exc).split())[:160] or type(exc).__name__
    transport = any(c.__name__ in ("TransportError", "TimeoutException") for c in type(exc).__mro__)
    if isinstance(exc, OfflineModeIsEnabled) or (constants.HF_HUB_OFFLINE and not transport):
        return HubUnreachableError(f"cannot {what}: offline mode is on (HF_HUB_OFFLINE is set); unset it to reach "
                                   f"the Hub at {endpoint}")
    return HubUnreachableError(f"cannot {what}: the Hub at {endpoint} cannot be reached ({reason}); check your "
                               "network connection, or HF_ENDPOINT if you use a mirror")


def _validate_repo_id(repo_id: Any) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: give 'name' or 'namespace/name'")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"invalid Hub repo id {repo_id!r}: {exc}") from None


def push_checkpoint(
    checkpoint_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    include_optimizer: bool = False,
    token: str | None = None,
    commit_message: str | None = None,
) -> str:
    """Upload a deg_hf checkpoint to the Hub model repo ``repo_id``; returns the repo URL.

    Before any remote call: the repo id is validated (``ValueError``), ``deg.json`` is read and
    validated and the adapter weights and ``adapter_config.json`` must be present
    (:class:`~deg_hf.checkpoint.DegJsonError`), the ``README.md`` model card is rendered from the
    record (into the upload: the checkpoint directory is never written to), and every file to upload,
    the card included, is scanned for tokens, local paths and symlinks leading out of the checkpoint
    (``ValueError``). Then the repo is created if needed (and the branch ``revision``) and the files
    are uploaded in one commit. A network failure raises :class:`HubUnreachableError`, naming the
    endpoint.
    """
    _validate_repo_id(repo_id)
    directory = Path(checkpoint_dir)
    record = read_deg_json(directory)
    full = record.get("peft", {}) is None
    check_checkpoint(directory, full=full)
    if not full and not (directory / "adapter_config.json").is_file():
        raise DegJsonError(f"{directory} has adapter weights but no adapter_config.json: PEFT cannot load it")
    card = model_card(record, repo_id=repo_id, tokenizer_in_repo=_has_tokenizer(directory))
    contents = {README: str(card).encode("utf-8")}
    files = sorted(set(select_upload_files(directory, include_optimizer=include_optimizer, full=full)) | {README})
    scan_for_secrets(directory, files, token=token, contents=contents)

    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=contents.get(name, str(directory / name)))
        for name in files
    ]
    kind = "full fine-tune" if full else "adapter"
    message = commit_message or f"Upload {record['task'].upper()} {kind} trained with deg_hf"
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        full_id = getattr(repo_url, "repo_id", None) or repo_id
        if revision:
            api.create_branch(full_id, branch=revision, repo_type="model", exist_ok=True)
        api.create_commit(full_id, operations, commit_message=message, repo_type="model", revision=revision)
    except Exception as exc:
        if is_network_error(exc):
            raise unreachable(exc, f"push {directory.name} to {repo_id}") from None
        raise
    url = str(repo_url) if repo_url else f"{api.endpoint.rstrip('/')}/{full_id}"
    if revision:
        url = f"{url.rstrip('/')}/tree/{revision}"
    return url
