"""``deg-hf plan``: estimate device memory for a LoRA run, resident and streamed, from config.json alone.

Reads the model's ``config.json`` (a local directory, a path to the file, or a Hub id: only that
one file is downloaded), never its weights, and needs no GPU. Every number comes from
:mod:`deg_hf.memory.static` (weights and adapter state), :mod:`deg_hf.memory.coef` (the activation
formula is in its module docstring) and :mod:`deg_hf.memory.planner`:

* weights and adapter state: :func:`~deg_hf.memory.static.static_breakdown` with bf16 weights,
  fp32 LoRA parameters, their fp32 gradients and AdamW's two fp32 moments;
* activations: :meth:`~deg_hf.memory.planner.MemPlanner.estimate` of one micro-batch of
  ``batch x rows_per_example`` rows of ``max_length`` tokens (gradient checkpointing on, as in
  TRL's configs and always under streaming; sdpa attention; TRL's fused LM head for SFT, DPO and KTO);
* the largest batch: :meth:`~deg_hf.memory.planner.MemPlanner.largest_batch` under the same target;
* a 4-bit base (``--quantization nf4``, or a checkpoint saved 4-bit by bitsandbytes): Linear weights
  at :func:`~deg_hf.memory.static.quant_bytes_per_weight` bytes, plus the dequantized compute buffers
  of the layers in flight;
* the host: the streamed store (:func:`~deg_hf.memory.static.host_store_bytes`) against the host
  memory the store may use (:func:`deg_hf.streaming.host.host_budget`: this machine's available
  memory, or ``--host-mem``), and the layers the RAM and disk tiers would hold.

This module imports no torch, transformers, PEFT or TRL.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

__all__ = ["QUANT_TYPES", "ROWS_PER_EXAMPLE", "FUSED_LM_HEAD_TASKS", "STREAM_BUFFERS", "read_config", "plan", "format_plan", "run"]

#: sequences one example puts through the model (chosen and rejected for the pair losses)
ROWS_PER_EXAMPLE = {"sft": 1, "kto": 1, "dpo": 2, "orpo": 2, "simpo": 2}
#: tasks whose TRL trainer scores completions with its fused (tiled) LM head
FUSED_LM_HEAD_TASKS = ("sft", "dpo", "kto")
#: decoder layers on the device at once under streaming (StreamConfig's default)
STREAM_BUFFERS = 2
WEIGHT_DTYPE_BYTES = 2  # bf16
TRAINABLE_DTYPE_BYTES = 4  # PEFT keeps LoRA parameters in fp32
OPTIMIZER = "adamw"
ATTENTION = "sdpa"
QUANT_TYPES = ("nf4", "fp4")
QUANT_BLOCKSIZE = 64  # StreamConfig's stream_quant_blocksize default
FORMULA_SOURCE = "deg_hf.memory.static (static_breakdown for weights) and deg_hf.memory.coef (module docstring: estimate for activations)"

_GIB = 1 << 30


def read_config(model: str) -> tuple[dict, str]:
    """``(config dict, where it was read)``: ``model``'s config.json, never its weights.

    ``model`` is a local model directory, a path to a config.json, or a Hub model id (only
    ``config.json`` is downloaded). Bad input raises ``ValueError``; a Hub that cannot be reached
    raises ``OSError``.
    """
    expanded = os.path.expanduser(str(model))
    if os.path.isdir(expanded):
        path = os.path.join(expanded, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{model} has no config.json: give a model directory, its config.json or a Hub model id")
        source = model
    elif os.path.isfile(expanded):
        if not expanded.endswith(".json"):
            raise ValueError(f"{model} is a file but not a config.json: give the model directory or its config.json")
        path, source = expanded, model
    else:
        from deg_hf.checkpoint import looks_like_repo_id

        if not looks_like_repo_id(str(model)):
            raise ValueError(f"{model} is neither a local model directory nor a Hub model id")
        path = _download_config(str(model))
        source = f"{model} (Hub)"
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the config.json of {model} is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except UnicodeDecodeError:
        raise ValueError(f"the config.json of {model} is not UTF-8 text") from None
    if not isinstance(config, dict):
        raise ValueError(f"the config.json of {model} does not hold a JSON object")
    return config, source


def _download_config(repo_id: str) -> str:
    import huggingface_hub
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return huggingface_hub.hf_hub_download(repo_id, "config.json")
    except LocalEntryNotFoundError:
        raise OSError(
            f"cannot download the config.json of {repo_id}: the Hub is unreachable (or HF_HUB_OFFLINE is set) "
            "and it is not in the local cache"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id} is not a Hub model repo you can access (private or gated: log in)") from None
    except RevisionNotFoundError:
        raise ValueError(f"Hub repo {repo_id} has no main revision") from None
    except EntryNotFoundError:
        raise ValueError(f"Hub repo {repo_id} has no config.json: is it a model repo?") from None


def saved_quantization(config: dict) -> dict | None:
    """``{"quant_type", "double"}`` of a config.json saved 4-bit by bitsandbytes, else None (another
    method is refused by the trainers; the plan then counts the weights unquantized)."""
    saved = config.get("quantization_config")
    if not isinstance(saved, dict) or not saved.get("load_in_4bit"):
        return None
    return {"quant_type": str(saved.get("bnb_4bit_quant_type") or "fp4"),
            "double": bool(saved.get("bnb_4bit_use_double_quant", False))}


def _host_budget(host_mem: float | None) -> tuple[int, str]:
    """Bytes the store may use, and where that came from: ``--host-mem`` GiB less the margin the
    trainers keep (10%, at least 2 GiB), or this machine's available memory less it."""
    from deg_hf.streaming.host import budget_after_margin, host_budget

    if host_mem is None:
        return host_budget(None), "this machine's available memory, less a margin of 10%, at least 2 GiB"
    total = int(host_mem * _GIB)
    return budget_after_margin(total, total), f"--host-mem {host_mem:g} GiB, less a margin of 10%, at least 2 GiB"


