"""Stream and memory settings, mixed into each trainer's configuration class.

``StreamConfig`` holds the fields; ``StreamedTrainingArguments``, ``StreamedSFTConfig``, ... are the
upstream configuration classes with those fields added, so one object configures both the trainer
and the streaming (and ``TrlParser``/``HfArgumentParser`` expose them on the command line). A plain
upstream config is accepted by every deg_hf trainer too: :func:`stream_settings` then supplies the
defaults.
"""

from __future__ import annotations

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


def validate_stream_settings(cfg) -> None:
    if int(getattr(cfg, "stream_buffers", 2)) < 1:
        raise ValueError(
            f"stream_buffers must be >= 1 (the number of decoder layers held on the device at once), "
            f"got {cfg.stream_buffers}"
        )
    target = getattr(cfg, "mem_target_gb", None)
    if target is not None and not target > 0:
        raise ValueError(f"mem_target_gb must be > 0 GB (or None for the default), got {target}")
    if int(getattr(cfg, "oom_max_splits", 16)) < 0:
        raise ValueError(f"oom_max_splits must be >= 0, got {cfg.oom_max_splits}")
    tier = getattr(cfg, "stream_tier", "auto")
    if tier not in STREAM_TIERS:
        raise ValueError(f"stream_tier must be one of {', '.join(STREAM_TIERS)}, got {tier!r}")
    host = getattr(cfg, "host_mem_gb", None)
    if host is not None and (isinstance(host, bool) or not isinstance(host, (int, float)) or not 0 < host < float("inf")):
        raise ValueError(f"host_mem_gb must be a number of GB > 0 (or None for the available memory), got {host!r}")
    quant = getattr(cfg, "stream_quantization", None)
    if quant is not None and quant not in QUANT_TYPES:
        raise ValueError(f"stream_quantization must be one of {', '.join(QUANT_TYPES)} or None, got {quant!r}")
    blocksize = getattr(cfg, "stream_quant_blocksize", 64)
    if isinstance(blocksize, bool) or blocksize not in QUANT_BLOCKSIZES:
        raise ValueError(
            f"stream_quant_blocksize must be one of {', '.join(map(str, QUANT_BLOCKSIZES))}, got {blocksize!r}"
        )


def stream_settings(args) -> StreamConfig:
    """The stream fields of ``args`` (any config object), with defaults for those it lacks."""
    values = {}
    for f in fields(StreamConfig):
        values[f.name] = getattr(args, f.name, f.default) if args is not None else f.default
    settings = StreamConfig.__new__(StreamConfig)
    for name, value in values.items():
        setattr(settings, name, value)
    validate_stream_settings(settings)
    return settings


def _lazy_config_classes():
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
