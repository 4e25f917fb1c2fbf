"""The ``deg-hf`` command line: ``info``, ``push`` and ``plan``.

Importing this module (and ``deg-hf --help``) loads no torch, transformers, PEFT or TRL: each
subcommand imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from deg_hf import __version__
from deg_hf.checkpoint import TASKS, DegJsonError, looks_like_repo_id, read_deg_json, summarize

PROG = "deg-hf"
EXIT_USAGE = 2  # bad input: a checkpoint without or with a broken deg.json, a bad repo id...
EXIT_FAILURE = 1  # the Hub or the network failed


def _fail(message: str, code: int = EXIT_USAGE) -> int:
    text = " ".join(str(message).split())  # one line, whatever the message
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return code


def _info(args: argparse.Namespace) -> int:
    target = args.checkpoint
    expanded = os.path.expanduser(target)
    if os.path.exists(expanded) or not looks_like_repo_id(target):
        record = read_deg_json(expanded)
    else:
        import huggingface_hub
        from huggingface_hub.errors import (
            EntryNotFoundError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        from deg_hf.hub import unreachable

        try:
            path = huggingface_hub.hf_hub_download(target, "deg.json", revision=args.revision)
        except LocalEntryNotFoundError as exc:  # offline or unreachable, and not in the local cache
            raise unreachable(exc, f"read the deg.json of {target} (it is not in the local cache either)") from None
        except RepositoryNotFoundError:
            raise DegJsonError(
                f"{target} is neither a local checkpoint directory nor a Hub repo you can access"
            ) from None
        except RevisionNotFoundError:
            raise DegJsonError(f"Hub repo {target} has no revision {args.revision!r}") from None
        except EntryNotFoundError:
            raise DegJsonError(
                f"Hub repo {target} has no deg.json: it was not pushed by deg_hf, or not to this revision"
            ) from None
        record = read_deg_json(path)
    print(summarize(record))
    return 0


def _push(args: argparse.Namespace) -> int:
    from deg_hf.hub import push_checkpoint

    url = push_checkpoint(
        args.checkpoint,
        args.repo_id,
        private=args.private,
        revision=args.revision,
        include_optimizer=args.include_optimizer,
        commit_message=args.commit_message,
    )
    print(url)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import importlib

    try:
        plan_cli = importlib.import_module("deg_hf.plan_cli")
    except ModuleNotFoundError as exc:
        if exc.name != "deg_hf.plan_cli":
            raise
        return _fail("'deg-hf plan' is not available in this version of deg_hf")
    result = plan_cli.run(args)
    return int(result or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, push and plan deg_hf LoRA checkpoints (layer-streamed training for models "
        "larger than the GPU).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = sub.add_parser(
        "info",
        help="summarise a checkpoint's deg.json (local directory or Hub repo)",
        description="Print what a deg_hf checkpoint records: task, base model, adapter, data, training "
        "arguments, memory plan, metrics and versions.",
    )
    info.add_argument("checkpoint", metavar="CHECKPOINT_OR_REPO", help="checkpoint directory, deg.json path or Hub repo id")
    info.add_argument("--revision", default=None, help="Hub branch, tag or commit (Hub repos only)")
    info.set_defaults(func=_info)

    push = sub.add_parser(
        "push",
        help="upload a checkpoint (adapter, tokenizer, deg.json, model card) to the Hub",
        description="Upload the adapter, tokenizer, deg.json, a model card written from it and the training log. "
        "training_args.bin is never uploaded. The token comes from HF_TOKEN or `hf auth login`.",
    )
    push.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory saved by deg_hf")
    push.add_argument("repo_id", metavar="REPO_ID", help="Hub model repo, 'name' or 'namespace/name'")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    push.add_argument(
        "--include-optimizer",
        action="store_true",
        help="also upload optimizer.pt, scheduler.pt, rng_state*.pth and trainer_state.json (to resume elsewhere)",
    )
    push.add_argument("--commit-message", default=None, help="commit message (default: one naming the task)")
    push.set_defaults(func=_push)

    plan = sub.add_parser(
        "plan",
        help="estimate memory and micro-batches for a model before training",
        description="Plan micro-batches and layer streaming for MODEL under a device-memory budget.",
    )
    plan.add_argument("model", metavar="MODEL", help="Hub id or local directory of the base model")
    plan.add_argument("--task", choices=TASKS, default="dpo", help="training task (default: dpo)")
    plan.add_argument("--batch", type=int, default=4, help="examples per optimizer step (default: 4)")
    plan.add_argument("--max-length", type=int, default=2048, help="tokens per example (default: 2048)")
    plan.add_argument("--vram", type=float, default=8.0, help="device memory budget in GiB (default: 8)")
    plan.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: 16)")
    plan.add_argument("--quantization", choices=("nf4", "fp4"), default=None,
                      help="plan a 4-bit base (stream_quantization; double quantization, blocksize 64). "
                           "Default: what the checkpoint was saved as")
    plan.add_argument("--host-mem", type=float, default=None, metavar="GIB",
                      help="host memory of the machine to plan for, in GiB (default: this machine's available memory)")
    plan.set_defaults(func=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``deg-hf``; returns the exit status (0 ok, 2 bad input, 1 Hub or network failure)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (DegJsonError, ValueError) as exc:  # HFValidationError is a ValueError
        return _fail(str(exc))
    except Exception as exc:
        from deg_hf.hub import HubUnreachableError, is_network_error, unreachable

        if isinstance(exc, HubUnreachableError):
            return _fail(str(exc), EXIT_FAILURE)
        if is_network_error(exc):  # the connection failed outside a push or a download we wrap
            return _fail(str(unreachable(exc, f"run deg-hf {args.command}")), EXIT_FAILURE)
        if isinstance(exc, OSError):  # Hub HTTP errors, missing files
            return _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILURE)
        raise
    except KeyboardInterrupt:
        return _fail("interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
