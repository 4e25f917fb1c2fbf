"""deg.json at every save: the record a trainer writes, the load it allows, the resume it restores.

The trainers here are wired the way the mixin will be (callback in ``__init__``, the record after
``save_model``, the restore before ``train``) through a test subclass, so these tests hold before
and after the mixin takes the same three lines.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil

import pytest
import torch
from harness import adapter_state, pref_rows, randomise_lora_b, sft_rows, trainer_kwargs

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def _wired(base_cls):
    """``base_cls`` with the three deg.json integration points the mixin gets."""
    from deg_hf.trainers.records import DegCheckpointCallback, restore_from_checkpoint, write_checkpoint_files

    class Wired(base_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not any(isinstance(cb, DegCheckpointCallback) for cb in self.callback_handler.callbacks):
                self.add_callback(DegCheckpointCallback(self))

        def save_model(self, output_dir=None, _internal_call=False):
            super().save_model(output_dir, _internal_call)
            write_checkpoint_files(self, output_dir or self.args.output_dir, strict=not _internal_call)

        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            restore_from_checkpoint(self, resume_from_checkpoint)
            return super().train(resume_from_checkpoint, *args, **kwargs)

    Wired.__name__ = base_cls.__name__
    return Wired


def sft_trainer(path, out, *, stream=True, rows=8, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    args = StreamedSFTConfig(**trainer_kwargs(str(out), max_length=32, stream_layers=stream, **overrides))
    return _wired(StreamedSFTTrainer)(
        model=path,
        args=args,
        train_dataset=Dataset.from_list(sft_rows(rows)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _assert_no_local_path(record, *dirs):
    for text in _strings(record):
        assert not text.startswith(("/", "~")), text
        for d in dirs:
            assert os.path.abspath(str(d)) not in text, text
            assert os.path.realpath(str(d)) not in text, text


def _batch(rows=2, length=10, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(7, 40, (rows, length), generator=gen)


# ----------------------------------------------------------------------------- written at every save


def test_deg_json_at_every_save_and_at_the_end(checkpoint, tmp_path):
    from deg_hf.checkpoint import config_sha256, jsonable, read_deg_json

    path = checkpoint("llama")
    out = tmp_path / "run"
    trainer = sft_trainer(path, out, save_strategy="steps", save_steps=1, max_steps=2, max_grad_norm=math.inf)
    trainer.train()
    fingerprint = trainer.stream_runtime.store.fingerprint
    for step in (1, 2):
        ckpt = out / f"checkpoint-{step}"
        assert (ckpt / "adapter_model.safetensors").is_file()
        assert (ckpt / "deg.json").is_file() and (ckpt / "README.md").is_file()
        record = read_deg_json(ckpt)  # validates against the shipped schema
        assert record["task"] == "sft"
        assert record["metrics"]["global_step"] == step
        assert "loss" in record["metrics"]
        assert record["stream"]["enabled"] is True
        assert record["stream"]["store_fingerprint"] == fingerprint
        assert record["stream"]["stream_buffers"] == 2
        assert record["stream"]["layer_fetches"] > 0 and record["stream"]["bytes_moved"] > 0
        assert record["data"]["fingerprint"] and record["data"]["sizes"]["train"] == 8
        card = (ckpt / "README.md").read_text()
        assert "deg-hf" in card and "sft" in card
        _assert_no_local_path(record, tmp_path, path)
    # the step-2 record saw more layer traffic than the step-1 record
    first, second = read_deg_json(out / "checkpoint-1"), read_deg_json(out / "checkpoint-2")
    traffic = [r["stream"]["loads"] + r["stream"]["hits"] for r in (first, second)]
    assert traffic[1] > traffic[0] > 0

    trainer.save_model()
    record = read_deg_json(out)
    args = record["train_args"]
    assert args["learning_rate"] == 1e-2 and type(args["learning_rate"]) is float
    assert args["per_device_train_batch_size"] == 4 and args["max_steps"] == 2
    assert args["max_grad_norm"] == "inf"  # not JSON: written as str(value)
    assert args["lr_scheduler_type"] == "linear"
    assert args["output_dir"] == "<local>/run"
    assert "hub_token" not in args
    assert set(trainer.args.to_dict()) - {"hub_token", "push_to_hub_token"} <= set(args)
    for key, value in trainer.args.to_dict().items():  # every argument, exactly (JSON-converted)
        if key in ("hub_token", "push_to_hub_token"):
            assert key not in args
        elif key not in ("output_dir", "logging_dir"):  # local paths are redacted
            assert args[key] == jsonable(value), key
    assert record["metrics"]["train_loss"] == trainer.state.log_history[-1]["train_loss"]
    assert record["metrics"]["global_step"] == 2
    assert record["base_model"]["name_or_path"].startswith("<local>/")
    assert record["base_model"]["config_sha256"] == config_sha256(path)
    assert record["peft"]["r"] == 4 and record["peft"]["default_lora_applied"] is False
    planner = getattr(trainer, "deg_planner", None)
    if planner is None:
        assert record["memory"] is None or "planner_state" not in record["memory"]
    else:
        assert record["memory"]["planner_state"] == planner.state_dict()
        if planner.target_bytes >= 1 << 60:  # no target on CPU: recorded as such, not as 2**60 bytes
            assert record["memory"]["target"] == "unlimited" and record["memory"]["target_bytes"] is None
    assert (out / "README.md").is_file()
    _assert_no_local_path(record, tmp_path, path)
    on_disk = json.loads((out / "deg.json").read_text())
    assert on_disk == record
    trainer.release_stream()


def test_resident_run_records_streaming_off_and_only_the_main_process_writes(checkpoint, tmp_path):
    from deg_hf.checkpoint import read_deg_json
    from deg_hf.trainers.records import build_record, write_checkpoint_files

    trainer = sft_trainer(checkpoint("llama"), tmp_path, stream=False, max_steps=1)
    record = build_record(trainer, metrics={"custom": 1.5})
    assert record["stream"]["enabled"] is False and record["stream"]["stream_layers"] is False
    assert record["metrics"]["custom"] == 1.5
    trainer.is_world_process_zero = lambda: False
    assert write_checkpoint_files(trainer, tmp_path / "other") is None
    assert not (tmp_path / "other").exists()
    trainer.is_world_process_zero = lambda: True
    write_checkpoint_files(trainer, tmp_path / "main")
    assert read_deg_json(tmp_path / "main")["stream"]["enabled"] is False


def test_a_failing_record_is_logged_and_training_goes_on(checkpoint, tmp_path, monkeypatch, caplog):
    from deg_hf.trainers import records

    def broken(trainer, metrics=None):
        raise ValueError("record broke")

    monkeypatch.setattr(records, "build_record", broken)
    out = tmp_path / "run"
    trainer = sft_trainer(checkpoint("llama"), out, stream=False, save_strategy="steps", save_steps=1, max_steps=2)
    with caplog.at_level(logging.ERROR, logger="deg_hf.trainers.records"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert not (out / "checkpoint-2" / "deg.json").exists()
    # each checkpoint: once from the save_model hook, once from the callback
    assert caplog.text.count("could not write deg.json") >= 2 and "record broke" in caplog.text
    with pytest.raises(ValueError, match="record broke"):  # a save the user asked for does raise
        trainer.save_model()


# ----------------------------------------------------------------------------- round trip through load()


def test_train_save_load_gives_the_same_logits_resident_and_streamed(checkpoint, tmp_path):
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import deg_hf

    path = checkpoint("llama")
    trainer = sft_trainer(path, tmp_path / "run", max_steps=2)
    assert randomise_lora_b(trainer.model) > 0  # lora_B = 0 would make any adapter "load" trivially
    trainer.train()
    final = tmp_path / "run" / "final"
    trainer.save_model(str(final))
    ids = _batch()
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
        with trainer.model.disable_adapter():
            base_logits = trainer.model(input_ids=ids).logits
    assert (expected - base_logits).abs().max().item() > 1e-4  # the adapter is load-bearing
    trained = adapter_state(trainer.model)
    trainer.release_stream()

    saved = load_file(str(final / "adapter_model.safetensors"))
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), LoraConfig(**LORA))
    fresh_state = get_peft_model_state_dict(fresh)
    assert set(fresh_state) == set(saved)
    assert any(not torch.equal(fresh_state[k], saved[k]) for k in saved)

    for streamed in (False, True):
        model, tokenizer = deg_hf.load(final, streamed=streamed)
        runtime = getattr(model, "_deg_stream_runtime", None)
        assert (runtime is not None) == streamed
        if streamed:
            layers = model.get_base_model().model.layers
            assert all(p.is_meta for n, p in layers.named_parameters() if "lora_" not in n)
        loaded = get_peft_model_state_dict(model)
        assert set(loaded) == set(saved)
        for key, tensor in saved.items():
            assert torch.equal(loaded[key].cpu(), tensor), key
        state = adapter_state(model)
        assert state.keys() == trained.keys()
        for key in trained:
            assert torch.equal(state[key], trained[key]), key
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert (logits - expected).abs().max().item() == 0.0, streamed
        assert tokenizer("hello world")["input_ids"]
        if runtime is not None:
            assert runtime.stats()["loads"] > 0
            runtime.close()


def test_streamed_load_refuses_an_adapter_that_does_not_fit(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    import deg_hf
    from deg_hf.checkpoint import DegJsonError

    path = checkpoint("llama")
    trainer = sft_trainer(path, tmp_path / "run", max_steps=1)
    final = tmp_path / "final"
    trainer.save_model(str(final))
    trainer.release_stream()
    weights = load_file(str(final / "adapter_model.safetensors"))
    key = next(k for k in weights if "lora_A" in k)
    weights[key.replace("layers.0.", "layers.7.")] = weights[key].clone()
    save_file(weights, str(final / "adapter_model.safetensors"))
    with pytest.raises(DegJsonError, match="does not"):
        deg_hf.load(final, streamed=True)


def test_streamed_none_stays_resident_without_cuda(checkpoint, tmp_path, monkeypatch):
    import deg_hf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trainer = sft_trainer(checkpoint("llama"), tmp_path / "run", max_steps=1)
    trainer.save_model(str(tmp_path / "final"))
    trainer.release_stream()
    model, _ = deg_hf.load(tmp_path / "final")
    assert getattr(model, "_deg_stream_runtime", None) is None
    assert not any(p.is_meta for p in model.parameters())


def test_streamed_none_streams_when_the_weights_crowd_free_cuda_memory(checkpoint, monkeypatch):
    from deg_hf.checkpoint import STREAM_FREE_FRACTION, _should_stream, _weight_bytes

    path = checkpoint("llama")
    weights = _weight_bytes(path)
    assert weights == os.path.getsize(os.path.join(path, "model.safetensors"))
    free = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 1 << 40))
    free["bytes"] = 10 * weights
    assert not _should_stream(path, True, None, None)
    free["bytes"] = int(weights / STREAM_FREE_FRACTION) - 1
    assert _should_stream(path, True, None, None)
    assert _should_stream(path, True, None, "cuda:0")
    assert not _should_stream(path, True, None, "cpu")  # streaming to the CPU saves nothing
    assert not _should_stream(os.path.dirname(path), True, None, None)  # no safetensors: cannot stream


# ----------------------------------------------------------------------------- resume


def _planner(trainer, **kwargs):
    """The trainer's own planner when the mixin made one, else one made here (its absence is allowed)."""
    from deg_hf.memory.coef import GIB
    from deg_hf.memory.planner import MemPlanner

    planner = getattr(trainer, "deg_planner", None)
    if planner is None:
        planner = MemPlanner(8 * GIB, 1 * GIB, model_config=trainer.model.get_base_model().config, **kwargs)
        trainer.deg_planner = planner
    elif "scale" in kwargs:
        planner.load_state_dict({"scale": kwargs["scale"]})
    return planner


