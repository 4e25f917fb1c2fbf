"""Drop-in, for real: resident is the upstream trainer (full fine-tuning, TRL's own reference), and
under streaming an explicit ``ref_model`` that is the policy's base is accepted and released."""

from __future__ import annotations

import pytest
import torch
from harness import adapter_state, kto_rows, pref_rows, sft_rows, trainer_kwargs

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
TASKS = {
    "sft": ("StreamedSFTTrainer", "StreamedSFTConfig", sft_rows),
    "dpo": ("StreamedDPOTrainer", "StreamedDPOConfig", pref_rows),
    "kto": ("StreamedKTOTrainer", "StreamedKTOConfig", kto_rows),
    "orpo": ("StreamedORPOTrainer", "StreamedORPOConfig", pref_rows),
    "simpo": ("StreamedSimPOTrainer", "SimPOConfig", pref_rows),
}


def make(task, path, out, *, stream, model=None, peft=True, rows=8, **kwargs):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import deg_hf

    trainer_name, config_name, make_rows = TASKS[task]
    extra = {k: kwargs.pop(k) for k in ("ref_model",) if k in kwargs}
    config = getattr(deg_hf, config_name)(
        **trainer_kwargs(str(out), max_length=32, stream_layers=stream, **kwargs)
    )
    return getattr(deg_hf, trainer_name)(
        model=path if model is None else model,
        args=config,
        train_dataset=Dataset.from_list(make_rows(rows)),
        processing_class=AutoTokenizer.from_pretrained(path),
        **({"peft_config": LoraConfig(**LORA)} if peft else {}),
        **extra,
    )


def params_of(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- resident is upstream


@pytest.mark.parametrize("task", list(TASKS))
def test_resident_without_peft_config_fine_tunes_every_weight_as_upstream(checkpoint, tmp_path, task):
    from peft import PeftModel

    from deg_hf.checkpoint import read_deg_json

    trainer = make(task, checkpoint("llama"), tmp_path, stream=False, peft=False)
    assert not isinstance(trainer.model, PeftModel) and not trainer.deg_default_lora
    before = params_of(trainer.model)
    assert before and all(p.requires_grad for p in trainer.model.parameters())
    reference = getattr(trainer, "ref_model", None)
    if task in ("dpo", "kto"):
        # TRL's own reference handling for a full fine-tune: a separate, frozen copy of the model
        assert reference is not None and reference is not trainer.model
        reference_before = params_of(reference)
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p)]
    assert not unchanged, f"{len(unchanged)} base parameters did not change, e.g. {unchanged[:3]}"
    if reference is not None:
        assert all(torch.equal(reference_before[n], p) for n, p in reference.named_parameters())
    trainer.save_model()
    record = read_deg_json(tmp_path)
    assert record["fine_tuning"] == "full" and record["peft"] is None
    assert "full fine-tune" in (tmp_path / "README.md").read_text()
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "adapter_model.safetensors").exists()


def test_streamed_without_peft_config_trains_the_default_lora_and_keeps_the_base(checkpoint, tmp_path):
    """The control for the test above: streamed, the base stays frozen (so "every weight changed"
    fails there), and the default LoRA is what trains, recorded as such."""
    from deg_hf.checkpoint import read_deg_json

    trainer = make("dpo", checkpoint("llama"), tmp_path, stream=True, peft=False)
    assert trainer.deg_default_lora and trainer.ref_model is None
    base = trainer.model.get_base_model()
    before = {k: v.clone() for k, v in base.state_dict().items() if "lora_" not in k}
    adapters = adapter_state(trainer.model)
    trainer.train()
    after = base.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert any(not torch.equal(adapters[k], v) for k, v in adapter_state(trainer.model).items())
    trainer.save_model()
    record = read_deg_json(tmp_path)
    assert record["fine_tuning"] == "adapter" and record["peft"]["default_lora_applied"] is True


def test_a_full_fine_tune_checkpoint_loads_back(checkpoint, tmp_path):
    import deg_hf

    path = checkpoint("llama")
    trainer = make("sft", path, tmp_path, stream=False, peft=False, max_steps=1)
    trainer.train()
    trainer.save_model()
    model, _ = deg_hf.load(tmp_path)
    ids = torch.tensor([[1, 9, 10, 11, 12]])
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, trainer.model(input_ids=ids).logits)
    assert "none: a full fine-tune" in deg_hf.checkpoint.summarize(deg_hf.read_deg_json(tmp_path))


# ----------------------------------------------------------------------------- an explicit ref_model


