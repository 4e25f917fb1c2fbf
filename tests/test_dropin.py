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
