"""Preference trainers over streaming. The whole risk is a second model instance for the reference:
a loss curve cannot see it, so these tests assert identity, counts and bytes."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import requires_cuda
from harness import (
    adapter_state,
    copy_adapters,
    kto_rows,
    pref_rows,
    randomise_lora_b,
    sft_rows,
    trainer_kwargs,
)

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
TASKS = {
    "dpo": ("StreamedDPOTrainer", "StreamedDPOConfig", pref_rows),
    "kto": ("StreamedKTOTrainer", "StreamedKTOConfig", kto_rows),
    "orpo": ("StreamedORPOTrainer", "StreamedORPOConfig", pref_rows),
    "simpo": ("StreamedSimPOTrainer", "SimPOConfig", pref_rows),
}
REFERENCE_USING = ("dpo", "kto")


def build(task, path, out, *, stream=True, rows=16, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import deg_hf

    trainer_name, config_name, make_rows = TASKS[task]
    config = getattr(deg_hf, config_name)(
        **trainer_kwargs(str(out), max_length=32, stream_layers=stream, **overrides)
    )
    return getattr(deg_hf, trainer_name)(
        model=path,
        args=config,
        train_dataset=Dataset.from_list(make_rows(rows)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )


def first_batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def loss_of(trainer, model, batch):
    return trainer.compute_loss(model, batch)


def policy_logps_dpo(trainer, batch):
    """The policy's summed completion log-probs, computed like TRL's reference path but with the adapter on."""
    kwargs = {k: v for k, v in batch.items() if k not in {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    # the same backbone path as the trainer's reference pass (packed when prefix sharing is on)
    with torch.no_grad(), trainer._deg_pairs(trainer._deg_prompt_lens(batch)):
        out = trainer.model(**kwargs, use_cache=False, labels=labels, fused_lm_head=True).log_probs
    return out[:, -(batch["completion_mask"].size(1) - 1):].sum(1).chunk(2)


def policy_logps_kto(trainer, batch):
    keep = {"input_ids", "attention_mask"}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = trainer.model(**{k: batch[k] for k in keep}, use_cache=False, labels=labels, fused_lm_head=True).log_probs
    return out[:, -(batch["input_ids"].size(1) - 1):].sum(-1)


# ----------------------------------------------------------------------------- one model


@pytest.mark.parametrize("task", REFERENCE_USING)
def test_reference_is_the_same_model_with_the_adapter_disabled(checkpoint, tmp_path, task):
    trainer = build(task, checkpoint("llama"), tmp_path)
    assert hasattr(trainer, "ref_model"), "TRL renamed ref_model: re-verify the no-second-instance property"
    assert trainer.ref_model is None
    assert getattr(trainer, "is_peft_model", True)
    # the model TRL holds is the streamed one: its decoder weights are on meta
    layers = trainer.model.base_model.model.model.layers
    assert all(p.is_meta for n, p in layers.named_parameters() if "lora_" not in n)
    assert "ref" not in trainer.model.peft_config  # no frozen adapter copy either: adapters off is the reference


@pytest.mark.parametrize("task", list(TASKS))
def test_exactly_one_store_per_setup_and_same_bytes_as_sft(checkpoint, tmp_path, task):
    from deg_hf.streaming import store

    path = checkpoint("llama")
    before = store.CONSTRUCTED
    trainer = build(task, path, tmp_path / task)
    assert store.CONSTRUCTED - before == 1
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    sft = StreamedSFTTrainer(
        model=path,
        args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path / "sft"), max_length=32)),
        train_dataset=Dataset.from_list(sft_rows(8)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )
    a, b = trainer.stream_runtime.stats(), sft.stream_runtime.stats()
    assert a["store_bytes"] == b["store_bytes"] > 0
    assert a["buffer_bytes"] == b["buffer_bytes"] > 0


def test_dpo_reference_logps_differ_with_random_b_and_equal_with_zero_b(checkpoint, tmp_path):
    trainer = build("dpo", checkpoint("llama"), tmp_path)
    batch = first_batch(trainer)
    randomise_lora_b(trainer.model)
    ref_c, ref_r = trainer.compute_ref_log_probs(trainer.model, batch)  # TRL's own reference path
    pol_c, pol_r = policy_logps_dpo(trainer, batch)
    assert (ref_c - pol_c).abs().max().item() > 1e-4
    assert (ref_r - pol_r).abs().max().item() > 1e-4
    with torch.no_grad():  # control: B = 0 makes the adapter a no-op, so reference == policy exactly
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.zero_()
    ref_c, ref_r = trainer.compute_ref_log_probs(trainer.model, batch)
    pol_c, pol_r = policy_logps_dpo(trainer, batch)
    assert (ref_c - pol_c).abs().max().item() == 0.0
    assert (ref_r - pol_r).abs().max().item() == 0.0


def test_kto_reference_logps_differ_with_random_b_and_equal_with_zero_b(checkpoint, tmp_path):
    trainer = build("kto", checkpoint("llama"), tmp_path)
    batch = first_batch(trainer)
    randomise_lora_b(trainer.model)
    ref = trainer.compute_ref_log_probs(trainer.model, batch)  # KTO's own reference path
    ref = ref[0] if isinstance(ref, tuple) else ref
    pol = policy_logps_kto(trainer, batch)
    assert (ref - pol).abs().max().item() > 1e-4
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.zero_()
    ref = trainer.compute_ref_log_probs(trainer.model, batch)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert (ref - policy_logps_kto(trainer, batch)).abs().max().item() == 0.0


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("task", list(TASKS))
def test_loss_streamed_equals_resident_and_layer0_gets_gradient(checkpoint, tmp_path, task):
    path = checkpoint("llama")
    streamed = build(task, path, tmp_path / "s")
    resident = build(task, path, tmp_path / "r", stream=False)
    assert streamed.stream_runtime is not None and resident.stream_runtime is None
    randomise_lora_b(streamed.model)
    assert copy_adapters(resident.model, streamed.model) > 0
    batch = first_batch(streamed)
    streamed.model.train()
    resident.model.train()
    loss_s = loss_of(streamed, streamed.model, batch)
    loss_r = loss_of(resident, resident.model, batch)
    assert loss_s.item() == loss_r.item()
    loss_s.backward()
    layer0 = [p.grad for n, p in streamed.model.named_parameters() if "layers.0." in n and "lora_" in n]
    assert layer0 and sum(float(g.abs().sum()) for g in layer0 if g is not None) > 0


@pytest.mark.parametrize("task", list(TASKS))
def test_ten_steps_train_with_finite_losses_and_reward_metrics(checkpoint, tmp_path, task):
    trainer = build(task, checkpoint("llama"), tmp_path, max_steps=10, rows=24)
    before = adapter_state(trainer.model)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 10 and all(math.isfinite(h["loss"]) for h in logs)
    after = adapter_state(trainer.model)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert any(k.startswith("rewards/") for k in logs[-1])


@pytest.mark.parametrize("task, per_step", [("dpo", 1), ("kto", 2)])
def test_the_reference_forward_runs_every_step(checkpoint, tmp_path, task, per_step):
    """Counts forwards with the adapter disabled through the streamed layer 0. KTO runs two per step:
    its KL forward and its main forward. A run that precomputes (caches) the reference shows none
    during training: the control that shows the count can fail."""

    from transformers import TrainerCallback

    def reference_passes_inside_steps(trainer):
        q_proj = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
        state = {"in_step": False, "count": 0}

        class Window(TrainerCallback):
            def on_step_begin(self, *a, **k):
                state["in_step"] = True

            def on_step_end(self, *a, **k):
                state["in_step"] = False

        def seen(mod, args):
            if state["in_step"] and mod.disable_adapters:
                state["count"] += 1

        trainer.add_callback(Window())
        handle = q_proj.register_forward_pre_hook(seen)
        trainer.train()
        handle.remove()
        return state["count"]

    steps = 3
    trainer = build(task, checkpoint("llama"), tmp_path / "a", max_steps=steps)
    assert reference_passes_inside_steps(trainer) == steps * per_step
    # control: a run that precomputes (caches) the reference runs none inside its steps
    cached = build(task, checkpoint("llama"), tmp_path / "b", max_steps=steps, precompute_ref_log_probs=True)
    assert reference_passes_inside_steps(cached) == 0


@pytest.mark.parametrize("task", list(TASKS))
def test_runtime_closes_when_train_raises(checkpoint, tmp_path, task):
    trainer = build(task, checkpoint("llama"), tmp_path, oom_retry=False)

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure inside the loss")

    trainer.compute_loss = boom
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert trainer.stream_runtime.closed
    trainer.release_stream()


# ----------------------------------------------------------------------------- drop-in and refusals


def test_plain_dpo_config_is_a_drop_in(checkpoint, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from deg_hf import StreamedDPOTrainer

    path = checkpoint("llama")
    trainer = StreamedDPOTrainer(
        model=path,
        args=DPOConfig(**trainer_kwargs(str(tmp_path), max_length=32, max_steps=1)),
        train_dataset=Dataset.from_list(pref_rows(8)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )
    assert trainer.stream_runtime is not None and trainer.ref_model is None
    trainer.train()


def test_peft_model_keeps_trl_ref_adapter_resident(checkpoint, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deg_hf import StreamedDPOConfig, StreamedDPOTrainer

    path = checkpoint("llama")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), LoraConfig(**LORA))
    trainer = StreamedDPOTrainer(
        model=peft_model,
        args=StreamedDPOConfig(**trainer_kwargs(str(tmp_path), stream_layers=False, max_length=32)),
        train_dataset=Dataset.from_list(pref_rows(4)),
        processing_class=AutoTokenizer.from_pretrained(path),
    )
    assert "ref" in trainer.model.peft_config  # TRL's semantics: the reference is the adapter as passed


def test_kto_batch_of_one_is_refused_at_config_time_and_by_trl(checkpoint, tmp_path):
    from trl import KTOConfig

    from deg_hf import StreamedKTOConfig, StreamedKTOTrainer
    from deg_hf.streaming import store

    with pytest.raises(ValueError, match="KTO.*per_device_train_batch_size"):
        StreamedKTOConfig(**trainer_kwargs(str(tmp_path), per_device_train_batch_size=1))
    before = store.CONSTRUCTED
    with pytest.raises(ValueError, match="per_device_train_batch_size >= 2"):
        StreamedKTOTrainer(
            model=checkpoint("llama"), args=KTOConfig(**trainer_kwargs(str(tmp_path), per_device_train_batch_size=1))
        )
    assert store.CONSTRUCTED == before  # refused before any weight was read

    # the installed TRL still refuses it too: our refusal mirrors upstream, it does not invent one
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import KTOTrainer

    path = checkpoint("llama")
    with pytest.raises(ValueError, match="batch size must be > 1"):
        KTOTrainer(
            model=path,
            args=KTOConfig(**trainer_kwargs(str(tmp_path), per_device_train_batch_size=1)),
            train_dataset=Dataset.from_list(kto_rows(4)),
            processing_class=AutoTokenizer.from_pretrained(path),
        )


@pytest.mark.parametrize("name", ["GRPOTrainer", "RLOOTrainer"])
def test_rollout_trainers_are_refused_for_a_permanent_reason(name):
    import trl

    from deg_hf import StreamingSetupMixin

    upstream = getattr(trl, name)
    with pytest.raises(TypeError) as excinfo:
        type(f"Streamed{name}", (StreamingSetupMixin, upstream), {})
    message = str(excinfo.value)
    assert "stream_layers" in message and "generat" in message and "rollout" in message
    assert "0." not in message and "version" not in message.lower()  # no release would lift it


def test_online_dpo_is_refused_too():
    from trl.experimental.online_dpo import OnlineDPOTrainer

    from deg_hf import StreamingSetupMixin

    with pytest.raises(TypeError, match="rollout"):
        type("StreamedOnlineDPO", (StreamingSetupMixin, OnlineDPOTrainer), {})


def test_simpo_config_defaults_follow_the_paper(tmp_path):
    from deg_hf import SimPOConfig

    cfg = SimPOConfig(**trainer_kwargs(str(tmp_path)))
    assert (cfg.loss_type, cfg.cpo_alpha, cfg.beta, cfg.simpo_gamma) == ("simpo", 0.0, 2.0, 0.5)
    assert cfg.stream_layers is True


# ----------------------------------------------------------------------------- CUDA only


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("task", REFERENCE_USING)
def test_reference_adds_no_device_memory_and_a_second_instance_is_noticed(checkpoint, tmp_path, task):
    import gc

    from transformers import AutoModelForCausalLM

    path = checkpoint("llama", n_layers=4, hidden=256, vocab=512)

    def peak(trainer, extra=None):
        gc.collect()
        torch.cuda.empty_cache()
        batch = first_batch(trainer)
        torch.cuda.reset_peak_memory_stats()
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        trainer.model.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated()

    def cuda_kwargs(out):
        return dict(use_cpu=False, bf16=True)

    sft_trainer = None
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    sft_trainer = StreamedSFTTrainer(
        model=path,
        args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path / "sft"), max_length=32, **cuda_kwargs(tmp_path))),
        train_dataset=Dataset.from_list(sft_rows(8)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )
    sft_peak = peak(sft_trainer)
    sft_trainer.release_stream()
    del sft_trainer
    trainer = build(task, path, tmp_path / task, **cuda_kwargs(tmp_path))
    pref_peak = peak(trainer)
    assert pref_peak < 1.05 * sft_peak
    # control: a forced resident second instance for the reference is visible in the same measurement
    second = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    with_second = peak(trainer)
    assert with_second > 1.05 * sft_peak
    del second
