"""What every script in recipes/ shares: argument parsing with the defaults that make a bare run work
offline on CPU, the dataset (the embedded view, or any Hub dataset), and the ``--summary`` table."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

_STARTED = time.perf_counter()  # a recipe imports this module with its other imports: the run starts here

#: |chosen log-ratio - rejected log-ratio| below this (nats) is a tie: float rounding of equal log-probs
#: (the policy and reference passes may run in different layouts), not a preference
TIE_NATS = 1e-4


@dataclass
class SummaryArguments:
    """The recipes' own option, beside TRL's ``ScriptArguments``."""

    summary: bool = field(default=False, metadata={"help": (
        "At the end print a summary table (loss, streaming counters, memory plan, checkpoint; DPO: "
        "held-out reward accuracy before -> after) and draw OUTPUT_DIR/run.png (needs matplotlib).")})


def parse_args(config_class, recipe: str, argv=None):
    """``(script_args, training_args, model_args)`` from the command line and ``--config`` YAML.

    Defaults: the checkpoint's own dtype, no bf16 where the device has none, ``outputs/<recipe>``
    as output_dir, and the tiny embedded model when no ``--model_name_or_path`` is given.
    ``script_args.summary`` carries ``--summary``."""
    import torch
    from trl import ModelConfig, ScriptArguments, TrlParser

    from deg_hf import assets

    parser = TrlParser((ScriptArguments, config_class, ModelConfig, SummaryArguments))
    parser.set_defaults(dtype="auto")  # load in the checkpoint's own dtype, not TRL's float32
    if not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        parser.set_defaults(bf16=False)  # TRL defaults to bf16, which a CPU-only machine refuses
    script_args, training_args, model_args, extra = parser.parse_args_and_config(argv)
    script_args.summary = extra.summary
    if training_args.output_dir in (None, "trainer_output"):  # the TRL/transformers default
        training_args.output_dir = f"outputs/{recipe}"
    model_args.model_name_or_path = model_args.model_name_or_path or assets.tiny_model_path()
    init_kwargs = {"revision": model_args.model_revision, "attn_implementation": model_args.attn_implementation,
                   "dtype": model_args.dtype}
    init_kwargs = {k: v for k, v in init_kwargs.items() if v not in (None, "main", "auto")}
    quantization = _quantization_config(model_args)
    if quantization is not None:  # --load_in_4bit & co: QLoRA, streamed 4-bit (or resident with --stream_layers false)
        init_kwargs["quantization_config"] = quantization
    if init_kwargs:
        training_args.model_init_kwargs = {**init_kwargs, **(training_args.model_init_kwargs or {})}
    return script_args, training_args, model_args


def resume_from(training_args):
    """``--resume_from_checkpoint`` as ``train()`` takes it: ``true`` (the newest complete checkpoint-N
    in output_dir, or from the beginning when there is none), a checkpoint path, or None."""
    value = training_args.resume_from_checkpoint
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "false", "no", "0", "none")):
        return None
    if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "yes", "1")):
        return True
    return value


def _quantization_config(model_args):
    """TRL's ``ModelConfig`` quantization flags as the ``BitsAndBytesConfig`` TRL builds from them
    (``trl.get_quantization_config``), with the compute dtype left to the model when ``--dtype auto``."""
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = model_args.dtype if model_args.dtype not in (None, "auto") else None
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=compute, bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
        bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
    )


def load_data(script_args, view: str):
    """``(train, eval or None)``: the embedded ``view`` when no ``--dataset_name`` is given."""
    from deg_hf import assets

    if script_args.dataset_name is None:
        return assets.tiny_dataset(view, "train"), assets.tiny_dataset(view, "test")
    from datasets import load_dataset

    data = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    return data[script_args.dataset_train_split], data.get(script_args.dataset_test_split)


def reward_accuracy(trainer, dataset=None) -> tuple[float, float] | None:
    """``(accuracy, mean margin)`` of a DPO trainer's implicit reward on ``dataset`` (default: its
    tokenized ``eval_dataset``; None when there is none).

    A pair scores 1 when ``beta * (log pi(y_w|x) - log pi_ref(y_w|x))`` exceeds the same for the
    rejected answer, 0 when it is below, and 1/2 on a tie (the log-ratios within ``TIE_NATS``).
    Before training the adapter is zero, policy == reference, every pair ties: 0.5. (TRL's
    ``rewards/accuracies`` counts ties as wrong.) The reference is TRL's own, the adapter disabled;
    every process scores its share of the data and the shares are gathered. The streaming counters
    are left as they were: this evaluation's layer fetches are not the run's."""
    dataset = trainer.eval_dataset if dataset is None else dataset
    if dataset is None:
        return None
    import contextlib

    import torch

    runtime = trainer.stream_runtime
    counters = None if runtime is None else (runtime.loads, runtime.hits, runtime.bytes_moved)
    model, scores, margins = trainer.model, [], []
    was_training = model.training
    model.eval()
    try:
        for batch in trainer.get_eval_dataloader(dataset):
            batch = trainer._prepare_inputs(batch)
            ref_chosen, ref_rejected = trainer.compute_ref_log_probs(model, batch)
            mask = batch["completion_mask"]
            kwargs = {k: v for k, v in batch.items() if k not in {"completion_mask", "ref_chosen_logps",
                                                                    "ref_rejected_logps"}}
            # the policy pass takes the reference's path (packed when prefix sharing is on)
            pairs = trainer._deg_pairs(trainer._deg_prompt_lens(batch)) if hasattr(trainer, "_deg_prompt_lens") \
                else contextlib.nullcontext()
            with torch.no_grad(), pairs:
                logps = model(**kwargs, use_cache=False, labels=batch["input_ids"].masked_fill(mask == 0, -100),
                              fused_lm_head=True).log_probs
            chosen, rejected = logps[:, -(mask.size(1) - 1):].sum(1).chunk(2)
            diff = (chosen - ref_chosen) - (rejected - ref_rejected)
            score = torch.where(diff.abs() < TIE_NATS, 0.5, (diff > 0).float())
            scores.append(trainer.accelerator.gather_for_metrics(score))
            margins.append(trainer.accelerator.gather_for_metrics(trainer.beta * diff))
    finally:
        model.train(was_training)
        if counters is not None:
            runtime.loads, runtime.hits, runtime.bytes_moved = counters
    return torch.cat(scores).mean().item(), torch.cat(margins).mean().item()


def print_summary(trainer, accuracy: tuple | None = None) -> None:
    """Draw OUTPUT_DIR/run.png and print the run's summary table (main process only). Streaming and
    memory-plan figures are the training run's, as the saved deg.json records them (evaluations
    after the save are not counted); ``accuracy``: ``(before, after)`` from :func:`reward_accuracy`."""
    if not trainer.is_world_process_zero():
        return
    from deg_hf.checkpoint import read_deg_json

    out = trainer.args.output_dir
    record = read_deg_json(out)
    try:
        from deg_hf.plot import plot_run

        plot = plot_run(out)
    except Exception as exc:  # the plot is a nicety (matplotlib may be missing): say why, keep the run
        plot = f"- ({type(exc).__name__}: {exc})"
    rows = []
    if accuracy is not None and None not in accuracy:
        (acc0, margin0), (acc1, margin1) = accuracy
        rows = [("held-out reward accuracy", f"{acc0:.3f} -> {acc1:.3f}"),
                ("held-out reward margin", f"{margin0:+.3f} -> {margin1:+.3f}")]
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    runtime = next((h["train_runtime"] for h in reversed(history) if "train_runtime" in h), 0.0)
    evals = [h for h in history if "eval_loss" in h]
    rows += [("train loss (first -> last log)", f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"),
             *([("held-out loss (last evaluation)", f"{evals[-1]['eval_loss']:.4f}")] if evals else []),
             ("optimizer steps", f"{trainer.state.global_step} ({runtime:.1f} s)")]
    stream = (record.get("stream") or {}).get("stats") if (record.get("stream") or {}).get("enabled") else None
    if stream:
        rows += [("layer fetches (loads + buffer hits)", f"{stream['loads'] + stream['hits']} ({stream['loads']} loads)"),
                 ("bytes moved host -> device", f"{stream['bytes_moved'] / 2**20:.1f} MiB"),
                 ("layer store / device buffers",
                  f"{stream['store_bytes'] / 2**20:.2f} MiB / {stream['buffer_bytes'] / 2**20:.2f} MiB")]
        quant = stream.get("quantization")
        if quant:
            rows.append(("4-bit base (store vs unquantized)",
                         f"{quant['quant_type'].upper()}: {stream['store_bytes'] / 2**20:.2f} MiB vs "
                         f"{stream['store_unquantized_bytes'] / 2**20:.2f} MiB"))
        tiers = stream.get("tiers") or {}
        if tiers.get("placement"):
            rows.append(("store placement", str(tiers["placement"])))
    else:
        rows.append(("layer streaming", "off (resident)"))
    totals = record["memory"]["totals"]
    rows.append(("memory plan: parts / retries / skips",
                 f"{totals['parts']} / {totals['oom_retry']} / {totals['oom_skip']}"))
    sharing = record["memory"].get("prefix_sharing")
    if sharing and sharing.get("tokens_rows"):
        rows.append(("prefix sharing: tokens run / in rows",
                     f"{sharing.get('tokens_packed', 0)} / {sharing['tokens_rows']} (each prompt once per pair)"))
    elif sharing and sharing.get("fallbacks"):
        rows.append(("prefix sharing", "off: " + "; ".join(sharing["fallbacks"])))
    if trainer.deg_task in ("dpo", "kto"):
        reference = ("same base, adapter disabled (ref_model is None: True)" if trainer.ref_model is None
                     else "TRL's reference model, a frozen copy (full fine-tune)")
        rows.append(("reference model", reference))
    saved = "model" if record.get("fine_tuning") == "full" else "adapter"
    rows += [("checkpoint", f"{os.path.abspath(out)} ({saved}, deg.json, README.md)"),
             ("plot", plot), ("wall time (after imports)", f"{time.perf_counter() - _STARTED:.1f} s")]
    width = max(len(k) for k, _ in rows)
    rule = " " + "-" * (width + 50)
    model = str(record["base_model"].get("name_or_path") or trainer.model.name_or_path)
    print(f"\n deg_hf {trainer.deg_task}: {type(trainer).__name__} on {model}\n{rule}")
    for key, value in rows:
        print(f" {key:<{width}}  {value}")
    print(rule)
