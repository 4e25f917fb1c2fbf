"""The memory side of every deg_hf trainer: the pre-flight check, the planner, split-retry of each
micro-batch in parts, prefix sharing's setup, and the dataset hooks the planner needs (row ids, the
prompt-grouping sampler). :class:`~deg_hf.trainers.mixin.StreamingSetupMixin` builds on it; the
memory mechanism itself lives in :mod:`deg_hf.memory`."""

from __future__ import annotations


class MemoryPlanningMixin:
    """Trainer hooks for planned parts and out-of-memory recovery (a base of StreamingSetupMixin)."""

    def _deg_model_config(self, model):
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return model.base_model.model.config
        if isinstance(model, str):
            from transformers import AutoConfig

            from deg_hf.streaming.store import resolve_checkpoint

            local = model if not self.deg_stream.stream_layers else resolve_checkpoint(model)
            return AutoConfig.from_pretrained(local)
        return getattr(model, "config", None)

    def _deg_max_length(self, args) -> int | None:
        """The configured truncation length; None when rows are not truncated."""
        for name in ("max_length", "max_seq_length"):
            value = getattr(args, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None

    def _deg_preflight(self, model, args, settings, peft_config, *, longest=None):
        """Estimate the configured micro-batch from config.json alone; refuse what cannot fit. Without
        a max_length the rows' length is the longest tokenised row (``longest``, ``(tokens, row)``):
        the check then runs once the upstream trainer has tokenised the dataset."""
        if not settings.mem_plan or model is None:
            return None
        from deg_hf.memory.preflight import lora_params, make_planner, preflight, target_bytes

        if target_bytes(settings, args.device) is None:
            return None  # unlimited (CPU without mem_target_gb): nothing to refuse
        max_length = self._deg_max_length(args) or (longest[0] if longest else None)
        if max_length is None:
            self._deg_preflight_deferred = peft_config
            return None
        config = self._deg_model_config(model)
        if config is None:
            return None
        from deg_hf.streaming.build import checkpoint_dtype

        dtype = _dtype_of(args, dict(getattr(args, "model_init_kwargs", None) or {})) or checkpoint_dtype(config)
        dtype_bytes = dtype.itemsize if dtype is not None else 4
        planner = make_planner(
            config.to_dict(), settings, device=args.device, streaming=settings.stream_layers,
            trainable_params=(lora_params(config.to_dict(), peft_config)
                              if peft_config is not None or settings.stream_layers or _is_peft_model(model)
                              else _all_params(config.to_dict())),
            dtype_bytes=dtype_bytes,
            rows_per_example=self.deg_rows_per_example, attn_implementation=None,
            fused_lm_head=self.deg_fused_lm_head,
            checkpointing=settings.stream_layers or bool(getattr(args, "gradient_checkpointing", False)),
            quant_bytes=_planned_quant_bytes(settings, args, config),
        )
        return preflight(
            type(self).__name__, planner, rows_per_example=self.deg_rows_per_example,
            kl_rows_per_example=self.deg_kl_rows_per_example, min_examples=self.deg_min_batch,
            batch=int(getattr(args, "per_device_train_batch_size", 1)), max_length=max_length,
            length_source=None if self._deg_max_length(args) else f"the longest tokenised row (dataset row {longest[1]})",
        )

    def _deg_setup_memory(self, settings) -> None:
        from deg_hf.memory.callback import MemoryPlanCallback
        from deg_hf.memory.collator import MemoryPlanningCollator
        from deg_hf.memory.meter import DeviceMemory
        from deg_hf.memory.preflight import make_planner, target_bytes
        from deg_hf.memory.split_retry import SplitRetryEngine

        self.deg_engine = SplitRetryEngine(self)
        self.deg_fault_hook = None
        # on CPU, a target is enforced by the tensor meter; on CUDA the device enforces its own size
        self.deg_memory = DeviceMemory(self.args.device, target_bytes(settings, self.args.device),
                                       resident=self._deg_resident_tensors)
        self._deg_part_weight = 1.0
        self._deg_part_info = None
        self.deg_planner = None
        if settings.mem_plan:
            base = self.model.get_base_model() if _is_peft_model(self.model) else self.model
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            dtype = next((p.dtype for p in base.parameters() if p.is_floating_point()), None)
            self.deg_planner = make_planner(
                base.config.to_dict(), settings, device=self.args.device,
                streaming=self.stream_runtime is not None, trainable_params=trainable,
                dtype_bytes=dtype.itemsize if dtype is not None else 4,
                rows_per_example=self.deg_rows_per_example,
                attn_implementation=getattr(base.config, "_attn_implementation", None),
                fused_lm_head=self.deg_fused_lm_head,
                checkpointing=self.stream_runtime is not None or bool(getattr(self.args, "gradient_checkpointing", False)),
                quant_bytes=self._deg_quant_bytes(base, settings),
            )
        if self.data_collator is not None and not isinstance(self.data_collator, MemoryPlanningCollator):
            self.data_collator = MemoryPlanningCollator(self.data_collator, stacked_pairs=self.deg_stacked_pairs)
        self._deg_plan_callback = MemoryPlanCallback(self)
        self.add_callback(self._deg_plan_callback)

    def _deg_quant_bytes(self, base, settings) -> float | None:
        """Bytes per weight of the 4-bit base this run trains against, as built (None: not 4-bit)."""
        from deg_hf.memory.static import quant_bytes_per_weight

        if self.stream_runtime is not None:
            info = self.stream_runtime.store.quantization()
            return None if info is None else quant_bytes_per_weight(info["blocksize"], info["double_quant"])
        saved = getattr(base.config, "quantization_config", None) if getattr(base, "is_quantized", False) else None
        return _planned_quant_bytes(settings, self.args, base.config, saved=saved)

    def _deg_setup_prefix(self, args) -> None:
        self.deg_prefix = None
        if not self.deg_prefix_capable or not getattr(args, "prefix_sharing", True):
            return
        from deg_hf.prefix.sharing import PrefixSharing
        from deg_hf.streaming.build import find_decoder_layers
        from deg_hf.streaming.store import StreamingError

        def fault(phase):
            if self.deg_fault_hook is not None and self._deg_part_info is not None:
                self.deg_fault_hook(self._deg_part_info, phase)

        resident = []
        if self.stream_runtime is None:
            try:
                resident = list(find_decoder_layers(self.model)[1])
            except StreamingError:  # no layer list found: only used to keep caches under checkpointing
                resident = []
        self.deg_prefix = PrefixSharing(self.model, fault=fault, resident_layers=resident)
        if not self.deg_prefix.available:
            self.deg_prefix.note_fallback(self.deg_prefix.reason)

    def _remove_unused_columns(self, dataset, description=None):
        dataset = super()._remove_unused_columns(dataset, description)
        if description != "Training":
            return dataset
        from deg_hf.memory.collator import with_row_ids

        return with_row_ids(dataset)  # skipped examples are then reported as dataset rows

    def _get_train_sampler(self, train_dataset=None):
        from deg_hf.memory.collator import RowIds

        if isinstance(train_dataset, RowIds):  # samplers read the dataset's own columns
            train_dataset = train_dataset.dataset
        if not (self.deg_prefix_capable and getattr(self.args, "group_by_prompt", False)):
            return super()._get_train_sampler(train_dataset)
        from deg_hf.prefix.sampler import PromptGroupedSampler, prompt_keys

        dataset = self.train_dataset if train_dataset is None else train_dataset
        keys = prompt_keys(dataset) if dataset is not None else None
        if keys is None:
            return super()._get_train_sampler(train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return PromptGroupedSampler(keys, seed=seed)

    def _deg_shared_prompt_lens(self, inputs) -> list[int] | None:
        """Per example, the prompt length its rows share when this micro-batch runs packed
        (prefix sharing on and possible), else None."""
        return None

    def _deg_pairs(self, prompt_lens):
        """Paired rows inside this block share their prompt (when prefix sharing is on)."""
        import contextlib

        if getattr(self, "deg_prefix", None) is None or prompt_lens is None:
            return contextlib.nullcontext()
        return self.deg_prefix.pairs(prompt_lens)

    @property
    def deg_counters(self) -> dict:
        return self.deg_engine.counters.as_dict()

    def set_fault_hook(self, hook) -> None:
        """Install ``hook(part_info, phase)``, called before each part's forward (phase
        ``"forward"``) and after its backward wrote gradients (``"backward"``); in a pair run as
        trunk and forks also before each fork's forward (``"fork_forward"``), after its backward
        (``"fork_backward"``) and before the trunk's backward (``"trunk_backward"``). It may raise
        (e.g. ``torch.OutOfMemoryError``) to exercise split-and-retry; ``None`` removes it."""
        self.deg_fault_hook = hook

    def measure_device_memory(self):
        """Measure every part's device memory on CPU with the tensor meter even without a target
        (it is on whenever ``mem_target_gb`` is set; CUDA always measures), so measured peaks
        calibrate the planner and reach the logs. Returns the trainer's
        :class:`~deg_hf.memory.meter.DeviceMemory`."""
        from deg_hf.memory.meter import DeviceMemory

        memory = self.deg_memory
        if not memory.measures:
            self.deg_memory = DeviceMemory(memory.device, memory.target_bytes, resident=memory.resident, measure=True)
        return self.deg_memory

    def _deg_resident_tensors(self):
        """The tensors this trainer keeps on the device between parts: parameters and buffers (not
        the streamed ``meta`` ones), gradients, optimizer state and the streaming buffers."""
        import torch

        for p in self.model.parameters():
            yield p
            yield p.grad
        yield from self.model.buffers()
        optimizer = getattr(self, "optimizer", None)
        for state in getattr(optimizer, "state", {}).values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))
        if self.stream_runtime is not None:
            yield from self.stream_runtime.buffers

    def get_batch_samples(self, *args, **kwargs):
        batch_samples, num_items = super().get_batch_samples(*args, **kwargs)
        self.deg_engine.begin_window(batch_samples)
        return batch_samples, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        def run_part(part, num_items, weight, info):
            return self._deg_run_part(model, part, num_items, weight, info)

        return self.deg_engine.training_step(model, inputs, num_items_in_batch, run_part)

    def _deg_run_part(self, model, part, num_items, weight, info):
        # the engine runs this inside the trainer's device memory (deg_hf.memory.meter), measured
        self._deg_part_weight, self._deg_part_info = weight, info
        try:
            loss = super().training_step(model, part, num_items)
            if self.deg_fault_hook is not None:
                self.deg_fault_hook(info, "backward")
        finally:
            self._deg_part_weight, self._deg_part_info = 1.0, None
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = self._deg_strip_features(inputs)
        if self._deg_part_info is not None and self.deg_fault_hook is not None:
            self.deg_fault_hook(self._deg_part_info, "forward")
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        weight = self._deg_part_weight
        if weight == 1.0:
            return out
        if return_outputs:
            return (out[0] * weight, *out[1:])
        return out * weight

    def _prepare_inputs(self, inputs):
        return super()._prepare_inputs(self._deg_strip_features(inputs))

    def _deg_strip_features(self, inputs):
        from deg_hf.memory.collator import strip

        return strip(inputs) if isinstance(inputs, dict) else inputs

    def _deg_uids(self, inputs, n: int) -> list:
        uids = inputs.get("deg_uid") if isinstance(inputs, dict) else None
        if isinstance(uids, list) and len(uids) == n:
            return [u if u is not None else i for i, u in enumerate(uids)]
        return list(range(n))

    def _deg_before_parts(self, model, inputs, parts) -> None:
        """Called before a micro-batch runs in several parts (``parts``: example positions in
        ``inputs``, each a part that fits); KTO computes its batch-level KL here, part by part."""

    def _deg_after_parts(self) -> None:
        """Called after the parts of a micro-batch ran (or failed)."""

    def _deg_part_inputs(self, part: dict, whole: dict) -> dict:
        """A part's inputs; losses with batch-level terms put the whole micro-batch's values back."""
        return part

    def _deg_measured_peak(self):
        """The most device memory a part held since the last call (None when not measured)."""
        return self.deg_engine.take_peak()

    def log(self, logs, *args, **kwargs):
        engine = getattr(self, "deg_engine", None)
        if engine is not None and "loss" in logs:
            logs.update(self._deg_plan_callback.counters_since_last_log())
        return super().log(logs, *args, **kwargs)


