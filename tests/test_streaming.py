"""Layer streaming: streamed equals resident bit for bit on CPU float32, with the controls that show
each assertion can fail."""

from __future__ import annotations

import pytest
import torch
from harness import (
    ARCHS,
    adapter_state,
    copy_adapters,
    lora_grads,
    randomise_lora_b,
    sft_rows,
    trainer_kwargs,
)

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def _streamed_peft(path, **kwargs):
    from peft import LoraConfig, get_peft_model

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    model, runtime = build_streamed_model(path, device="cpu", **kwargs)
    peft_model = get_peft_model(model, LoraConfig(**LORA))
    assert materialize_adapters(peft_model, "cpu") > 0
    return peft_model, runtime


def _resident_peft(path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    return get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(**LORA))


def _batch(vocab=40, rows=3, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, vocab, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # one left-padded row: the mask path is exercised too
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _layer0_grad_norm(model) -> float:
    grads = [p.grad for n, p in model.named_parameters() if "layers.0." in n and "lora_" in n]
    return float(sum(g.abs().sum() for g in grads if g is not None))


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_matches_resident_bit_for_bit(checkpoint, arch):
    path = checkpoint(arch)
    streamed, runtime = _streamed_peft(path)
    resident = _resident_peft(path)
    assert randomise_lora_b(streamed) > 0
    assert copy_adapters(resident, streamed) > 0
    batch = _batch()
    streamed.train()
    resident.train()
    out_s = streamed(**batch)
    out_r = resident(**batch)
    assert (out_s.logits - out_r.logits).abs().max().item() == 0.0
    assert out_s.loss.item() == out_r.loss.item()
    out_s.loss.backward()
    out_r.loss.backward()
    gs, gr = lora_grads(streamed), lora_grads(resident)
    assert gs.keys() == gr.keys() and len(gs) > 0
    for name in gs:
        assert torch.equal(gs[name], gr[name]), name
    # the adapter really ran: with lora_B randomised the logits differ from the base model's
    with torch.no_grad(), streamed.disable_adapter():
        base = streamed(**batch).logits
    assert (base - out_s.logits).abs().max().item() > 1e-4
    runtime.close()


def test_disable_adapter_gives_the_base_model_logits_exactly(checkpoint):
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    streamed, _ = _streamed_peft(path)
    randomise_lora_b(streamed)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batch = _batch()
    with torch.no_grad():
        with streamed.disable_adapter():
            got = streamed(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        want = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        adapted = streamed(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    assert (got - want).abs().max().item() == 0.0
    assert (adapted - want).abs().max().item() > 1e-4  # control: the adapter is load-bearing


def test_layer0_adapter_receives_gradient_and_a_severed_graph_is_caught(checkpoint):
    path = checkpoint("llama", n_layers=3)
    streamed, _ = _streamed_peft(path)
    randomise_lora_b(streamed)
    streamed(**_batch()).loss.backward()
    assert _layer0_grad_norm(streamed) > 0

    # control: detach the hidden state between layers 0 and 1 (what a stray no_grad/detach in a
    # streaming wrapper does) - the loss still falls, but the same assertion now fails
    streamed.zero_grad(set_to_none=True)
    layer1 = streamed.base_model.model.model.layers[1]
    handle = layer1.register_forward_pre_hook(lambda mod, args: (args[0].detach(),) + tuple(args[1:]))
    try:
        streamed(**_batch()).loss.backward()
    finally:
        handle.remove()
    assert _layer0_grad_norm(streamed) == 0


# ----------------------------------------------------------------------------- structure


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_base_weights_stay_on_meta_one_store_and_bounded_buffers(checkpoint, buffers):
    from deg_hf.streaming import store

    before = store.CONSTRUCTED
    streamed, runtime = _streamed_peft(checkpoint("llama", n_layers=4), stream_buffers=buffers)
    assert store.CONSTRUCTED - before == 1
    layers = streamed.base_model.model.model.layers
    base = [(n, p) for n, p in layers.named_parameters() if "lora_" not in n]
    assert base and all(p.is_meta for _, p in base)
    assert all(not p.is_meta for n, p in streamed.named_parameters() if "lora_" in n)
    streamed(**_batch()).loss.backward()
    stats = runtime.stats()
    assert stats["in_flight_peak"] <= buffers
    assert stats["buffer_bytes"] == buffers * runtime.store.max_layer_bytes
    assert stats["store_bytes"] == sum(p.numel() * 4 for _, p in base)


def test_fetches_per_sft_step_are_forward_plus_recompute(checkpoint, tmp_path):
    from transformers import TrainerCallback

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    n_layers = 4
    path = checkpoint("llama", n_layers=n_layers)
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    per_step = []

    class Count(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = (trainer.stream_runtime.loads, trainer.stream_runtime.hits)

        def on_step_end(self, args, state, control, **kw):
            loads, hits = trainer.stream_runtime.loads, trainer.stream_runtime.hits
            per_step.append((loads - self.start[0], hits - self.start[1]))

    trainer = StreamedSFTTrainer(
        model=path,
        args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path), max_steps=3, max_length=32)),
        train_dataset=Dataset.from_list(sft_rows(12)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
        callbacks=[Count()],
    )
    trainer.train()
    assert len(per_step) == 3
    for loads, hits in per_step:
        assert loads + hits == 2 * n_layers  # every layer fetched for the forward and the recompute
        assert loads <= 2 * n_layers
        assert loads >= n_layers  # a real copy per layer at least once: the counter moves


# ----------------------------------------------------------------------------- trainer runs


def _sft_trainer(path, tmp_path, stream: bool, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    args = StreamedSFTConfig(**trainer_kwargs(str(tmp_path), max_length=32, stream_layers=stream, **overrides))
    return StreamedSFTTrainer(
        model=path,
        args=args,
        train_dataset=Dataset.from_list(sft_rows(16)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_twenty_sft_steps_streamed_equal_resident(checkpoint, tmp_path, arch):
    path = checkpoint(arch)
    streamed = _sft_trainer(path, tmp_path / "s", True, max_steps=20)
    resident = _sft_trainer(path, tmp_path / "r", False, max_steps=20)
    assert streamed.stream_runtime is not None and resident.stream_runtime is None
    randomise_lora_b(streamed.model)
    assert copy_adapters(resident.model, streamed.model) > 0
    start = adapter_state(streamed.model)
    streamed.train()
    resident.train()
    s, r = adapter_state(streamed.model), adapter_state(resident.model)
    assert s.keys() == r.keys()
    for key in s:
        assert torch.equal(s[key], r[key]), key
    assert any(not torch.equal(s[k], start[k]) for k in s)  # control: training changed them


def test_resume_from_checkpoint_continues_exactly(checkpoint, tmp_path):
    path = checkpoint("llama")
    full = _sft_trainer(path, tmp_path / "full", True, max_steps=6)
    randomise_lora_b(full.model)
    init = adapter_state(full.model)
    full.train()

    first = _sft_trainer(path, tmp_path / "part", True, max_steps=6, save_strategy="steps", save_steps=3)
    with torch.no_grad():
        for k, v in first.model.state_dict().items():
            if k in init:
                v.copy_(init[k])

    class Stop(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 3:
                control.should_training_stop = True

    first.add_callback(Stop())
    first.train()
    resumed = _sft_trainer(path, tmp_path / "part", True, max_steps=6, save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-3"))
    a, b = adapter_state(full.model), adapter_state(resumed.model)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ----------------------------------------------------------------------------- lifetime


def test_runtime_closes_when_train_raises_and_twice_is_harmless(checkpoint, tmp_path):
    trainer = _sft_trainer(checkpoint("llama"), tmp_path, True, oom_retry=False)

    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    trainer.compute_loss = boom
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.train()
    assert trainer.stream_runtime.closed
    assert trainer.stream_runtime.stats()["store_bytes"] == 0
    assert trainer.stream_runtime.stats()["device_bytes"] == 0
    trainer.release_stream()  # a second close is harmless
    trainer.stream_runtime.close()


def test_runtime_stays_open_after_a_successful_train(checkpoint, tmp_path):
    trainer = _sft_trainer(checkpoint("llama"), tmp_path, True, max_steps=1)
    trainer.train()
    assert not trainer.stream_runtime.closed  # the trained model can still be evaluated and saved


def test_resident_trainer_has_no_runtime_and_release_is_a_noop(checkpoint, tmp_path):
    trainer = _sft_trainer(checkpoint("llama"), tmp_path, False)
    assert trainer.stream_runtime is None
    trainer.release_stream()


def test_plain_sft_config_is_accepted_with_stream_defaults(checkpoint, tmp_path, caplog):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig

    from deg_hf import StreamedSFTTrainer

    path = checkpoint("llama")
    with caplog.at_level("WARNING", logger="deg_hf"):
        trainer = StreamedSFTTrainer(
            model=path,
            args=SFTConfig(**trainer_kwargs(str(tmp_path), max_length=32, max_steps=1)),
            train_dataset=Dataset.from_list(sft_rows(4)),
            processing_class=AutoTokenizer.from_pretrained(path),
        )
    # the default LoRA is announced once, saying why (a streamed base stays frozen) and how to choose
    announced = [r.getMessage() for r in caplog.records if "default LoRA" in r.getMessage()]
    assert len(announced) == 1 and "streamed base stays frozen" in announced[0]
    assert trainer.stream_runtime is not None and trainer.deg_stream.stream_buffers == 2
    assert trainer.deg_default_lora
    trainer.train()
    trainer.save_model()
    from deg_hf.checkpoint import read_deg_json

    record = read_deg_json(tmp_path)
    assert record["fine_tuning"] == "adapter" and record["peft"]["default_lora_applied"] is True
    assert any("default LoRA" in note for note in record["notes"])
    assert "deg_hf's default LoRA" in (tmp_path / "README.md").read_text()


def test_streamed_trainer_on_plain_trainer(checkpoint, tmp_path):
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    from deg_hf import StreamedTrainer, StreamedTrainingArguments

    path = checkpoint("qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    rows = [tok(" ".join(["hello world the cat sat"] * 2)) for _ in range(8)]
    trainer = StreamedTrainer(
        model=path,
        args=StreamedTrainingArguments(**trainer_kwargs(str(tmp_path), max_steps=2, remove_unused_columns=False)),
        train_dataset=rows,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )
    before = adapter_state(trainer.model)
    trainer.train()
    after = adapter_state(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    trainer.save_model()
    assert (tmp_path / "adapter_model.safetensors").exists()


# ----------------------------------------------------------------------------- refusals


def test_bad_inputs_are_refused_before_any_weight_is_read(checkpoint, tmp_path):
    from deg_hf.streaming.build import build_streamed_model
    from deg_hf.streaming.store import StreamingError

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(StreamingError, match="no \\*.safetensors"):
        build_streamed_model(str(empty), device="cpu")
    with pytest.raises(ValueError, match="stream_buffers must be >= 1"):
        build_streamed_model(checkpoint("llama"), device="cpu", stream_buffers=0)
    from deg_hf import StreamedSFTConfig

    with pytest.raises(ValueError, match="stream_buffers must be >= 1"):
        StreamedSFTConfig(**trainer_kwargs(str(tmp_path), stream_buffers=0))


def test_unfindable_layer_list_is_refused(monkeypatch):
    from torch import nn

    from deg_hf.streaming.build import find_decoder_layers
    from deg_hf.streaming.store import StreamingError

    class Odd(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"num_hidden_layers": 3})()
            self.blocks = nn.Sequential(nn.Linear(2, 2))

    with pytest.raises(StreamingError, match="cannot find the decoder layer list"):
        find_decoder_layers(Odd())


def test_dispatched_and_quantized_models_are_refused(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    model = AutoModelForCausalLM.from_pretrained(checkpoint("llama"))
    model.hf_device_map = {"": "cpu"}
    with pytest.raises(ValueError, match="device_map"):
        StreamedSFTTrainer(model=model, args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path))))
    del model.hf_device_map
    model.config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ValueError, match="quantized"):
        StreamedSFTTrainer(model=model, args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path))))


@pytest.mark.parametrize(
    "peft_kwargs, match",
    [({"use_dora": True}, "DoRA"), ({"init_lora_weights": "pissa"}, "pissa"), ({"init_lora_weights": "olora"}, "olora")],
)
def test_base_reading_peft_variants_are_refused_by_name(checkpoint, tmp_path, peft_kwargs, match):
    from peft import LoraConfig

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer
    from deg_hf.streaming import store

    before = store.CONSTRUCTED
    with pytest.raises(ValueError, match=match):
        StreamedSFTTrainer(
            model=checkpoint("llama"),
            args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path))),
            peft_config=LoraConfig(target_modules="all-linear", **peft_kwargs),
        )
    assert store.CONSTRUCTED == before  # refused before any weight was read


def test_streaming_under_fsdp_or_deepspeed_is_refused(checkpoint, tmp_path, monkeypatch):
    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer
    from deg_hf.streaming import store

    before = store.CONSTRUCTED
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="cannot run under FSDP.*stream_layers false"):
        StreamedSFTTrainer(model=checkpoint("llama"), args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path))))
    assert store.CONSTRUCTED == before
