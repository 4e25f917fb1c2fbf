"""The memory target, the planner a trainer plans with, and the pre-flight check.

The pre-flight check runs before any weight is read (it needs config.json only): a run whose
smallest unit (one example's rows at ``max_length``; two examples for KTO) cannot fit the target
is refused with the numbers. Its estimate models the run as it will be (streamed when streaming),
so a streamed run is never refused for what a resident run would need.
"""

from __future__ import annotations

from deg_hf.memory.coef import GIB, MIB, MemCoef, lora_param_count, static_breakdown
from deg_hf.memory.planner import MemPlanner

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
                 fused_lm_head: bool, checkpointing: bool | None = None) -> MemPlanner:
    """The planner a trainer plans with. ``checkpointing`` (None: on when streaming) says whether
    decoder layers keep only their inputs for the backward (streaming always; resident with
    ``gradient_checkpointing``)."""
    static = sum(static_breakdown(
        model_config, streaming=streaming, stream_buffers=settings.stream_buffers,
        lora_params=trainable_params, dtype_bytes=dtype_bytes,
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


def preflight(trainer_name: str, planner: MemPlanner, *, rows_per_example: int, kl_rows_per_example: int,
              min_examples: int, batch: int, max_length: int) -> dict:
    """Estimate the configured micro-batch and refuse a run whose smallest unit cannot fit."""
    rows = rows_per_example + kl_rows_per_example

    def need(examples: int) -> int:
        return planner.static_bytes + planner.estimate(planner.features_of(examples * rows, max_length))

    report = {
        "target_bytes": planner.target_bytes,
        "static_bytes": planner.static_bytes,
        "rows_per_example": rows,
        "batch": batch,
        "max_length": max_length,
        "estimated_peak_bytes": need(max(batch, min_examples)),
        "smallest_unit_bytes": need(min_examples),
    }
    if planner.target_bytes < UNLIMITED and report["smallest_unit_bytes"] > planner.target_bytes:
        raise ValueError(
            f"{trainer_name} cannot fit the memory target: its smallest unit ({min_examples} example(s) x "
            f"{rows} row(s) x {max_length} tokens) needs an estimated {report['smallest_unit_bytes'] / GIB:.2f} GiB "
            f"({planner.static_bytes / GIB:.2f} GiB of weights in flight, adapters and optimizer state, plus "
            f"activations) but mem_target_gb is {planner.target_bytes / GIB:.2f} GiB. Lower max_length or the "
            "LoRA rank, keep stream_layers=True, or raise mem_target_gb."
        )
    return report