def test_ref_model_that_is_the_base_is_released_and_training_is_unchanged(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from deg_hf.checkpoint import read_deg_json
    from deg_hf.streaming import store

    path = checkpoint("llama")
    plain = make("dpo", path, tmp_path / "plain", stream=True, max_steps=5)
    ref = AutoModelForCausalLM.from_pretrained(path)  # what many scripts do: a second copy of the base
    assert not any(p.is_meta for p in ref.parameters())  # control: it holds real weights until accepted
    before = store.CONSTRUCTED
    with_ref = make("dpo", path, tmp_path / "ref", stream=True, max_steps=5, ref_model=ref)
    assert store.CONSTRUCTED - before == 1 and with_ref.ref_model is None
    assert all(p.is_meta for p in ref.parameters()) and all(b.is_meta for b in ref.buffers())
    start = adapter_state(plain.model)
    assert all(torch.equal(start[k], v) for k, v in adapter_state(with_ref.model).items())
    plain.train()
    with_ref.train()
    a, b = adapter_state(plain.model), adapter_state(with_ref.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(start[k], a[k]) for k in a)  # control: five steps moved the adapters
    with_ref.save_model()
    assert any("ref_model is the streamed base" in note for note in read_deg_json(tmp_path / "ref")["notes"])


@pytest.mark.parametrize("change", ["edited in memory", "another checkpoint", "another config"])
def test_ref_model_that_differs_from_the_base_is_refused(checkpoint, tmp_path, change):
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    if change == "edited in memory":
        ref = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            ref.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
        match = "weights differ.*layers.1.mlp.down_proj"
    elif change == "another checkpoint":
        ref = AutoModelForCausalLM.from_pretrained(checkpoint("llama", seed=8))
        match = "weights differ"
    else:
        ref = AutoModelForCausalLM.from_pretrained(checkpoint("llama", n_layers=3))
        match = "config differs.*num_hidden_layers"
    with pytest.raises(ValueError, match=match):
        make("dpo", path, tmp_path, stream=True, ref_model=ref)
    assert not any(p.is_meta for p in ref.parameters())  # a refused reference is left as it was


def test_ref_model_loaded_in_float32_matches_a_bfloat16_store(checkpoint, tmp_path):
    """Compared in the narrower dtype: the float32 copy rounds to exactly the bfloat16 store."""
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = make("kto", path, tmp_path, stream=True, ref_model=ref, model_init_kwargs={"dtype": "bfloat16"})
    assert trainer.stream_runtime.store.dtype == torch.bfloat16 and trainer.ref_model is None
    assert all(p.is_meta for p in ref.parameters())


def test_same_object_as_model_and_ref_model_gets_trls_own_message(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming import store

    path = checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(path)
    before = store.CONSTRUCTED
    with pytest.raises(ValueError, match="cannot be the same object"):
        make("dpo", path, tmp_path, stream=True, model=model, ref_model=model)
    assert store.CONSTRUCTED == before


# ----------------------------------------------------------------------------- loaded objects


def _ids():
    return torch.tensor([[1, 9, 10, 11, 12, 13, 14], [1, 20, 21, 22, 23, 24, 25]])


def test_loaded_model_streams_as_given_with_its_dtype_and_in_memory_edits(checkpoint, tmp_path):
    import copy
    import gc
    import weakref

    from harness import write_tokenizer
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming import store

    files = str(tmp_path / "bf16")  # a bfloat16 checkpoint, loaded as a float32 object
    AutoModelForCausalLM.from_pretrained(checkpoint("llama")).to(torch.bfloat16).save_pretrained(files)
    write_tokenizer(files)
    obj = AutoModelForCausalLM.from_pretrained(files, dtype=torch.float32)
    with torch.no_grad():  # edits that exist only in memory
        obj.model.layers[0].self_attn.q_proj.weight.add_(0.25)
        obj.model.layers[0].mlp.up_proj.weight.mul_(-1.0)
    resident = copy.deepcopy(obj).eval()
    with torch.no_grad():
        expected = resident(input_ids=_ids()).logits
        # control: the files differ from the object, so rebuilding from them would fail below
        reloaded = AutoModelForCausalLM.from_pretrained(files, dtype=torch.float32).eval()
        assert not torch.equal(reloaded(input_ids=_ids()).logits, expected)
    held = weakref.ref(obj.model.layers[0].self_attn.q_proj.weight)
    assert held() is not None and not held().is_meta
    before = store.CONSTRUCTED
    trainer = make("sft", files, tmp_path / "out", stream=True, model=obj)
    assert store.CONSTRUCTED - before == 1
    assert trainer.model.get_base_model() is obj  # the object itself, not a rebuild
    assert trainer.stream_runtime.store.dtype == torch.float32  # its dtype, not the files' bfloat16
    # every decoder-layer base weight moved out of the module: on meta, its storage released
    layer_params = [(n, p) for n, p in obj.model.layers.named_parameters() if "lora_" not in n]
    assert layer_params and all(p.is_meta for _, p in layer_params)
    gc.collect()
    assert held() is None
    trainer.model.eval()
    with torch.no_grad(), trainer.model.disable_adapter():
        got = trainer.model(input_ids=_ids()).logits
    assert torch.equal(got, expected)


def test_peft_model_streams_with_its_adapter_and_trains_like_resident(checkpoint, tmp_path):
    import copy

    from harness import randomise_lora_b
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA))
    assert randomise_lora_b(peft_model) > 0  # trained adapter values (PEFT starts lora_B at zero)
    twin = copy.deepcopy(peft_model)
    streamed = make("dpo", path, tmp_path / "s", stream=True, model=peft_model, peft=False, max_steps=5)
    resident = make("dpo", path, tmp_path / "r", stream=False, model=twin, peft=False, max_steps=5)
    assert streamed.model is peft_model and streamed.stream_runtime is not None
    assert all(p.is_meta for n, p in peft_model.get_base_model().model.layers.named_parameters() if "lora_" not in n)
    # TRL's semantics on both: the reference is a frozen copy of the adapter as passed
    assert "ref" in streamed.model.peft_config and "ref" in resident.model.peft_config
    start = adapter_state(resident.model)
    got = adapter_state(streamed.model)
    assert got.keys() == start.keys() and all(torch.equal(got[k], start[k]) for k in start)
    streamed.model.eval()
    resident.model.eval()
    with torch.no_grad():
        assert torch.equal(streamed.model(input_ids=_ids()).logits, resident.model(input_ids=_ids()).logits)
    streamed.train()
    resident.train()
    a, b = adapter_state(streamed.model), adapter_state(resident.model)
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert any(not torch.equal(start[k], b[k]) for k in b if ".default." in k)  # control: training moved it


