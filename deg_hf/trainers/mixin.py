"""StreamingSetupMixin: the one setup every deg_hf trainer shares.

A deg_hf trainer is ``class StreamedXTrainer(StreamingSetupMixin, XTrainer)``. Before the upstream
``__init__`` runs, the mixin builds the model streamed (from a Hub id or path, or from a loaded
model's or ``PeftModel``'s own tensors), settles an explicit ``ref_model`` (released when it is the
base), chooses the adapter (the default LoRA when none is given: a streamed base stays frozen), and
refuses, with a reason and a remedy, what cannot work. The upstream trainer then sees an ordinary
PEFT model. With ``stream_layers=False`` the model, ``peft_config`` and ``ref_model`` go to the
upstream trainer as given: resident is upstream (a full fine-tune without ``peft_config``).

This module stays import-light (no top-level torch, transformers, PEFT or TRL): configuration code
and ``deg-hf --help`` import deg_hf without paying for them.
"""

from __future__ import annotations

import inspect
import logging

from deg_hf.config import ROLLOUT_REFUSAL, check_model_init_kwargs, stream_settings
from deg_hf.notices import quiet_upstream_notices
from deg_hf.trainers.planning import MemoryPlanningMixin, _dtype_of, _is_peft_model

logger = logging.getLogger(__name__)

#: TRL trainers whose training loop generates rollouts with the model being trained
ROLLOUT_TRAINERS = ("GRPOTrainer", "RLOOTrainer", "PPOTrainer", "OnlineDPOTrainer", "NashMDTrainer",
                    "XPOTrainer", "GKDTrainer")

#: PEFT options that read the base weights when the adapter is created (or need them in every
#: forward, like DoRA's weight norm): under streaming those weights are not in memory
_BASE_READING_INITS = ("pissa", "olora", "loftq", "eva", "corda", "orthogonal")

DEFAULT_LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}