def _set_counters(trainer, **values):
    """Put counter totals on the trainer where it keeps them (the engine when the mixin has one)."""
    skipped = values.pop("skipped", [])
    engine = getattr(getattr(trainer, "deg_engine", None), "counters", None)
    if engine is not None:
        for key, value in values.items():
            setattr(engine, key, value)
        engine.skipped = list(skipped)
    else:
        trainer.deg_counters = {**values, "skipped": list(skipped)}


def test_restore_from_checkpoint_puts_planner_state_and_counters_back(checkpoint, tmp_path, caplog):
    from deg_hf.checkpoint import read_deg_json
    from deg_hf.trainers.records import restore_from_checkpoint

    path = checkpoint("llama")
    out = tmp_path / "run"
    # counters as a long run leaves them: 1 skip in 100 examples (under oom_max_skip_fraction)
    first = sft_trainer(path, out, stream=False, save_strategy="steps", save_steps=1, max_steps=1,
                        oom_max_skip_fraction=0.5)
    planner = _planner(first)
    planner.load_state_dict({"scale": 1.75, "window": [1.2, 1.6], "counters": {"observed": 2, "raised": 1}})
    _set_counters(first, parts=5, oom_retry=2, oom_skip=1, examples=100, skipped=["ex-17"])
    first.train()
    saved = planner.state_dict()
    record = read_deg_json(out / "checkpoint-1")
    memory = record["memory"]
    assert memory["planner_state"] == saved
    assert memory["scale"] == planner.scale >= 1.75
    assert memory["target_bytes"] == (planner.target_bytes if planner.target_bytes < 1 << 60 else None)
    assert memory["totals"]["parts"] >= 5 and memory["skipped_ids"][:1] == ["ex-17"]
    recorded_counters = dict(memory["totals"])

    second = sft_trainer(path, out, stream=False, max_steps=2)
    _planner(second)
    _set_counters(second, parts=0, oom_retry=0, oom_skip=0)
    assert second.deg_planner.scale == 1.0 and second.deg_planner.state_dict() != saved
    assert restore_from_checkpoint(second, True) is not None  # True: the last checkpoint in output_dir
    assert second.deg_planner.state_dict() == saved
    assert {k: second.deg_counters[k] for k in recorded_counters} == recorded_counters
    assert second.deg_counters["skipped"][:1] == ["ex-17"]

    # counters kept as a plain mapping, or not kept yet, are restored too
    for kept in ({"parts": 0, "oom_retry": 0, "oom_skip": 0, "skipped": []}, None):
        holder = type("Holder", (), {"args": second.args, "deg_task": "sft"})()
        if kept is not None:
            holder.deg_counters = kept
        restore_from_checkpoint(holder, out / "checkpoint-1")
        assert {k: holder.deg_counters[k] for k in recorded_counters} == recorded_counters
        if kept is not None:
            assert holder.deg_counters is kept

    # a checkpoint without deg.json: no-op, with a warning
    bare = tmp_path / "bare"
    shutil.copytree(out / "checkpoint-1", bare)
    (bare / "deg.json").unlink()
    second.deg_planner = None
    fresh = _planner(second)
    with caplog.at_level(logging.WARNING, logger="deg_hf.trainers.records"):
        assert restore_from_checkpoint(second, bare) is None
    assert "has no deg.json" in caplog.text
    assert fresh.scale == 1.0 and fresh.state_dict()["window"] == []
    assert restore_from_checkpoint(second, None) is None and restore_from_checkpoint(second, False) is None

    # a planner state that does not load: a warning, the planner untouched, the counters still restored
    broken = tmp_path / "broken"
    shutil.copytree(out / "checkpoint-1", broken)
    data = json.loads((broken / "deg.json").read_text())
    data["memory"]["planner_state"]["scale"] = -1
    (broken / "deg.json").write_text(json.dumps(data))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deg_hf.trainers.records"):
        assert restore_from_checkpoint(second, broken) is not None
    assert "cannot be restored" in caplog.text and fresh.scale == 1.0
    assert {k: second.deg_counters[k] for k in recorded_counters} == recorded_counters