def _check_inputs(task: str, batch: Any, max_length: Any, vram: Any, lora_r: Any) -> None:
    if task not in ROWS_PER_EXAMPLE:
        raise ValueError(f"--task must be one of {', '.join(ROWS_PER_EXAMPLE)}, got {task!r}")
    for name, value in (("--batch", batch), ("--max-length", max_length), ("--lora-r", lora_r)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if isinstance(vram, bool) or not isinstance(vram, (int, float)) or not math.isfinite(vram) or vram <= 0:
        raise ValueError(f"--vram must be a positive number of GiB, got {vram!r}")


def plan(config: dict, *, task: str, batch: int, max_length: int, vram: float, lora_r: int,
         quantization: str | None = None, host_mem: float | None = None) -> dict:
    """The numbers ``deg-hf plan`` prints, in bytes: one entry per setup (``resident``, ``streamed``).

    Each setup has ``resident_weights``, ``layers_in_flight``, ``dequantized`` (4-bit compute
    buffers, 0 unquantized), ``adapter_state`` (adapters + gradients + optimizer), ``activations``
    (the whole batch as one micro-batch), ``total``, ``fits`` (``total <= target``),
    ``largest_batch`` and ``parts`` (micro-batches a step of ``batch`` examples needs, None when not
    even one example fits). ``quantization`` (``"nf4"``/``"fp4"``, double quantization, blocksize 64)
    defaults to what a checkpoint saved 4-bit by bitsandbytes holds. ``host`` holds the streamed
    store's bytes (and unquantized, for comparison), the budget it gets (``host_mem`` GiB of host
    memory, default this machine's) and the layers each tier would hold.
    """
    from deg_hf.memory.dims import model_dims
    from deg_hf.memory.planner import MemPlanner
    from deg_hf.memory.static import (
        host_store_bytes,
        layer_param_count,
        lora_param_count,
        quant_bytes_per_weight,
        static_breakdown,
    )
    from deg_hf.streaming.host import describe_placement, plan_placement

    _check_inputs(task, batch, max_length, vram, lora_r)
    if quantization is not None and quantization not in QUANT_TYPES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANT_TYPES)}, got {quantization!r}")
    if host_mem is not None and (isinstance(host_mem, bool) or not isinstance(host_mem, (int, float))
                                 or not math.isfinite(host_mem) or host_mem <= 0):
        raise ValueError(f"--host-mem must be a positive number of GiB, got {host_mem!r}")
    saved = saved_quantization(config)
    if quantization is not None:
        quant = {"quant_type": quantization, "double": True, "source": "--quantization"}
    elif saved is not None:
        quant = {**saved, "source": "the checkpoint (saved 4-bit by bitsandbytes)"}
    else:
        quant = None
    qbytes = None
    if quant is not None:
        quant["blocksize"] = QUANT_BLOCKSIZE
        qbytes = quant["bytes_per_weight"] = quant_bytes_per_weight(QUANT_BLOCKSIZE, quant["double"])
    dims = model_dims(config)
    rows = ROWS_PER_EXAMPLE[task]
    fused = task in FUSED_LM_HEAD_TASKS
    lora = lora_param_count(dims, lora_r, "all-linear")
    target = int(vram * _GIB)
    out: dict[str, Any] = {
        "task": task,
        "batch": batch,
        "max_length": max_length,
        "lora_r": lora_r,
        "rows_per_example": rows,
        "target_bytes": target,
        "lora_params": lora,
        "params": dims.vocab * dims.hidden * (1 if dims.tie_word_embeddings else 2) + dims.hidden
        + dims.layers * layer_param_count(dims),
        "dims": dims,
        "fused_lm_head": fused,
        "stream_buffers": STREAM_BUFFERS,
        "quantization": quant,
    }
    store = host_store_bytes(dims, dtype_bytes=WEIGHT_DTYPE_BYTES, quant_bytes_per_weight=qbytes)
    budget, budget_source = _host_budget(host_mem)
    per_layer = [math.ceil(store / dims.layers)] * dims.layers
    placement = plan_placement("auto", per_layer, budget)
    out["host"] = {
        "store_bytes": store,
        "store_unquantized_bytes": host_store_bytes(dims, dtype_bytes=WEIGHT_DTYPE_BYTES),
        "budget_bytes": budget,
        "budget_source": budget_source,
        "ram_layers": placement.count("ram"),
        "disk_layers": placement.count("disk"),
        "placement": describe_placement(placement),
    }
    for name, streaming in (("resident", False), ("streamed", True)):
        static = static_breakdown(
            dims,
            streaming=streaming,
            stream_buffers=STREAM_BUFFERS,
            lora_params=lora,
            optimizer=OPTIMIZER,
            dtype_bytes=WEIGHT_DTYPE_BYTES,
            trainable_dtype_bytes=TRAINABLE_DTYPE_BYTES,
            quant_bytes_per_weight=qbytes,
        )
        static_total = sum(static.values())
        planner = MemPlanner(
            target,
            static_total,
            model_config=dims,
            min_rows=rows,
            checkpointing=True,
            streaming=streaming,
            fused_lm_head=fused,
            dtype_bytes=WEIGHT_DTYPE_BYTES,
            attn_implementation=ATTENTION,
        )
        features = planner.features_of(batch * rows, max_length, batch * rows * max_length)
        activations = planner.estimate(features)
        largest = planner.largest_batch(max_length, rows, max_examples=max(4096, batch))
        entry = {
            "resident_weights": static["resident"],
            "layers_in_flight": static["layers"],
            "dequantized": static.get("dequantized", 0),
            "adapter_state": static["adapters"] + static["grads"] + static["optimizer"],
            "static": static_total,
            "activations": activations,
            "total": static_total + activations,
            "fits": planner.fits(features),
            "largest_batch": largest,
            "parts": math.ceil(batch / largest) if largest else None,
        }
        if task == "kto":
            # TRL's KTO also runs a no-grad forward over mismatched (prompt, completion) pairs for its KL
            # term: one more row per example, whose activations are not kept for the backward pass
            kl = planner.features_of(batch * 2 * rows, max_length, batch * 2 * rows * max_length)
            entry["total_with_kl_rows"] = static_total + planner.estimate(kl)
        out[name] = entry
    return out


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f} GiB"


