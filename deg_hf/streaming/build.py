"""Build a streamed causal LM from a checkpoint without materialising its decoder weights.

The skeleton is created with accelerate's ``init_empty_weights`` (parameters on ``meta``; buffers
such as rotary frequencies computed for real). Everything outside the decoder layers (embeddings,
final norm, LM head) is loaded resident on the device; the decoder layers' weights go into the one
:class:`~deg_hf.streaming.store.WeightStore` and the layers are attached to a
:class:`~deg_hf.streaming.runtime.StreamRuntime`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deg_hf.config import check_setting
from deg_hf.streaming.checks import check_model_files
from deg_hf.streaming.host import host_budget
from deg_hf.streaming.layer import attach, store_name
from deg_hf.streaming.quant import QuantSpec, bnb_config_dict, method_of
from deg_hf.streaming.runtime import StreamRuntime
from deg_hf.streaming.shared import node_ranks
from deg_hf.streaming.sources import ModuleSource
from deg_hf.streaming.store import StreamingError, WeightStore, resolve_checkpoint, safetensors_files


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def checkpoint_dtype(config) -> torch.dtype | None:
    """The floating dtype a checkpoint declares (``dtype``/``torch_dtype`` in config.json)."""
    dtype = getattr(_text_config(config), "dtype", None) or getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder's layer list, found as accelerate finds no-split modules: the longest
    ``ModuleList`` whose entries are all of the model's ``_no_split_modules`` classes (falling back
    to a ``ModuleList`` as long as the config's layer count)."""
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    chosen = [(n, m) for n, m in lists if no_split and all(type(x).__name__ in no_split for x in m)]
    if not chosen:
        n_layers = _text_config(model.config).__dict__.get("num_hidden_layers")
        chosen = [(n, m) for n, m in lists if n_layers and len(m) == n_layers]
    if not chosen:
        raise StreamingError(
            f"cannot find the decoder layer list of {type(model).__name__}: no ModuleList of its "
            f"no-split modules ({sorted(no_split) or 'none declared'}). This architecture cannot be "
            "streamed; pass stream_layers=False to train it resident."
        )
    chosen.sort(key=lambda nm: (-len(nm[1]), len(nm[0])))
    return chosen[0]


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def build_streamed_model(
    name_or_path: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    stream_buffers: int = 2,
    cache_dir: str | None = None,
    attn_implementation: str | None = None,
    revision: str | None = None,
    progress: bool = True,
    quantization: QuantSpec | None = None,
    tier: str = "auto",
    host_mem_gb: float | None = None,
    share_store: bool = True,
):
    """Return ``(model, runtime)``: a causal LM whose decoder layers stream from host memory.

    With ``quantization`` the decoder layers' Linear weights are stored 4-bit (as transformers'
    bitsandbytes integration would quantize them); a checkpoint saved 4-bit by transformers streams
    4-bit as it is, whatever ``quantization`` says. ``tier`` and ``host_mem_gb`` place the layer blocks
    in host RAM or on disk (:class:`~deg_hf.streaming.store.WeightStore`). With ``share_store`` and
    several processes per node (torchrun, ``accelerate launch``) the node's ranks share one store in
    shared memory (:mod:`deg_hf.streaming.shared`)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    check_setting("stream_buffers", stream_buffers)
    check_setting("stream_share_store", share_store)
    local = resolve_checkpoint(name_or_path, revision)
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cpu":
        # accelerate names the device of a multi-process CPU run ``cpu:0``; host tensors report plain
        # ``cpu``, so ``Parameter.to("cpu:0")`` would hand back a copy that is no longer a Parameter
        device = torch.device("cpu")
    config = AutoConfig.from_pretrained(local)
    check_model_files(local, config, source=name_or_path)
    dtype = dtype or checkpoint_dtype(config) or default_dtype(device)
    saved_quant = check_prequantized(name_or_path, config)
    if saved_quant:
        del config.quantization_config  # the skeleton is an ordinary model; the store holds the 4 bits
    kwargs = {"dtype": dtype}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.name_or_path = name_or_path
    prefix, layers = find_decoder_layers(model)
    _load_resident(model, local, prefix, device, dtype)
    layer_keys = [
        {store_name(n): f"{prefix}.{i}.{n}" for n, _ in layer.named_parameters()} for i, layer in enumerate(layers)
    ]
    quantize = quantized_weight_names(model, prefix, layers, quantization) if quantization is not None else None
    store = WeightStore(
        local, layer_keys, dtype, quant=quantization, quantize=quantize, cache_dir=cache_dir, progress=progress,
        quantize_device=device if device.type == "cuda" else None, tier=tier, host_mem_gb=host_mem_gb,
        share=node_ranks() if share_store else None,
    )
    if saved_quant:
        model._deg_saved_quantization = saved_quant
    runtime = StreamRuntime(store, device, stream_buffers)
    for i, layer in enumerate(layers):
        attach(layer, i, runtime)
    model.to(device)  # buffers and resident weights; streamed layers keep their meta parameters
    model._deg_stream_runtime = runtime
    model._deg_layers_prefix = prefix
    return model, runtime


def stream_loaded_model(
    model: nn.Module,
    *,
    device: torch.device | str | None = None,
    stream_buffers: int = 2,
    progress: bool = True,
    quantization: QuantSpec | None = None,
):
    """Stream a model that is already in memory, as it is: return ``(model, runtime)``.

    ``model`` is a causal LM or a ``PeftModel`` over one, changed in place: each decoder layer's base
    weights are moved into the one :class:`WeightStore` (and freed from the module as they go), the
    layers are attached to the runtime, and everything else (embeddings, final norm, LM head, any
    adapter) stays a resident tensor, moved to ``device``. The store keeps the object's dtype and its
    in-memory values, and nothing is read from disk; its blocks live in RAM (where the object's
    tensors were). A dispatched (``device_map``) or quantized object is refused: its weights are
    spread over devices or packed by another library."""
    if stream_buffers < 1:
        raise ValueError(f"stream_buffers must be >= 1 (one layer on the device at a time), got {stream_buffers}")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base, "hf_device_map", None):
        raise StreamingError(
            "the model was loaded with a device_map, so its weights are spread over devices by accelerate's "
            "hooks and cannot be moved into the layer store. Load it without device_map (or pass its id)."
        )
    if getattr(base, "is_quantized", False) or getattr(base.config, "quantization_config", None):
        raise StreamingError(
            "the model was loaded quantized, so its weights are packed by the quantization library and cannot "
            "be moved into the layer store as they are. Pass the unquantized model (or its id; "
            "stream_quantization stores it 4-bit), or set stream_layers=False."
        )
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cpu":
        device = torch.device("cpu")  # see build_streamed_model
    prefix, layers = find_decoder_layers(base)
    source = ModuleSource((f"{prefix}.{i}", layer) for i, layer in enumerate(layers))
    floating = [source.meta(k)[1] for k in source.keys() if source.meta(k)[1].is_floating_point]
    dtype = floating[0] if floating else next(p.dtype for p in base.parameters() if p.is_floating_point())
    width = len(prefix) + 1
    layer_keys = [{} for _ in layers]
    for key in source.keys():
        index, _, local = key[width:].partition(".")
        layer_keys[int(index)][store_name(local)] = key
    quantize = None
    if quantization is not None:
        quantize = [{store_name(n) for n in names}
                    for names in quantized_weight_names(base, prefix, layers, quantization)]
    # the blocks take the place of the tensors the fill frees: the object's own bytes count as free
    # host memory, so a model that was loaded fits in RAM again (never the disk tier, which is keyed
    # by files on disk)
    moved = sum(math.prod(shape) * dtype_.itemsize + 64 for shape, dtype_ in map(source.meta, source.keys()))
    store = WeightStore(
        source, layer_keys, dtype, quant=quantization, quantize=quantize, progress=progress,
        quantize_device=device if device.type == "cuda" else None,
        tier="ram", host_mem_gb=(host_budget(None) + moved) / 2**30,
    )
    runtime = StreamRuntime(store, device, stream_buffers)
    for i, layer in enumerate(layers):
        attach(layer, i, runtime)
    if base is model:  # (a PeftModel already says what trains)
        for name, p in base.named_parameters():
            if not name.startswith(prefix + "."):
                p.requires_grad_(False)  # the resident base parts stay frozen, as when built from files
    model.to(device)
    base._deg_stream_runtime = runtime
    base._deg_layers_prefix = prefix
    return model, runtime


def check_prequantized(name_or_path: str, config) -> dict | None:
    """The ``quantization_config`` of a checkpoint saved 4-bit by bitsandbytes (None if unquantized);
    any other method is refused, saying what to pass instead."""
    saved = getattr(config, "quantization_config", None)
    if not saved:
        return None
    saved = bnb_config_dict(saved)
    method = method_of(saved)
    if method == "bitsandbytes-4bit":
        return saved
    reason = {
        "bitsandbytes-8bit": "LLM.int8 weights need bitsandbytes' own 8-bit matmul with outlier handling",
        "gptq": "GPTQ weights need GPTQ's own kernels",
        "awq": "AWQ weights need AWQ's own kernels",
    }.get(method, f"{method} weights need that method's own kernels")
    raise StreamingError(
        f"{name_or_path!r} was saved quantized with {method}: {reason}, which layer streaming does not "
        "run. Stream the unquantized base model instead (add stream_quantization='nf4' to store it "
        "4-bit), or a checkpoint saved 4-bit by bitsandbytes (load_in_4bit), or pass stream_layers=False."
    )


def quantized_weight_names(model: nn.Module, prefix: str, layers: nn.ModuleList, spec: QuantSpec) -> list[set[str]]:
    """Per decoder layer, the local weight names transformers' bitsandbytes integration would make 4-bit:
    the weights of exact ``nn.Linear`` modules outside its skip list (``llm_int8_skip_modules``,
    else its defaults, plus the model's ``_keep_in_fp32_modules``)."""
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = HfQuantizer.get_modules_to_not_convert(
        model, list(spec.skip_modules) if spec.skip_modules is not None else None,
        getattr(model, "_keep_in_fp32_modules", None),
    )
    names = []
    for i, layer in enumerate(layers):
        chosen = set()
        for sub, module in layer.named_modules():
            if type(module) is nn.Linear and sub and should_convert_module(f"{prefix}.{i}.{sub}", skip):
                chosen.add(f"{sub}.weight")
        names.append(chosen)
    return names


def _load_resident(model: nn.Module, directory: str, prefix: str, device, dtype) -> None:
    """Load every parameter and persistent buffer outside the decoder layers onto ``device``."""
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    wanted = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    wanted |= {n for n, _ in model.named_buffers() if n in model.state_dict()}
    wanted = {n for n in wanted if not n.startswith(prefix + ".")}
    found = set()
    for path in safetensors_files(directory):
        with safe_open(path, framework="pt") as fh:
            for key in fh.keys():
                if key in wanted:
                    tensor = fh.get_tensor(key)
                    value_dtype = dtype if tensor.is_floating_point() else None
                    set_module_tensor_to_device(model, key, device, value=tensor, dtype=value_dtype)
                    found.add(key)
    model.tie_weights()
    still_meta = sorted(n for n, p in model.named_parameters() if p.is_meta and not n.startswith(prefix + "."))
    if still_meta:
        raise StreamingError(
            f"the checkpoint in {directory!r} lacks weights outside the decoder layers: {still_meta[:4]}. "
            "Its tensor names do not match the model's; re-save it with a current transformers."
        )
    for _, p in model.named_parameters():
        if not p.is_meta:
            p.requires_grad_(False)


def materialize_adapters(model: nn.Module, device: torch.device | str) -> int:
    """Give PEFT adapter parameters created on ``meta`` (they follow the base layer's device) real
    storage on ``device`` and initialise them with PEFT's own initialiser. Adapters that already
    hold values (a ``PeftModel`` streamed as given) are left as they are. Returns the number of
    parameters materialised."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    count = 0
    peft_config = getattr(model, "peft_config", None)
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for adapter in list(getattr(module, "r", {}).keys()):
            containers = [c for c in (getattr(module, attr, None) for attr in module.adapter_layer_names)
                          if isinstance(c, (nn.ModuleDict, nn.ParameterDict)) and adapter in c]
            metas = 0
            for container in containers:
                piece = container[adapter]
                if isinstance(piece, nn.Module):
                    n_meta = sum(p.is_meta for p in piece.parameters())
                    if n_meta:
                        metas += n_meta
                        piece.to_empty(device=device, recurse=True)
                elif piece.is_meta:
                    metas += 1
                    container[adapter] = nn.Parameter(torch.empty_like(piece, device=device),
                                                      requires_grad=piece.requires_grad)
            if not metas:
                continue
            init = True
            if isinstance(peft_config, dict) and adapter in peft_config:
                init = peft_config[adapter].init_lora_weights
            module.reset_lora_parameters(adapter, init)
            count += metas
    return count
