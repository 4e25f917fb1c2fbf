"""Stream and memory settings, mixed into each trainer's configuration class.

``StreamConfig`` holds the fields; ``StreamedTrainingArguments``, ``StreamedSFTConfig``, ... are the
upstream configuration classes with those fields added, so one object configures both the trainer
and the streaming (and ``TrlParser``/``HfArgumentParser`` expose them on the command line). A plain
upstream config is accepted by every deg_hf trainer too: :func:`stream_settings` then supplies the
defaults.

Every deg_hf setting is checked for type and range here and only here (:func:`check_setting`), by
the config classes, by :func:`stream_settings` and by the streaming builder; a bad value raises
:class:`SettingError` naming the field. :func:`check_model_init_kwargs` refuses, by name, every
``model_init_kwargs`` entry a streamed build would not honour.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field, fields

ROLLOUT_REFUSAL = (
    "{name} cannot run with stream_layers=True, and this is not a missing feature: generating a "
    "rollout re-reads every decoder layer for each generated token, which destroys the amortisation "
    "layer streaming depends on (one host-to-device pass per layer per forward over a whole batch). "
    "Train {name} resident (stream_layers=False), or use an offline preference method (DPO, KTO, "
    "ORPO, SimPO) on pre-generated completions."
)


@dataclass
class StreamConfig:
    """Layer-streaming and memory-planning settings shared by every deg_hf trainer."""

    stream_layers: bool = field(
        default=True,
        metadata={"help": "Stream decoder layers from host memory to the device one at a time. "
                  "False trains the ordinary resident model through the same trainer."},
    )
    stream_buffers: int = field(
        default=2,
        metadata={"help": "Decoder layers held on the device at once (>= 1). 2 lets the next layer "
                  "load while the current one computes."},
    )
    stream_cache_dir: str | None = field(
        default=None,
        metadata={"help": "Directory for a converted copy of the layer weights, keyed by a "
                  "fingerprint of the source files, so later runs load faster."},
    )
    stream_quantization: str | None = field(
        default=None,
        metadata={"help": "Store the decoder layers' Linear weights 4-bit in host memory: 'nf4' or 'fp4' "
                  "(QLoRA; needs bitsandbytes: pip install 'deg_hf[nf4]'). A quantization_config with "
                  "load_in_4bit in model_init_kwargs, or TRL's --load_in_4bit, asks for the same. None: the "
                  "training dtype (a checkpoint saved 4-bit streams 4-bit as it is)."},
    )
    stream_quant_double: bool = field(
        default=True,
        metadata={"help": "Double quantization: the per-block scales are themselves stored 8-bit "
                  "(about 0.4 bits per weight less)."},
    )
    stream_quant_blocksize: int = field(
        default=64,
        metadata={"help": "Weights per 4-bit block, each with its own scale (32 ... 4096; bitsandbytes' default 64)."},
    )
    stream_tier: str = field(
        default="auto",
        metadata={"help": "Where the layer store lives: 'ram' (host memory), 'disk' (the layer cache, read each "
                  "sweep by a background loader) or 'auto' (as many layers in RAM as host_mem_gb holds, the "
                  "rest from disk)."},
    )
    stream_share_store: bool = field(
        default=True,
        metadata={"help": "With several processes per node (torchrun, accelerate launch), local rank 0 builds the "
                  "layer store once into shared memory (/dev/shm) and the node's other ranks map it read-only. "
                  "False: every rank builds its own store (DEG_HF_SHARE_STORE=0 does the same)."},
    )
    host_mem_gb: float | None = field(
        default=None,
        metadata={"help": "Host-memory budget in GB for the layer store. None: the available memory less a "
                  "margin (10 percent of the machine, at least 2 GB) for the OS, dataloaders and activations."},
    )
    mem_target_gb: float | None = field(
        default=None,
        metadata={"help": "Device-memory target in GB for planning micro-batches. None: 90 percent of the "
                  "device's memory on CUDA, unlimited on CPU."},
    )
    mem_plan: bool = field(
        default=True,
        metadata={"help": "Run each micro-batch in as many parts as the memory target requires."},
    )
    mem_coef_file: str | None = field(
        default=None,
        metadata={"help": "JSON file of memory-estimate coefficients (scripts/calibrate_memory.py)."},
    )
    oom_retry: bool = field(
        default=True,
        metadata={"help": "On out-of-memory, drop the step's partial gradients, split it and retry."},
    )
    oom_max_splits: int = field(
        default=16,
        metadata={"help": "Upper bound on split-and-retry attempts within one optimizer step."},
    )
    oom_max_skip_fraction: float = field(
        default=0.05,
        metadata={"help": "Largest share of the run's examples that may be skipped because they run out of "
                  "memory even alone; a run that skips more (or skips every example) stops with an error "
                  "naming the skipped rows."},
    )

    def __post_init__(self):
        validate_stream_settings(self)
        parent = super()
        if hasattr(parent, "__post_init__"):
            parent.__post_init__()


STREAM_FIELDS = tuple(f.name for f in fields(StreamConfig))


@dataclass
class PrefixSharingConfig:
    """The shared-prefix field of the paired preference configs (DPO, ORPO, SimPO)."""

    prefix_sharing: bool = field(
        default=True,
        metadata={"help": "Run each prompt once per pair: [prompt | chosen | rejected] as one sequence with a "
                  "tree attention mask. Falls back to the ordinary forward, saying why once, where the mask "
                  "cannot be honoured."},
    )
    group_by_prompt: bool = field(
        default=False,
        metadata={"help": "Shuffle prompts rather than pairs, so the pairs of one prompt (ranked data turned into "
                  "pairs) share a micro-batch and its prompt runs once for all of them."},
    )


#: what stream_quantization and stream_quant_blocksize accept (bitsandbytes' 4-bit types and block sizes)
QUANT_TYPES = ("nf4", "fp4")
QUANT_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
STREAM_TIERS = ("auto", "ram", "disk")


class SettingError(ValueError):
    """A deg_hf setting of the wrong type or out of range; the message names the field."""


def _describe(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _flag(name: str, value, meaning: str):
    if not isinstance(value, bool):
        raise SettingError(f"{name} must be True or False ({meaning}), got {_describe(value)}")
    return value


def _whole(name: str, value, minimum: int, meaning: str):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SettingError(f"{name} must be a whole number >= {minimum} ({meaning}), got {_describe(value)}")
    if value < minimum:
        raise SettingError(f"{name} must be >= {minimum} ({meaning}), got {value}")
    return int(value)


def _real(name: str, value, meaning: str, *, low: float, high: float | None = None, low_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SettingError(f"{name} must be a finite number ({meaning}), got {_describe(value)}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bound = f"> {low}" if low_open else f">= {low}"
        if high is not None:
            bound += f" and <= {high}"
        raise SettingError(f"{name} must be {bound} ({meaning}), got {value}")
    return value


def _choice(name: str, value, allowed: tuple, meaning: str):
    if isinstance(value, bool) or not isinstance(value, type(allowed[0])) or value not in allowed:
        raise SettingError(f"{name} must be one of {', '.join(map(str, allowed))} ({meaning}), got {_describe(value)}")
    return value


def _path(name: str, value, meaning: str, *, kind: str):
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise SettingError(f"{name} must be a path ({meaning}) or None, got {_describe(value)}")
    path = os.path.expanduser(os.fspath(value))
    if kind == "file":
        if not os.path.isfile(path):
            raise SettingError(f"{name}={os.fspath(value)!r}: no such file ({meaning}); write one with "
                               "scripts/calibrate_memory.py, or leave it None for the built-in coefficients")
        try:
            with open(path, encoding="utf-8") as fh:
                content = json.load(fh)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SettingError(f"{name}={os.fspath(value)!r} cannot be read as JSON ({meaning}): {exc}") from None
        if not isinstance(content, dict):
            raise SettingError(f"{name}={os.fspath(value)!r} must hold a JSON object of coefficients ({meaning})")
    elif os.path.exists(path) and not os.path.isdir(path):
        raise SettingError(f"{name}={os.fspath(value)!r} is a file; it must be a directory ({meaning})")
    return value


#: every deg_hf field: how it is checked (its value, or None where None is allowed, is returned)
_RULES = {
    "stream_layers": lambda v: _flag("stream_layers", v, "stream decoder layers from host memory"),
    "stream_buffers": lambda v: _whole("stream_buffers", v, 1, "decoder layers held on the device at once"),
    "stream_cache_dir": lambda v: None if v is None else _path(
        "stream_cache_dir", v, "where the flat copy of the layer weights is kept", kind="dir"),
    "stream_tier": lambda v: _choice("stream_tier", v, STREAM_TIERS, "where the layer store lives"),
    "stream_share_store": lambda v: _flag("stream_share_store", v, "one layer store per node, shared by its ranks"),
    "host_mem_gb": lambda v: None if v is None else _real(
        "host_mem_gb", v, "host-memory budget in GiB for the layer store, or None for the available memory",
        low=0, low_open=True),
    "stream_quantization": lambda v: None if v is None else _choice(
        "stream_quantization", v, QUANT_TYPES, "4-bit storage of the decoder weights, or None"),
    "stream_quant_double": lambda v: _flag("stream_quant_double", v, "quantize the 4-bit block scales too"),
    "stream_quant_blocksize": lambda v: _choice(
        "stream_quant_blocksize", v, QUANT_BLOCKSIZES, "weights per 4-bit block"),
    "mem_target_gb": lambda v: None if v is None else _real(
        "mem_target_gb", v, "device-memory target in GiB, or None for the default", low=0, low_open=True),
    "mem_plan": lambda v: _flag("mem_plan", v, "plan micro-batches under the memory target"),
    "mem_coef_file": lambda v: None if v is None else _path(
        "mem_coef_file", v, "JSON of memory-estimate coefficients", kind="file"),
    "oom_retry": lambda v: _flag("oom_retry", v, "split and retry a part that runs out of memory"),
    "oom_max_splits": lambda v: _whole("oom_max_splits", v, 0, "out-of-memory retries allowed per optimizer step"),
    "oom_max_skip_fraction": lambda v: _real(
        "oom_max_skip_fraction", v, "share of the run's examples that may be skipped for memory",
        low=0.0, high=1.0),
    "prefix_sharing": lambda v: _flag("prefix_sharing", v, "run each pair's prompt once"),
    "group_by_prompt": lambda v: _flag("group_by_prompt", v, "keep the pairs of one prompt in one micro-batch"),
}


def check_setting(name: str, value):
    """Check one deg_hf setting for type and range; returns it, or raises :class:`SettingError`
    naming the field. The one place settings are validated: the config classes, plain upstream
    configs (:func:`stream_settings`) and the streaming builder all come through here."""
    return _RULES[name](value)


def validate_stream_settings(cfg) -> None:
    """Check every deg_hf field ``cfg`` carries (see :func:`check_setting`)."""
    for name in _RULES:
        if hasattr(cfg, name):
            check_setting(name, getattr(cfg, name))


def stream_settings(args) -> StreamConfig:
    """The stream fields of ``args`` (any config object), with defaults for those it lacks, checked."""
    values = {}
    for f in fields(StreamConfig):
        values[f.name] = getattr(args, f.name, f.default) if args is not None else f.default
    settings = StreamConfig.__new__(StreamConfig)
    for name, value in values.items():
        setattr(settings, name, value)
    validate_stream_settings(settings)
    return settings


#: model_init_kwargs a streamed build honours, and what each one does there
STREAMED_INIT_KWARGS = {
    "dtype": "the dtype the host store holds and the layers compute in ('auto': the checkpoint's own)",
    "torch_dtype": "the older name of dtype",
    "attn_implementation": "the attention kernel of the model skeleton",
    "revision": "the Hub branch, tag or commit the weights are downloaded from",
    "quantization_config": "a bitsandbytes 4-bit config: the decoder layers are stored 4-bit (deg_hf.streaming.quant)",
    "low_cpu_mem_usage": "always the case: streaming never materialises a second copy of the weights",
    "trust_remote_code": "False only: streaming builds transformers' own architectures",
}


def check_model_init_kwargs(init_kwargs, settings, *, quantization_config=None, trust_remote_code=False) -> None:
    """Refuse, by name and with the remedy, every ``model_init_kwargs`` entry a streamed build would
    not honour (see :data:`STREAMED_INIT_KWARGS`); also the trainers' own ``quantization_config``
    argument and ``trust_remote_code=True``. Called only with ``stream_layers=True``: resident
    models go through ``from_pretrained(**model_init_kwargs)``, which honours every key."""
    init_kwargs = dict(init_kwargs or {})
    resident = "or pass stream_layers=False to load the model with from_pretrained(**model_init_kwargs)"
    if quantization_config is not None:
        raise SettingError(
            "the trainer's quantization_config argument is not used with stream_layers=True: pass it as "
            "model_init_kwargs={'quantization_config': ...} or set stream_quantization='nf4', " + resident + "."
        )
    if init_kwargs.get("quantization_config") is not None:
        from deg_hf.streaming.quant import resolve_spec

        try:  # 4-bit bitsandbytes is stored 4-bit; every other method is refused there, saying why
            resolve_spec(settings, init_kwargs["quantization_config"])
        except ValueError as exc:
            raise SettingError(f"model_init_kwargs['quantization_config']: {exc}") from None
    if init_kwargs.get("device_map") is not None:
        raise SettingError(
            f"model_init_kwargs['device_map']={init_kwargs['device_map']!r} cannot be honoured with "
            "stream_layers=True: deg_hf places the model itself (embeddings, final norm and LM head on the "
            "training device, decoder layers streamed from host memory). Remove device_map (choose the "
            "device with use_cpu or CUDA_VISIBLE_DEVICES), " + resident + "."
        )
    init_kwargs.pop("device_map", None)
    if init_kwargs.get("trust_remote_code") or trust_remote_code:
        raise SettingError(
            "trust_remote_code=True cannot be honoured with stream_layers=True: layer streaming builds "
            "transformers' own architectures and never runs a checkpoint's custom modelling code. Use a "
            "checkpoint supported by transformers itself, " + resident + "."
        )
    unknown = sorted(k for k in init_kwargs if k not in STREAMED_INIT_KWARGS)
    if unknown:
        honoured = ", ".join(STREAMED_INIT_KWARGS)
        raise SettingError(
            f"model_init_kwargs[{unknown[0]!r}] is not used when layers are streamed: deg_hf builds the model "
            f"itself and honours only {honoured} (got {', '.join(map(repr, unknown))}). Remove "
            f"{'it' if len(unknown) == 1 else 'them'}, " + resident + "."
        )
    for key in ("dtype", "torch_dtype"):
        if init_kwargs.get(key) is not None:
            _check_dtype(key, init_kwargs[key])
    for key in ("attn_implementation", "revision"):
        value = init_kwargs.get(key)
        if value is not None and not isinstance(value, str):
            raise SettingError(f"model_init_kwargs[{key!r}] must be a string or None, got {_describe(value)}")


def _check_dtype(key: str, value) -> None:
    import torch

    if isinstance(value, torch.dtype) and value.is_floating_point:
        return
    if isinstance(value, str) and (value == "auto" or (
            isinstance(getattr(torch, value, None), torch.dtype) and getattr(torch, value).is_floating_point)):
        return
    raise SettingError(
        f"model_init_kwargs[{key!r}] must be 'auto', a floating torch dtype or its name ('bfloat16', "
        f"'float16', 'float32'), got {_describe(value)}"
    )


def _lazy_config_classes():
    import os

    # the ORPO and SimPO configs build on TRL's experimental ORPO/CPO configs; a user asking for a
    # DPO config did not import anything experimental, so TRL's notice about it is ours to keep quiet
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from deg_hf.notices import quiet_upstream_notices

    quiet_upstream_notices()
    from transformers import TrainingArguments
    from trl import DPOConfig, KTOConfig, SFTConfig
    from trl.experimental.cpo import CPOConfig
    from trl.experimental.orpo import ORPOConfig

    @dataclass
    class StreamedTrainingArguments(StreamConfig, TrainingArguments):
        """``transformers.TrainingArguments`` with the deg_hf stream and memory fields."""

    @dataclass
    class StreamedSFTConfig(StreamConfig, SFTConfig):
        """TRL's ``SFTConfig`` with the deg_hf stream and memory fields."""

    @dataclass
    class StreamedDPOConfig(StreamConfig, PrefixSharingConfig, DPOConfig):
        """TRL's ``DPOConfig`` with the deg_hf stream and memory fields."""

    @dataclass
    class StreamedKTOConfig(StreamConfig, KTOConfig):
        """TRL's ``KTOConfig`` with the deg_hf stream and memory fields.

        KTO's KL term compares each completion with the other prompts of its micro-batch, so a
        per-device batch of 1 is refused here, before any weight is read."""

        def __post_init__(self):
            check_kto_batch(self)
            super().__post_init__()

    @dataclass
    class StreamedORPOConfig(StreamConfig, PrefixSharingConfig, ORPOConfig):
        """TRL's ``ORPOConfig`` (``trl.experimental.orpo``) with the deg_hf stream and memory fields."""

    @dataclass
    class SimPOConfig(StreamConfig, PrefixSharingConfig, CPOConfig):
        """SimPO as TRL's CPO trainer runs it: ``loss_type="simpo"`` with no behaviour-cloning term
        (``cpo_alpha=0``), and the SimPO paper's ``beta=2.0`` and ``simpo_gamma=0.5`` (gamma/beta
        ratio 0.25) as defaults."""

        loss_type: str = field(default="simpo", metadata={"help": "SimPO's length-normalised margin loss."})
        cpo_alpha: float = field(default=0.0, metadata={"help": "Weight of the NLL term; 0 for SimPO."})
        beta: float = field(default=2.0, metadata={"help": "SimPO's reward scale (paper default 2.0)."})
        simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO's target reward margin."})

    return {
        "StreamedTrainingArguments": StreamedTrainingArguments,
        "StreamedSFTConfig": StreamedSFTConfig,
        "StreamedDPOConfig": StreamedDPOConfig,
        "StreamedKTOConfig": StreamedKTOConfig,
        "StreamedORPOConfig": StreamedORPOConfig,
        "SimPOConfig": SimPOConfig,
    }


def check_kto_batch(cfg) -> None:
    if int(getattr(cfg, "per_device_train_batch_size", 8)) < 2:
        raise ValueError(
            "KTO needs per_device_train_batch_size >= 2: its KL term pairs each completion with a "
            "different prompt of the same micro-batch, and with one example it degenerates into the "
            f"implied reward itself. Got per_device_train_batch_size={cfg.per_device_train_batch_size}."
        )


_CLASSES: dict | None = None


def __getattr__(name: str):
    # the config classes subclass transformers/TRL dataclasses: build them on first use only, so
    # importing this module (and deg_hf) stays free of torch
    global _CLASSES
    if name in ("StreamedTrainingArguments", "StreamedSFTConfig", "StreamedDPOConfig", "StreamedKTOConfig",
                "StreamedORPOConfig", "SimPOConfig"):
        if _CLASSES is None:
            _CLASSES = _lazy_config_classes()
        cls = _CLASSES[name]
        cls.__module__ = __name__
        cls.__qualname__ = name
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
