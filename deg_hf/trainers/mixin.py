"""StreamingSetupMixin: the one setup every deg_hf trainer shares.

A deg_hf trainer is ``class StreamedXTrainer(StreamingSetupMixin, XTrainer)``. Before the upstream
``__init__`` runs, the mixin resolves the model (a Hub id, a path, or a loaded model), builds it
streamed (or resident with ``stream_layers=False``), applies the LoRA adapter, and refuses, with a
reason and a remedy, what cannot work. The upstream trainer then sees an ordinary PEFT model.

This module stays import-light (no top-level torch, transformers, PEFT or TRL): configuration code
and ``deg-hf --help`` import deg_hf without paying for them.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

from deg_hf.config import ROLLOUT_REFUSAL, stream_settings

logger = logging.getLogger(__name__)

#: TRL trainers whose training loop generates rollouts with the model being trained
ROLLOUT_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "PPOTrainer", "OnlineDPOTrainer", "NashMDTrainer",
                    "XPOTrainer", "GKDTrainer")

#: PEFT options that read the base weights when the adapter is created (or need them in every
#: forward, like DoRA's weight norm): under streaming those weights are not in memory
_BASE_READING_INITS = ("pissa", "olora", "loftq", "eva", "corda", "orthogonal")

DEFAULT_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}


class StreamingSetupMixin:
    """Shared setup of every deg_hf trainer: streamed model, adapter, refusals, runtime lifetime.

    Class attributes a trainer declares:

    * ``deg_task`` - the task name written to deg.json (``sft``, ``dpo``, ``kto``, ``orpo``, ``simpo``).
    * ``deg_rows_per_example`` - sequences one example puts through the model in a step (2 for
      losses that concatenate chosen and rejected); the memory estimate multiplies by it.
    * ``deg_min_batch`` - the smallest per-device batch the loss is defined for.
    """

    deg_task: str = "sft"
    deg_rows_per_example: int = 1
    deg_min_batch: int = 1
    deg_config_class: str = "StreamedTrainingArguments"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__:
            if base.__name__ in ROLLOUT_TRAINERS:
                raise TypeError(ROLLOUT_REFUSAL.format(name=base.__name__))

    def __init__(self, *args, **kwargs):
        # bind by the upstream signature, so positional calls work as they do upstream (DPOTrainer
        # takes `ref_model` second, Trainer takes `args` second)
        upstream = super().__init__
        bound = inspect.signature(upstream).bind_partial(*args, **kwargs).arguments
        extra = bound.pop("kwargs", {}) if isinstance(bound.get("kwargs"), dict) else {}
        params = {**bound, **extra}
        model, config = params.get("model"), params.get("args")
        settings = stream_settings(config)
        self.deg_stream = settings
        self.stream_runtime = None
        self.deg_default_lora = False
        self.deg_notes: list[str] = []
        if config is None:
            config = params["args"] = self._deg_default_args(model)
        self._deg_check_batch(config)
        peft_config = params.pop("peft_config", None)
        if params.get("ref_model") is not None and settings.stream_layers:
            raise ValueError(
                "ref_model cannot be passed with stream_layers=True: the reference is the same streamed "
                "base with the adapter disabled, so no second model is ever loaded. Drop ref_model "
                "(or set stream_layers=False to train resident with an explicit reference)."
            )
        if settings.stream_layers:
            _refuse_base_reading_peft(peft_config)
        model = self._deg_build_model(model, config, settings)
        try:
            if not _is_peft_model(model):
                peft_config = self._deg_peft_config(peft_config)
                if "peft_config" in inspect.signature(upstream).parameters:
                    # TRL applies it: its preference trainers then take the reference from the
                    # same model with the adapter disabled
                    params["peft_config"] = peft_config
                else:
                    from peft import get_peft_model

                    model = get_peft_model(model, peft_config)
            params["model"] = model
            upstream(**params)
            if self.stream_runtime is not None:
                from deg_hf.streaming.build import materialize_adapters

                # adapters on streamed layers were created on `meta` (their base layer's device)
                materialize_adapters(self.model, self.stream_runtime.device)
        except BaseException:
            self.release_stream()
            raise

    # ------------------------------------------------------------------ setup steps
    def _deg_default_args(self, model):
        import deg_hf.config as config

        name = model if isinstance(model, str) else getattr(model, "name_or_path", "model")
        return getattr(config, self.deg_config_class)(output_dir=f"{str(name).rstrip('/').split('/')[-1]}-{self.deg_task}")

    def _deg_check_batch(self, args) -> None:
        batch = int(getattr(args, "per_device_train_batch_size", 1))
        if batch < self.deg_min_batch:
            raise ValueError(
                f"{type(self).__name__} needs per_device_train_batch_size >= {self.deg_min_batch}, got {batch}."
            )

    def _deg_build_model(self, model, args, settings):
        from peft import PeftModel
        from transformers import PreTrainedModel

        if model is None:
            raise ValueError(f"{type(self).__name__} needs a model: a Hub id, a local path or a loaded model.")
        init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
        if isinstance(model, PeftModel):
            if settings.stream_layers:
                raise ValueError(
                    "a PeftModel cannot be streamed as passed: its base weights are already loaded. "
                    "Save the adapter (model.save_pretrained(dir)), then pass the base model id as "
                    "`model` and `peft_config=PeftConfig.from_pretrained(dir)`, or load a deg_hf "
                    "checkpoint with deg_hf.load(). Pass stream_layers=False to train it resident."
                )
            return model
        if isinstance(model, PreTrainedModel):
            _refuse_dispatched_or_quantized(model)
            if not settings.stream_layers:
                return model
            source = getattr(model, "name_or_path", None)
            if not source:
                raise ValueError(
                    "a loaded model without name_or_path cannot be rebuilt streamed: pass its Hub id or "
                    "the directory it was saved to."
                )
            init_kwargs.setdefault("attn_implementation", getattr(model.config, "_attn_implementation", None))
            model = source
        if not isinstance(model, str):
            raise TypeError(f"model must be a Hub id, a path or a PreTrainedModel, got {type(model).__name__}")
        if not settings.stream_layers:
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(model, **_resident_kwargs(init_kwargs))
        from deg_hf.streaming.build import build_streamed_model

        dtype = _dtype_of(args, init_kwargs)
        streamed, runtime = build_streamed_model(
            model,
            device=args.device,
            dtype=dtype,
            stream_buffers=settings.stream_buffers,
            cache_dir=settings.stream_cache_dir,
            attn_implementation=init_kwargs.get("attn_implementation"),
            revision=init_kwargs.get("revision"),
            progress=not getattr(args, "disable_tqdm", False),
        )
        self.stream_runtime = runtime
        return streamed

    def _deg_peft_config(self, peft_config):
        from peft import LoraConfig

        if peft_config is None:
            peft_config = LoraConfig(task_type="CAUSAL_LM", **DEFAULT_LORA)
            self.deg_default_lora = True
            note = (
                "no peft_config given: training the default LoRA adapter "
                f"(r={DEFAULT_LORA['r']}, alpha={DEFAULT_LORA['lora_alpha']}, all linear projections)"
            )
            self.deg_notes.append(note)
            warnings.warn(note, stacklevel=4)
        return peft_config

    # ------------------------------------------------------------------ lifetime
    def release_stream(self) -> None:
        """Free the streaming runtime (host store and device buffers). Idempotent; a no-op when the
        trainer does not stream."""
        runtime = getattr(self, "stream_runtime", None)
        if runtime is not None:
            runtime.close()

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        except BaseException:
            self.release_stream()
            raise


def _is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _refuse_dispatched_or_quantized(model) -> None:
    device_map = getattr(model, "hf_device_map", None)
    if device_map:
        raise ValueError(
            "the model was loaded with a device_map (dispatched across devices by accelerate); deg_hf "
            "places it itself. Pass the model id or path instead of the loaded model."
        )
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        raise ValueError(
            "a quantized model cannot be streamed or re-placed by deg_hf as loaded. Pass the unquantized "
            "base model id or path (layer streaming keeps the full-precision weights in host memory)."
        )


def _refuse_base_reading_peft(peft_config) -> None:
    if peft_config is None:
        return
    kind = str(getattr(peft_config, "peft_type", "")).split(".")[-1].upper()
    if kind and kind != "LORA":
        raise ValueError(
            f"{kind} adapters read the base weights when they are created or in every forward; under "
            "layer streaming those weights are not in device memory. Use LoRA, or stream_layers=False."
        )
    if getattr(peft_config, "use_dora", False):
        raise ValueError(
            "DoRA (use_dora=True) needs each base weight's norm when the adapter is created and in "
            "every forward; under layer streaming those weights are not in device memory. Use plain "
            "LoRA, or stream_layers=False."
        )
    init = str(getattr(peft_config, "init_lora_weights", True)).lower()
    if any(init.startswith(name) for name in _BASE_READING_INITS):
        raise ValueError(
            f"init_lora_weights={peft_config.init_lora_weights!r} initialises the adapter from the base "
            "weights, which are not in memory under layer streaming. Use init_lora_weights=True or "
            "'gaussian', or stream_layers=False."
        )


def _dtype_of(args, init_kwargs):
    import torch

    dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype"))
    if isinstance(dtype, str) and dtype != "auto":
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    return None  # the checkpoint's own dtype, as from_pretrained(dtype="auto") would load it


def _resident_kwargs(init_kwargs):
    return {k: v for k, v in init_kwargs.items() if v is not None}