class StreamingSetupMixin(MemoryPlanningMixin):
    """Shared setup of every deg_hf trainer: streamed model, adapter, refusals, runtime lifetime.

    Class attributes a trainer declares:

    * ``deg_task`` - the task name written to deg.json (``sft``, ``dpo``, ``kto``, ``orpo``, ``simpo``).
    * ``deg_rows_per_example`` - sequences one example puts through the model in a step (2 for
      losses that concatenate chosen and rejected); the memory estimate multiplies by it.
    * ``deg_min_batch`` - the smallest per-device batch the loss is defined for.
    """

    deg_task: str = "sft"
    deg_rows_per_example: int = 1
    deg_kl_rows_per_example: int = 0
    deg_min_batch: int = 1
    deg_config_class: str = "StreamedTrainingArguments"
    #: TRL's DPO collates [chosen rows; rejected rows]: example i owns rows i and B + i
    deg_stacked_pairs: bool = False
    #: what the loss averages over within a micro-batch when it is not normalised by
    #: num_items_in_batch: "tokens" (causal-LM loss) or "examples" (preference losses)
    deg_loss_unit: str = "tokens"
    #: paired losses whose chosen and rejected rows share a prompt (deg_hf.prefix)
    deg_prefix_capable: bool = False
    #: the upstream trainer scores tokens with TRL's fused, tiled LM head (``add_fused_lm_head``)
    deg_fused_lm_head: bool = False
    #: the upstream constructor loads a Hub id or a path itself (TRL's trainers; not transformers.Trainer)
    deg_upstream_loads_ids: bool = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for base in cls.__mro__:
            if base.__name__ in ROLLOUT_TRAINERS:
                raise TypeError(ROLLOUT_REFUSAL.format(name=base.__name__))

    def __init__(self, *args, **kwargs):
        quiet_upstream_notices()
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
        ref_model = params.get("ref_model")
        if settings.stream_layers and ref_model is not None and ref_model is model:
            # the upstream trainer refuses the same object as model and ref_model with its own message
            upstream(**params, **({"peft_config": peft_config} if peft_config is not None else {}))
            raise ValueError("model and ref_model are the same object: omit ref_model.")
        if settings.stream_layers:
            check_model_init_kwargs(getattr(config, "model_init_kwargs", None), settings,
                                    quantization_config=params.get("quantization_config"),
                                    trust_remote_code=getattr(config, "trust_remote_code", False))
            _refuse_base_reading_peft(peft_config)
            _refuse_sharded_engines(config)
        elif model is not None:  # streamed builds check the model's files themselves
            from deg_hf.streaming.checks import check_causal_lm

            model_config = self._deg_model_config(model)
            if model_config is not None:
                check_causal_lm(model_config, model if isinstance(model, str) else type(model).__name__)
        self.deg_preflight = self._deg_preflight(model, config, settings, peft_config)
        model = self._deg_build_model(model, config, settings)
        try:
            if self.stream_runtime is not None and ref_model is not None:
                self._deg_release_ref_model(ref_model, model)
                params["ref_model"] = None
            if peft_config is None and settings.stream_layers and not _is_peft_model(model):
                peft_config = self._deg_default_peft_config()
            if peft_config is not None:
                if "peft_config" in inspect.signature(upstream).parameters:
                    # TRL applies it: its preference trainers then take the reference from the
                    # same model with the adapter disabled
                    params["peft_config"] = peft_config
                elif _is_peft_model(model):
                    raise ValueError(
                        "the model is already a PeftModel and a peft_config was passed too: pass one of them."
                    )
                else:
                    from peft import get_peft_model

                    model = get_peft_model(model, peft_config)
            params["model"] = model
            adapters_before = set(model.peft_config) if _is_peft_model(model) else set()
            upstream(**params)
            if self.stream_runtime is not None:
                from deg_hf.streaming.build import materialize_adapters

                # adapters on streamed layers were created on `meta` (their base layer's device)
                materialize_adapters(self.model, self.stream_runtime.device)
                self._deg_fill_trl_ref_adapter(adapters_before, released_ref=ref_model is not None)
            self._deg_setup_memory(settings)
            if self.__dict__.get("_deg_preflight_deferred", False) is not False:
                from deg_hf.memory.preflight import longest_row

                longest = longest_row(self.train_dataset)
                if longest is not None:
                    self.deg_preflight = self._deg_preflight(
                        self.model, self.args, settings, self._deg_preflight_deferred, longest=longest)
            self._deg_setup_prefix(config)
            from deg_hf.trainers.records import DegCheckpointCallback

            self.add_callback(DegCheckpointCallback(self))
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
        from deg_hf.streaming import quant

        if not settings.stream_layers:
            spec = None
            if isinstance(model, str) and "quantization_config" not in init_kwargs:
                spec = quant.resolve_spec(settings, None)
            if isinstance(model, str) and (spec is not None or not self.deg_upstream_loads_ids):
                from transformers import AutoModelForCausalLM

                if spec is not None:  # stream_quantization asks for QLoRA resident: transformers' own 4-bit loading
                    init_kwargs["quantization_config"] = quant.resident_config(spec, _dtype_of(args, init_kwargs))
                return AutoModelForCausalLM.from_pretrained(model, **_resident_kwargs(init_kwargs))
            return model  # resident is upstream: it loads an id itself and takes a loaded model as given
        if isinstance(model, (PeftModel, PreTrainedModel)):
            # streamed as given: its own tensors move into the store (its dtype, its in-memory values)
            from deg_hf.streaming.build import stream_loaded_model

            if isinstance(model, PeftModel):
                for adapter_config in model.peft_config.values():
                    _refuse_base_reading_peft(adapter_config, created=True)
            if getattr(settings, "stream_tier", "auto") == "disk":
                raise ValueError(
                    "stream_tier='disk' streams layers from a cache of checkpoint files, but this model is "
                    "already loaded: its tensors move into a store in RAM, where they already are. Pass its "
                    "Hub id or path to stream from disk, or leave stream_tier at 'auto'."
                )
            model, self.stream_runtime = stream_loaded_model(
                model, device=args.device, stream_buffers=settings.stream_buffers,
                progress=not getattr(args, "disable_tqdm", False), quantization=quant.resolve_spec(settings, None),
            )
            self.deg_notes.append(
                f"the base streamed from the loaded model's own tensors ({self.stream_runtime.store.dtype}, its "
                "in-memory values), not from the files at its name_or_path, which may differ"
            )
            return model
        if not isinstance(model, str):
            raise TypeError(f"model must be a Hub id, a path or a PreTrainedModel, got {type(model).__name__}")
        from deg_hf.streaming.build import build_streamed_model

        quantization_config = init_kwargs.pop("quantization_config", None)
        spec = quant.resolve_spec(settings, quantization_config)
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
            quantization=spec,
            tier=settings.stream_tier,
            host_mem_gb=settings.host_mem_gb,
            share_store=settings.stream_share_store,
        )
        self.stream_runtime = runtime
        compute = quant.compute_dtype_of(quantization_config)
        if runtime.store.quantized and compute is not None and compute != runtime.store.dtype:
            note = (
                f"the 4-bit layers are dequantized to the training dtype {runtime.store.dtype} and compute in it; "
                f"bnb_4bit_compute_dtype={compute} applies to resident bitsandbytes layers only (pass "
                f"model_init_kwargs={{'dtype': {str(compute).replace('torch.', '')!r}}} to train in it)"
            )
            self.deg_notes.append(note)
            logger.warning(note)
        return streamed

    def _deg_fill_trl_ref_adapter(self, adapters_before: set, released_ref: bool) -> None:
        """Given a PeftModel and no ref_model, TRL's DPO and KTO add a frozen ``"ref"`` adapter and
        copy the ``"default"`` adapter's values into it: the reference is the adapter as passed.
        Under streaming PEFT creates it on ``meta`` (the base layer's device), so that copy wrote
        nothing and materialising gave it fresh values: copy again, as TRL meant. When the script
        did pass a ref_model (released here, being the base), the reference stays what it passed:
        the base, with the adapters disabled, and the added adapter goes."""
        import torch

        adapters = getattr(self.model, "peft_config", None) or {}
        if "ref" not in adapters or "ref" in adapters_before or "default" not in adapters:
            return
        if released_ref:
            self.model.delete_adapter("ref")
            return
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if ".ref." in name:
                    param.copy_(self.model.get_parameter(name.replace(".ref.", ".default.")))

    def _deg_release_ref_model(self, ref_model, model) -> None:
        """Streamed: accept an explicit ref_model that is the policy's base and free it (the reference
        stays the streamed base with the adapter disabled); refuse one that differs."""
        from deg_hf.trainers.reference import release_if_base

        note = release_if_base(ref_model, model)
        self.deg_notes.append(note)
        logger.warning(note)

    def _deg_default_peft_config(self):
        """The LoRA adapter a streamed run trains when no peft_config is given (streaming keeps the
        base frozen in host memory), announced once in the log and recorded in deg.json."""
        from peft import LoraConfig

        self.deg_default_lora = True
        note = (
            "no peft_config given: training deg_hf's default LoRA adapter "
            f"(r={DEFAULT_LORA['r']}, alpha={DEFAULT_LORA['lora_alpha']}, all linear projections), because a "
            "streamed base stays frozen. Pass peft_config to choose the adapter, or stream_layers=False "
            "to fine-tune every weight as the upstream trainer does."
        )
        self.deg_notes.append(note)
        logger.warning(note)
        return LoraConfig(task_type="CAUSAL_LM", **DEFAULT_LORA)

    # ------------------------------------------------------------------ lifetime
    def release_stream(self) -> None:
        """Free the streaming runtime (host store and device buffers). Idempotent; a no-op when the
        trainer does not stream."""
        runtime = getattr(self, "stream_runtime", None)
        if runtime is not None:
            runtime.close()

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        from deg_hf.trainers.records import resolve_resume_checkpoint, restore_from_checkpoint

        try:
            # True: the newest *complete* checkpoint-N (or none: from the beginning); a path must be complete
            resume_from_checkpoint = resolve_resume_checkpoint(self, resume_from_checkpoint)
            # a resumed run plans like the run that saved it: calibration and counters from deg.json
            restore_from_checkpoint(self, resume_from_checkpoint)
            if resume_from_checkpoint is not None and self._deg_run_was_complete(resume_from_checkpoint):
                return self._deg_finished_run(resume_from_checkpoint)
            _ddp_sees_only_trainable(self.model)
            return super().train(resume_from_checkpoint, *args, **kwargs)
        except BaseException:
            self.release_stream()
            raise

    def _deg_run_was_complete(self, checkpoint) -> bool:
        import json
        import os

        with open(os.path.join(checkpoint, "trainer_state.json"), encoding="utf-8") as fh:
            step = int(json.load(fh).get("global_step") or 0)
        return self.args.max_steps > 0 and step >= self.args.max_steps

    def _deg_finished_run(self, checkpoint):
        """Resuming from the last checkpoint of a ``max_steps`` run: the Trainer would take one step
        more than ``max_steps`` (it checks the bound only after a step); load the weights and state
        instead, so the model is exactly the finished run's."""
        import os

        from transformers.trainer_callback import TrainerState
        from transformers.trainer_utils import TrainOutput

        logger.warning("%s is the last step of this run (max_steps=%d): its weights are loaded, nothing is left "
                       "to train", checkpoint, self.args.max_steps)
        self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))
        losses = [row["loss"] for row in self.state.log_history if "loss" in row]
        return TrainOutput(self.state.global_step, sum(losses) / len(losses) if losses else 0.0, {})

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs):
        """Save, then upload the adapter, tokenizer files, deg.json and the model card with
        :func:`deg_hf.hub.push_checkpoint` (never optimizer state, never ``training_args.bin``)."""
        import os

        from deg_hf.hub import push_checkpoint

        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        return push_checkpoint(
            self.args.output_dir, repo_id, private=bool(self.args.hub_private_repo),
            revision=revision or self.args.hub_revision, token=token or self.args.hub_token,
            commit_message=commit_message,
        )

    # ------------------------------------------------------------------ atomic checkpoints
    def _get_output_dir(self, trial):
        # while a checkpoint is written, the Trainer's run directory is the staging directory
        staged = getattr(self, "_deg_staged", None)
        return staged.root if staged is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """The Trainer's own save, written under ``.deg-staging/checkpoint-N`` and renamed to
        ``checkpoint-N`` once complete (:mod:`deg_hf.checkpoint.atomic`); the Trainer's rotation
        then runs on the run directory, which holds complete checkpoints only."""
        import os

        from transformers.trainer_utils import rotate_checkpoints

        from deg_hf.checkpoint.atomic import StagedCheckpoint

        run_dir = super()._get_output_dir(trial)
        staged = StagedCheckpoint(run_dir, self.state.global_step, main=self.args.should_save)
        staged.begin()
        self._deg_barrier()
        self._deg_staged = staged
        try:
            super()._save_checkpoint(model, trial)
            best = staged.final_path(self.state.best_model_checkpoint)
            if best != self.state.best_model_checkpoint:  # the best checkpoint is this one: its final name
                self.state.best_model_checkpoint = best
                if self.args.should_save:
                    self.state.save_to_json(os.path.join(staged.staged, "trainer_state.json"))
            self._deg_barrier()  # every process's files (its RNG state) are in
            staged.commit()
        except BaseException:
            staged.abort()
            raise
        finally:
            self._deg_staged = None
        if staged.push_after_commit:
            super()._push_from_checkpoint(staged.final)
        if self.args.should_save:
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _push_from_checkpoint(self, checkpoint_folder):
        staged = getattr(self, "_deg_staged", None)
        if staged is not None and staged.final_path(checkpoint_folder) != checkpoint_folder:
            staged.push_after_commit = True  # uploaded from its final name once complete
            return None
        return super()._push_from_checkpoint(checkpoint_folder)

    def _deg_barrier(self) -> None:
        if self.args.world_size > 1:
            self.accelerator.wait_for_everyone()

    def save_model(self, output_dir=None, _internal_call=False):
        super().save_model(output_dir, _internal_call)
        from deg_hf.trainers.records import write_checkpoint_files

        # a save inside training logs a failure to write deg.json instead of stopping the run
        write_checkpoint_files(self, output_dir or self.args.output_dir, strict=not _internal_call)