def format_plan(result: dict, source: str) -> str:
    """The table ``deg-hf plan`` prints."""
    d = result["dims"]
    task, batch, rows, length = result["task"], result["batch"], result["rows_per_example"], result["max_length"]
    res, st = result["resident"], result["streamed"]
    target = result["target_bytes"]
    quant = result.get("quantization")
    weights = "bf16 weights"
    if quant:
        weights = (f"{quant['quant_type'].upper()} Linear weights ({quant['bytes_per_weight']:.4f} bytes each: blocksize "
                   f"{quant['blocksize']}, double quantization {'on' if quant['double'] else 'off'}; from "
                   f"{quant['source']}) dequantized to bf16, bf16 norms and embeddings")
    lines = [
        f"deg-hf plan: {source} (config.json only; no weights read)",
        f"model:   {d.layers} layers, hidden {d.hidden}, MLP {d.intermediate}, {d.heads} heads ({d.kv_heads} key/value), "
        f"vocab {d.vocab}, {result['params'] / 1e9:.2f} B parameters",
        f"run:     {task}, batch {batch} example(s) x {rows} row(s) x {length} tokens; LoRA r={result['lora_r']} on all "
        f"linear projections ({result['lora_params'] / 1e6:.2f} M parameters)",
        f"assumes: {weights}, fp32 LoRA parameters/gradients, AdamW (two fp32 moments), gradient checkpointing, "
        f"{ATTENTION} attention, {'TRL fused LM head' if result['fused_lm_head'] else 'full LM head'}, "
        f"{result['stream_buffers']} layers in flight when streaming",
        f"budget:  {_gib(target)} (--vram)",
        "",
    ]
    rows_out = [
        ("component", "resident", "streamed"),
        ("resident weights (embeddings, norm, LM head)", _gib(res["resident_weights"]), _gib(st["resident_weights"])),
        (f"decoder layers in flight ({d.layers} vs {min(result['stream_buffers'], d.layers)})",
         _gib(res["layers_in_flight"]), _gib(st["layers_in_flight"])),
        *([("4-bit weights dequantized for compute", _gib(res["dequantized"]), _gib(st["dequantized"]))]
          if quant else []),
        ("adapters + grads + optimizer", _gib(res["adapter_state"]), _gib(st["adapter_state"])),
        (f"activations (batch {batch} as one micro-batch)", _gib(res["activations"]), _gib(st["activations"])),
        ("estimated peak", _gib(res["total"]), _gib(st["total"])),
        (f"batch {batch} fits {target / _GIB:g} GiB", "yes" if res["fits"] else "no", "yes" if st["fits"] else "no"),
        ("largest per-device batch that fits", str(res["largest_batch"]), str(st["largest_batch"])),
        (f"micro-batches per step of {batch}",
         str(res["parts"]) if res["parts"] else "-", str(st["parts"]) if st["parts"] else "-"),
    ]
    width = max(len(r[0]) for r in rows_out) + 2
    for label, a, b in rows_out:
        lines.append(f"{label:<{width}}{a:>12}  {b:>12}")
    lines.append("")
    host = result["host"]
    store_text = f"{_gib(host['store_bytes'])} ({host['store_bytes'] / 1e9:.1f} GB)"
    if quant:
        store_text += f" in {quant['quant_type'].upper()} (bf16: {_gib(host['store_unquantized_bytes'])})"
    if host["disk_layers"] == 0:
        where = "fits in RAM"
    elif host["ram_layers"] == 0:
        where = "does not fit in RAM: every layer streams from the disk cache"
    else:
        where = f"does not all fit in RAM: {host['placement']}"
    lines.append(
        f"host:    streamed store of {d.layers} decoder layers {store_text}; budget {_gib(host['budget_bytes'])} "
        f"({host['budget_source']}): {where}"
    )
    if task == "kto":
        lines.append(
            "note: KTO also runs a no-grad forward over mismatched pairs for its KL term (one more row per example, "
            "activations not kept); charging it as a full row: resident "
            f"{_gib(res['total_with_kl_rows'])}, streamed {_gib(st['total_with_kl_rows'])}. "
            "KTO needs a per-device batch >= 2."
        )
    for name, entry in (("resident", res), ("streamed", st)):
        if entry["largest_batch"] == 0:
            if entry["static"] > target:
                why = f"its weights and adapter state alone need {_gib(entry['static'])}"
            else:
                why = f"one example's activations need more than the {_gib(target - entry['static'])} left"
            lines.append(f"{name}: does not fit even one example: {why}")
    lines.append(f"formulas: {FORMULA_SOURCE}; estimates are upper bounds before calibration (scale 1.0)")
    return "\n".join(lines)


def run(args) -> int:
    """``deg-hf plan MODEL``: print the plan; 0 when it was computed (bad input raises ValueError)."""
    from deg_hf.streaming.checks import check_causal_lm

    config, source = read_config(args.model)
    check_causal_lm(config, source)  # an encoder or encoder-decoder has no decoder layers to plan
    result = plan(
        config, task=args.task, batch=args.batch, max_length=args.max_length, vram=args.vram, lora_r=args.lora_r,
        quantization=getattr(args, "quantization", None), host_mem=getattr(args, "host_mem", None),
    )
    print(format_plan(result, source))
    return 0