def test_resume_through_train_restores_then_continues(checkpoint, tmp_path):
    from deg_hf.checkpoint import read_deg_json

    path = checkpoint("llama")
    out = tmp_path / "run"
    first = sft_trainer(path, out, stream=False, save_strategy="steps", save_steps=1, max_steps=1)
    _planner(first, scale=1.4)
    _set_counters(first, parts=3, oom_retry=1, oom_skip=0)
    first.train()

    second = sft_trainer(path, out, stream=False, save_strategy="steps", save_steps=1, max_steps=2)
    assert _planner(second).scale == 1.0
    _set_counters(second, parts=0, oom_retry=0, oom_skip=0)
    second.train(resume_from_checkpoint=True)
    assert second.state.global_step == 2
    record = read_deg_json(out / "checkpoint-2")
    assert record["memory"]["scale"] >= 1.4
    assert record["memory"]["totals"]["parts"] >= 3 and record["memory"]["totals"]["oom_retry"] >= 1


# ----------------------------------------------------------------------------- a preference task


def test_dpo_checkpoints_record_the_dpo_task(checkpoint, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedDPOConfig, StreamedDPOTrainer
    from deg_hf.checkpoint import read_deg_json

    path = checkpoint("llama")
    out = tmp_path / "dpo"
    trainer = _wired(StreamedDPOTrainer)(
        model=path,
        args=StreamedDPOConfig(**trainer_kwargs(str(out), max_length=32, save_strategy="steps", save_steps=1,
                                                max_steps=1)),
        train_dataset=Dataset.from_list(pref_rows(8)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )
    trainer.train()
    trainer.save_model()
    for directory in (out / "checkpoint-1", out):
        record = read_deg_json(directory)
        assert record["task"] == "dpo"
        assert record["train_args"]["beta"] == trainer.args.beta
        assert record["stream"]["enabled"] is True
        assert any(k.startswith("rewards/") for k in record["metrics"])
        assert "dpo" in (directory / "README.md").read_text()
    trainer.release_stream()


# ----------------------------------------------------------------------------- a Hub base model


def test_hub_base_is_hashed_from_the_cached_config_and_its_snapshot_commit(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import huggingface_hub

    from deg_hf.checkpoint import config_sha256
    from deg_hf.trainers.record_sections import base_model_section

    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    config = SimpleNamespace(_commit_hash=None, _name_or_path="org/tiny", to_dict=lambda: {"other": 1})
    base = SimpleNamespace(name_or_path="org/tiny", config=config)
    trainer = SimpleNamespace(model=base, args=SimpleNamespace(model_init_kwargs=None), stream_runtime=None)
    asked = []

    def cached(repo_id, filename, revision=None, **kwargs):
        asked.append((repo_id, filename))
        return str(snapshot / filename)

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", cached)
    section = base_model_section(trainer)
    assert asked == [("org/tiny", "config.json")]
    assert section == {"name_or_path": "org/tiny", "revision": commit, "config_sha256": config_sha256(snapshot),
                       "quantization": None}

    # streamed: the weight store's directory is the snapshot; the Hub cache is not asked
    asked.clear()
    trainer.stream_runtime = SimpleNamespace(store=SimpleNamespace(directory=str(snapshot)))
    assert base_model_section(trainer) == section and asked == []

    # nothing on disk: the loaded config is hashed, and its commit is used when it has one
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *a, **k: None)
    trainer.stream_runtime = None
    config._commit_hash = commit
    assert base_model_section(trainer) == {
        "name_or_path": "org/tiny", "revision": commit, "config_sha256": config_sha256({"other": 1}),
        "quantization": None,
    }