def _refuse_sharded_engines(args) -> None:
    import os

    fsdp = bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
    deepspeed = bool(getattr(args, "deepspeed", None)) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in (
        "1", "true")
    if fsdp or deepspeed:
        engine = "FSDP" if fsdp else "DeepSpeed"
        raise ValueError(
            f"stream_layers=True cannot run under {engine}: streaming serves one device per process from "
            f"host memory, while {engine} shards the resident weights across devices. Pass "
            "--stream_layers false to train resident and sharded by that engine (the planner, split-retry, "
            "the adapter-off reference and deg.json still apply), or launch without it to stream."
        )


def _ddp_sees_only_trainable(model) -> None:
    """Have DistributedDataParallel (multi-process runs) ignore every frozen parameter and buffer.

    Frozen base weights (on ``meta`` for streamed layers) and buffers are the same on every rank by
    construction: DDP then broadcasts and all-reduces the trainable adapter only. This is torch's
    ``_ddp_params_and_buffers_to_ignore`` attribute, read when accelerate wraps the model."""
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def _refuse_base_reading_peft(peft_config, *, created: bool = False) -> None:
    """Refuse adapters that need the base weights in device memory; ``created``: the adapter already
    holds its values (a PeftModel), so how it was initialised no longer matters."""
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
    if not created and any(init.startswith(name) for name in _BASE_READING_INITS):
        raise ValueError(
            f"init_lora_weights={peft_config.init_lora_weights!r} initialises the adapter from the base "
            "weights, which are not in memory under layer streaming. Use init_lora_weights=True or "
            "'gaussian', or stream_layers=False."
        )


def _resident_kwargs(init_kwargs):
    return {k: v for k, v in init_kwargs.items() if v is not None}
