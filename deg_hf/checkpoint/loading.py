"""``deg_hf.load``: a deg_hf checkpoint (local or on the Hub) back as a model and its tokenizer."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deg_hf.checkpoint.build import config_sha256
from deg_hf.checkpoint.io import (
    ADAPTER_WEIGHT_FILES,
    DEG_JSON,
    FULL_MODEL_WEIGHT_FILES,
    TOKENIZER_FILES,
    DegJsonError,
    check_checkpoint,
    read_deg_json,
)
from deg_hf.checkpoint.redact import _WINDOWS_ABS_RE, LOCAL_PREFIX

_DOWNLOAD_PATTERNS = [*ADAPTER_WEIGHT_FILES, "adapter_config.json", DEG_JSON, "README.md", *TOKENIZER_FILES,
                      *FULL_MODEL_WEIGHT_FILES, "model-*.safetensors", "config.json", "generation_config.json"]


def looks_like_repo_id(text: str) -> bool:
    """True when ``text`` is not an existing local path and is a valid Hub repo id."""
    if not text or os.path.exists(os.path.expanduser(text)) or text.startswith((".", "/", "~", "\\")):
        return False
    if _WINDOWS_ABS_RE.match(text):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _resolve_checkpoint(path_or_repo_id: str | os.PathLike, revision: str | None, token: str | None) -> Path:
    local = Path(os.path.expanduser(os.fspath(path_or_repo_id)))
    if local.is_dir():
        return local
    text = os.fspath(path_or_repo_id)
    if not looks_like_repo_id(text):
        raise DegJsonError(f"{text} is not a checkpoint directory (nor a Hub repo id)")
    import huggingface_hub

    return Path(
        huggingface_hub.snapshot_download(
            repo_id=text, revision=revision, token=token, allow_patterns=_DOWNLOAD_PATTERNS
        )
    )


def _is_redacted_local(name: str) -> bool:
    return name.startswith(LOCAL_PREFIX) or name == LOCAL_PREFIX.rstrip("/")


def _resolve_base(record: Mapping[str, Any], checkpoint: Path, override: str | os.PathLike | None) -> tuple[str, bool]:
    """The base model to load: (name or path, is_local_dir)."""
    if override is not None:
        override = os.fspath(override)
        return override, Path(override).is_dir()
    name = str(record["base_model"]["name_or_path"])
    redacted = _is_redacted_local(name)
    if not redacted and Path(name).is_dir():
        return name, True
    # deg.json never records a local path outside the working directory; PEFT's adapter_config.json,
    # which stays on this machine, names the directory the base was loaded from
    adapter_config = checkpoint / "adapter_config.json"
    if adapter_config.is_file():
        try:
            cfg_name = json.loads(adapter_config.read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, json.JSONDecodeError, AttributeError):
            cfg_name = None
        if isinstance(cfg_name, str) and cfg_name and Path(cfg_name).is_dir():
            return cfg_name, True
    if not redacted and looks_like_repo_id(name):
        return name, False
    raise DegJsonError(
        f"the base model of this checkpoint ({name}) was a local directory that cannot be found from here; "
        "pass base_model=PATH to load()"
    )


def _base_config_hashes(base_name: str, is_local: bool, revision: str | None) -> tuple[str, set[str]]:
    """Hashes of the base config: of its config.json, and of the config as transformers reads it.

    Both are accepted, so a record hashed from ``model.config`` matches a base whose config.json was
    written by another transformers version (renamed or reordered keys).
    """
    if is_local:
        source = base_name
    else:
        import huggingface_hub

        source = huggingface_hub.hf_hub_download(base_name, "config.json", revision=revision)
    file_hash = config_sha256(source)
    hashes = {file_hash}
    try:
        from transformers import AutoConfig

        hashes.add(config_sha256(AutoConfig.from_pretrained(os.path.dirname(source) if not is_local else source)))
    except Exception:  # an unknown architecture: the file hash alone decides
        pass
    return file_hash, hashes


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


#: ``load(streamed=None)`` streams when the base weights exceed this fraction of free device memory
STREAM_FREE_FRACTION = 0.8


def _weight_bytes(directory: str | os.PathLike) -> int:
    """Bytes of a checkpoint's safetensors weight files on disk (0 without any)."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def _should_stream(base_name: str, base_is_local: bool, revision: str | None, device: Any) -> bool:
    """``streamed=None``: stream when the target device is a CUDA device and the base's weights
    would take more than 80% of its free memory (never for a base without safetensors weights,
    which cannot be streamed)."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if base_is_local:
        directory = base_name
    else:
        from deg_hf.streaming.store import StreamingError, resolve_checkpoint

        try:
            directory = resolve_checkpoint(base_name, revision)  # the weights are needed either way
        except StreamingError:  # no safetensors weights: resident is the only way
            return False
    weights = _weight_bytes(directory)
    if not weights:
        return False
    free, _total = torch.cuda.mem_get_info(device)
    return weights > STREAM_FREE_FRACTION * free


def _load_adapter_streamed(base, checkpoint: Path, device: Any):
    """Wrap a streamed base in the checkpoint's LoRA adapter and load the adapter weights.

    PEFT creates adapter parameters on their base layer's device, which is ``meta`` for streamed
    decoder layers, and loading a state dict into a ``meta`` parameter silently does nothing. So
    the adapter is created, given real storage on the runtime's device, then its weights are
    loaded and checked one by one against the file.
    """
    import torch
    from peft import MODEL_TYPE_TO_PEFT_MODEL_MAPPING, PeftConfig, PeftModel
    from peft.utils import get_peft_model_state_dict, load_peft_weights, set_peft_model_state_dict

    from deg_hf.streaming.build import materialize_adapters

    config = PeftConfig.from_pretrained(str(checkpoint))
    config.inference_mode = True
    cls = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)
    model = cls(base, config, "default")
    materialize_adapters(model, device)
    weights = load_peft_weights(str(checkpoint), device=str(device))
    result = set_peft_model_state_dict(model, weights, adapter_name="default")
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k or "modules_to_save" in k]
    if unexpected:
        raise DegJsonError(f"the adapter in {checkpoint} does not fit the base model: unexpected tensors {unexpected[:4]}")
    still_meta = [n for n, p in model.named_parameters() if p.is_meta and "lora_" in n]
    if still_meta:
        raise DegJsonError(f"adapter tensors were left without storage after loading: {still_meta[:4]}")
    loaded = get_peft_model_state_dict(model, adapter_name="default")
    if set(loaded) != set(weights):
        missing = sorted(set(loaded) - set(weights))[:4]
        extra = sorted(set(weights) - set(loaded))[:4]
        raise DegJsonError(
            f"the adapter in {checkpoint} does not match the model built for it (not in the file: {missing}; "
            f"not in the model: {extra})"
        )
    for key, tensor in weights.items():
        got = loaded[key]
        if got.shape != tensor.shape or not torch.equal(got.detach().to(tensor.device, tensor.dtype), tensor):
            raise DegJsonError(f"adapter tensor {key} did not load from {checkpoint}")
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _recorded_quantization(record: Mapping[str, Any]):
    """``(QuantSpec, compute dtype)`` of the 4-bit base recorded in deg.json, or None."""
    quant = record["base_model"].get("quantization")
    if not isinstance(quant, Mapping):
        return None
    import torch

    from deg_hf.streaming.quant import QuantSpec

    spec = QuantSpec(str(quant["quant_type"]), int(quant.get("blocksize", 64)), bool(quant.get("double_quant")))
    dtype = getattr(torch, str(quant.get("compute_dtype") or ""), None)
    return spec, dtype if isinstance(dtype, torch.dtype) else None


def _load_full(checkpoint: Path, streamed: bool | None, device: Any):
    """A full fine-tune's checkpoint is a whole model: load it as it is (streamed on request)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_checkpoint(checkpoint, full=True)
    if streamed:
        from deg_hf.streaming.build import build_streamed_model

        model, _ = build_streamed_model(str(checkpoint), device=device, progress=False)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
        if device is not None:
            model = model.to(device)
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(checkpoint))