def _is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _all_params(model_config) -> int:
    """Every weight of the model (a full fine-tune trains them all), from its config."""
    from deg_hf.memory.dims import model_dims
    from deg_hf.memory.static import layer_param_count

    d = model_dims(model_config)
    return d.layers * layer_param_count(model_config) + d.vocab * d.hidden * (1 if d.tie_word_embeddings else 2) + d.hidden


def _dtype_of(args, init_kwargs):
    import torch

    dtype = init_kwargs.get("dtype", init_kwargs.get("torch_dtype"))
    if isinstance(dtype, str) and dtype != "auto":
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    return None  # the checkpoint's own dtype, as from_pretrained(dtype="auto") would load it


def _planned_quant_bytes(settings, args, model_config, saved=None) -> float | None:
    """Bytes per weight of the 4-bit base a run will build, from its settings, model_init_kwargs and
    the checkpoint's own config (pre-quantized); None for an unquantized base, or when the request is
    invalid (the build refuses it with the reason)."""
    from deg_hf.memory.static import quant_bytes_per_weight
    from deg_hf.streaming import quant

    requested = dict(getattr(args, "model_init_kwargs", None) or {}).get("quantization_config")
    saved = saved if saved is not None else getattr(model_config, "quantization_config", None)
    try:
        spec = quant.resolve_spec(settings, requested)
        if spec is None and saved is not None:
            spec = quant.resolve_spec(None, saved)
    except ValueError:
        return None
    return None if spec is None else quant_bytes_per_weight(spec.blocksize, spec.double)
