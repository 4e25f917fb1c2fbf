"""The memory target, the planner a trainer plans with, and the pre-flight check.

The pre-flight check runs before any weight is read (it needs config.json only): a run whose
smallest unit (one example's rows at ``max_length``; two examples for KTO) cannot fit the target
is refused with the numbers. Its estimate models the run as it will be (streamed when streaming),
so a streamed run is never refused for what a resident run would need. Without a ``max_length``
(rows not truncated) the length is that of the longest tokenised row of the dataset, so the check
then runs once the trainer has tokenised it.
"""

from __future__ import annotations

from deg_hf.memory.coef import GIB, MIB, MemCoef
from deg_hf.memory.planner import MemPlanner
from deg_hf.memory.static import lora_param_count, static_breakdown

#: the largest target a planner uses when none applies (CPU without mem_target_gb): everything fits
UNLIMITED = 1 << 60


def target_bytes(settings, device) -> int | None:
    """``mem_target_gb`` in bytes (GiB), or 90% of the CUDA device's memory, or None (unlimited)."""
    if settings.mem_target_gb is not None:
        return int(settings.mem_target_gb * GIB)
    if getattr(device, "type", str(device)) == "cuda":
        import torch

        return int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    return None


def coefficients(settings) -> MemCoef:
    return MemCoef.load(settings.mem_coef_file) if settings.mem_coef_file else MemCoef()


def lora_params(model_config, peft_config) -> int:
    r = int(getattr(peft_config, "r", 16) or 16)
    targets = getattr(peft_config, "target_modules", None) or "all-linear"
    if isinstance(targets, str) and targets != "all-linear":
        targets = "all-linear"  # a regex: count every projection (an upper bound)
    try:
        return lora_param_count(model_config, r, targets)
    except (KeyError, ValueError):
        return lora_param_count(model_config, r, "all-linear")


def make_planner(model_config, settings, *, device, streaming: bool, trainable_params: int,
                 dtype_bytes: int, rows_per_example: int, attn_implementation: str | None,
                 fused_lm_head: bool, checkpointing: bool | None = None,
                 quant_bytes: float | None = None) -> MemPlanner:
    """The planner a trainer plans with. ``checkpointing`` (None: on when streaming) says whether
    decoder layers keep only their inputs for the backward (streaming always; resident with
    ``gradient_checkpointing``). ``quant_bytes``: bytes per weight of a 4-bit base
    (:func:`~deg_hf.memory.static.quant_bytes_per_weight`), whose layers in flight are counted
    quantized plus their dequantized compute buffers."""
    static = sum(static_breakdown(
        model_config, streaming=streaming, stream_buffers=settings.stream_buffers,
        lora_params=trainable_params, dtype_bytes=dtype_bytes, quant_bytes_per_weight=quant_bytes,
    ).values())
    target = target_bytes(settings, device)
    return MemPlanner(
        UNLIMITED if target is None else target,
        static,
        coefficients(settings),
        model_config=model_config,
        min_rows=rows_per_example,
        streaming=streaming,
        checkpointing=streaming if checkpointing is None else checkpointing,
        fused_lm_head=fused_lm_head,
        # TRL's fused head scores only labelled positions where Triton runs, every position elsewhere
        lm_head_compact=getattr(device, "type", str(device)) == "cuda",
        # the CPU meter counts tensor bytes exactly: even a small part's peak calibrates
        noise_floor_bytes=256 * MIB if getattr(device, "type", str(device)) == "cuda" else 0,
        dtype_bytes=dtype_bytes,
        attn_implementation=attn_implementation or "sdpa",
    )


#: tokenised columns that are whole rows, and those that follow a prompt in one row
_ROW_COLUMNS = ("input_ids", "chosen_input_ids", "rejected_input_ids")
_COMPLETION_COLUMNS = ("chosen_ids", "rejected_ids", "completion_ids", "KL_completion_ids")


def longest_row(dataset) -> tuple[int, int] | None:
    """``(tokens, row index)`` of the longest row a tokenised dataset puts through the model (a
    prompt plus its longest completion for TRL's preference layouts); None when it cannot be told
    (an iterable dataset, or no tokenised column)."""
    names = getattr(dataset, "column_names", None)
    if not names or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    rows = [c for c in _ROW_COLUMNS if c in names]
    completions = [c for c in _COMPLETION_COLUMNS if c in names]
    if not rows and not ("prompt_ids" in names and completions):
        return None
    lengths = [0] * len(dataset)
    for column in rows:
        lengths = [max(n, len(x)) for n, x in zip(lengths, dataset[column])]
    if "prompt_ids" in names and completions:
        prompts = [len(x) for x in dataset["prompt_ids"]]
        longest = [0] * len(dataset)
        for column in completions:
            longest = [max(n, len(x)) for n, x in zip(longest, dataset[column])]
        lengths = [max(n, p + c) for n, p, c in zip(lengths, prompts, longest)]
    index = max(range(len(lengths)), key=lengths.__getitem__)
    return lengths[index], index


def preflight(trainer_name: str, planner: MemPlanner, *, rows_per_example: int, kl_rows_per_example: int,
              min_examples: int, batch: int, max_length: int, length_source: str | None = None) -> dict:
    """Estimate the configured micro-batch and refuse a run whose smallest unit cannot fit.
    ``length_source`` says where ``max_length`` came from when it is not the configured one."""
    rows = rows_per_example + kl_rows_per_example

    def need(examples: int) -> int:
        return planner.static_bytes + planner.estimate(planner.features_of(examples * rows, max_length))

    report = {
        "target_bytes": planner.target_bytes,
        "static_bytes": planner.static_bytes,
        "rows_per_example": rows,
        "batch": batch,
        "max_length": max_length,
        "length_source": length_source or "max_length",
        "estimated_peak_bytes": need(max(batch, min_examples)),
        "smallest_unit_bytes": need(min_examples),
    }
    if planner.target_bytes < UNLIMITED and report["smallest_unit_bytes"] > planner.target_bytes:
        raise ValueError(
            f"{trainer_name} cannot fit the memory target: its smallest unit ({min_examples} example(s) x "
            f"{rows} row(s) x {max_length} tokens) needs an estimated {report['smallest_unit_bytes'] / GIB:.2f} GiB "
            f"({planner.static_bytes / GIB:.2f} GiB of weights in flight, adapters and optimizer state, plus "
            f"activations) but mem_target_gb is {planner.target_bytes / GIB:.2f} GiB"
            + (f" ({max_length} tokens: {length_source}, max_length=None)" if length_source else "")
            + ". Lower max_length or the LoRA rank, keep stream_layers=True, or raise mem_target_gb."
        )
    return report