def load(
    path_or_repo_id: str | os.PathLike,
    streamed: bool | None = None,
    device: Any = None,
    trust_config_mismatch: bool = False,
    *,
    base_model: str | os.PathLike | None = None,
    revision: str | None = None,
    token: str | None = None,
):
    """Load a deg_hf checkpoint (local directory or Hub repo id): returns ``(model, tokenizer)``.

    The base model named in ``deg.json`` is loaded and the adapter applied with ``peft`` (a full
    fine-tune's checkpoint, ``"peft": null``, is the whole model and is loaded as it is):

    * ``streamed=False``: resident, with ``AutoModelForCausalLM`` (on ``device`` when given, else
      where ``from_pretrained`` puts it).
    * ``streamed=True``: decoder layers stream from host memory to ``device`` (default: the
      current CUDA device, else the CPU), as in training. The runtime is ``model._deg_stream_runtime``;
      ``model._deg_stream_runtime.close()`` frees its host and device memory.
    * ``streamed=None`` (default): streamed when the target is a CUDA device and the base's weight
      files exceed 80% of its free memory, resident otherwise.

    A base recorded as 4-bit (``base_model.quantization``) is rebuilt 4-bit with the same settings
    and compute dtype: streamed into a 4-bit store, resident with transformers' bitsandbytes loading.

    The base's config is checked against the ``config_sha256`` recorded at training time; a
    mismatch raises :class:`DegJsonError` unless ``trust_config_mismatch=True``. ``base_model``
    overrides where the base is loaded from (needed when it was a local directory, which deg.json
    does not record, and PEFT's adapter_config.json does not point at an existing directory
    either). ``revision`` and ``token`` apply to the Hub download of the checkpoint.
    """
    checkpoint = _resolve_checkpoint(path_or_repo_id, revision, token)
    record = read_deg_json(checkpoint)
    if record.get("peft", {}) is None:
        return _load_full(checkpoint, streamed, device)
    check_checkpoint(checkpoint)
    base_name, base_is_local = _resolve_base(record, checkpoint, base_model)
    base_revision = None if base_is_local else record["base_model"].get("revision")

    expected = record["base_model"].get("config_sha256")
    if not expected:
        warnings.warn(
            "deg.json records no config_sha256 for the base model: cannot check that the base matches the adapter",
            stacklevel=2,
        )
    else:
        actual, accepted = _base_config_hashes(base_name, base_is_local, base_revision)
        if expected not in accepted and not trust_config_mismatch:
            shown = record["base_model"]["name_or_path"] if base_model is None else base_name
            raise DegJsonError(
                f"the config of base model {shown} (sha256 {actual[:12]}) differs from the one this adapter was "
                f"trained on (sha256 {expected[:12]}): pass trust_config_mismatch=True to load it anyway"
            )

    from transformers import AutoTokenizer

    kwargs = {} if base_revision is None else {"revision": base_revision}
    quant = _recorded_quantization(record)
    if streamed is None:
        streamed = _should_stream(base_name, base_is_local, base_revision, device)
    if streamed:
        from deg_hf.streaming.build import build_streamed_model

        extra = {}
        if quant is not None:  # the same 4-bit base the adapter was trained against
            extra = {"quantization": quant[0], "dtype": quant[1]}
        base, runtime = build_streamed_model(base_name, device=device, revision=base_revision, progress=False,
                                             **extra)
        try:
            model = _load_adapter_streamed(base, checkpoint, runtime.device)
        except BaseException:
            runtime.close()
            raise
        model._deg_stream_runtime = runtime
    else:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if quant is not None:  # transformers' own 4-bit loading, placed where asked (a 4-bit model does not move)
            from deg_hf.streaming.quant import resident_config

            if not record["base_model"]["quantization"].get("prequantized"):  # saved 4-bit: its own config applies
                kwargs["quantization_config"] = resident_config(*quant)
            kwargs["dtype"] = quant[1]
            if device is not None:
                kwargs["device_map"] = {"": str(device)}
        model = AutoModelForCausalLM.from_pretrained(base_name, **kwargs)
        model = PeftModel.from_pretrained(model, str(checkpoint))
        if device is not None and quant is None:
            model = model.to(device)
    model.eval()
    tok_source = str(checkpoint) if _has_tokenizer(checkpoint) else base_name
    tokenizer = AutoTokenizer.from_pretrained(tok_source, **({} if tok_source == str(checkpoint) else kwargs))
    return model, tokenizer