def test_peft_model_with_a_named_and_a_second_adapter_keeps_both(checkpoint, tmp_path):
    import copy

    from harness import randomise_lora_b
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA), adapter_name="mine")
    peft_model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    randomise_lora_b(peft_model)
    twin = copy.deepcopy(peft_model).eval()
    trainer = make("sft", path, tmp_path, stream=True, model=peft_model, peft=False)
    assert set(trainer.model.peft_config) == {"mine", "second"}
    assert trainer.model.active_adapter == "mine"
    got, want = adapter_state(trainer.model), adapter_state(twin)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    trainer.model.eval()
    outputs = {}
    for adapter in ("mine", "second"):
        trainer.model.set_adapter(adapter)
        twin.set_adapter(adapter)
        with torch.no_grad():
            outputs[adapter] = trainer.model(input_ids=_ids()).logits
            assert torch.equal(outputs[adapter], twin(input_ids=_ids()).logits)
    assert not torch.equal(outputs["mine"], outputs["second"])  # control: the adapters differ


def test_peft_model_with_the_base_as_ref_model_keeps_the_base_as_reference(checkpoint, tmp_path):
    """The script's own reference (the bare base) is kept: the adapters-off base, no "ref" adapter copy."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA))
    ref = AutoModelForCausalLM.from_pretrained(path)
    trainer = make("kto", path, tmp_path, stream=True, model=peft_model, peft=False, ref_model=ref)
    assert trainer.ref_model is None and "ref" not in trainer.model.peft_config
    assert all(p.is_meta for p in ref.parameters())


def test_kto_split_with_trls_own_reference_model_gives_the_unsplit_gradient(checkpoint, tmp_path):
    """Resident without peft_config, KTO's batch-level KL over the whole micro-batch comes from TRL's
    reference model (no adapter to disable) when a micro-batch runs in parts."""
    from test_split_retry import assert_close_gradients, oom, run

    path = checkpoint("llama")
    kwargs = dict(stream=False, peft=False, rows=12, max_steps=1, gradient_accumulation_steps=2,
                  per_device_train_batch_size=3)
    want = run(make("kto", path, tmp_path / "whole", **kwargs))
    split = make("kto", path, tmp_path / "split", **kwargs)
    split.set_fault_hook(lambda info, phase: oom() if len(info) > 1 and phase == "forward" else None)
    got = run(split)
    assert split.deg_counters["oom_retry"] > 0 and split.deg_counters["parts"] > 2
    assert_close_gradients(got.grads[0], want.grads[0])


def test_loaded_model_streams_4bit_to_the_same_bytes_as_its_files(checkpoint, tmp_path):
    """stream_quantization applies to a loaded model too: quantized from its own tensors as the
    store fills, byte for byte what streaming the same weights from their files stores."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    from_object = make("sft", path, tmp_path / "o", stream=True, model=AutoModelForCausalLM.from_pretrained(path),
                       stream_quantization="nf4")
    from_files = make("sft", path, tmp_path / "f", stream=True, stream_quantization="nf4")
    a, b = from_object.stream_runtime.store, from_files.stream_runtime.store
    assert a.quantized and b.quantized and a.n_layers == b.n_layers
    for i in range(a.n_layers):  # piece by piece (a block's alignment padding is never written)
        got, want = a.layouts[i].views(a.block(i)), b.layouts[i].views(b.block(i))
        assert got.keys() == want.keys() and any("absmax" in k or "quant" in k for k in got)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_loaded_model_with_the_disk_tier_is_refused_and_left_whole(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    obj = AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="stream_tier='disk'.*already loaded"):
        make("sft", path, tmp_path, stream=True, model=obj, stream_tier="disk")
    assert not any(p.is_meta for p in obj.parameters())  # refused before any tensor moved
