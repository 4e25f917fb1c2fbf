"""A catalogue of bad inputs: configs, model files, deg.json, datasets, resumes and pushes.

Every case asserts the exception type, that the message names the offending field or file, and that
nothing was written where the case would write: a trainer's output_dir does not exist afterwards, a
checkpoint directory that was read or pushed is byte-identical before and after.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import pytest
from harness import sft_rows, trainer_kwargs
from test_hub import FAKE_TOKEN, _record, _safetensors, hub  # noqa: F401  (hub: the HfApi-intercepting fixture)


@dataclass
class Case:
    name: str
    run: Callable  # run(env) raises
    error: type
    names: str  # what the message must name (the field or file)


class Env:
    """What a case needs: a tiny model to copy and break, a scratch directory, the output_dir it must
    leave alone, and the directories whose bytes must not change."""

    def __init__(self, model: str, tmp: Path):
        self.model, self.tmp, self.out = model, tmp, tmp / "out"
        self.watched: dict[Path, dict] = {}

    def broken_model(self, edit) -> str:
        directory = self.tmp / "model"
        shutil.copytree(self.model, directory)
        edit(directory)
        return str(directory)

    def watch(self, directory: Path) -> Path:
        """Remember ``directory``'s bytes as the case made them: the refusal must leave them so."""
        self.watched[directory] = snapshot(directory)
        return directory


def snapshot(directory: Path) -> dict:
    return {str(p.relative_to(directory)): (p.is_symlink(), hashlib.sha256(p.read_bytes()).hexdigest()
                                            if p.is_file() else None)
            for p in sorted(directory.rglob("*"))}


# ----------------------------------------------------------------------------- builders


def sft(env: Env, model: str | None = None, dataset=None, **config):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    model = model or env.model
    quantization_config = config.pop("trainer_quantization_config", None)
    args = StreamedSFTConfig(**trainer_kwargs(str(env.out), **{"max_length": 32, **config}))
    extra = {"quantization_config": quantization_config} if quantization_config is not None else {}
    return StreamedSFTTrainer(model=model, args=args,
                              train_dataset=dataset if dataset is not None else Dataset.from_list(sft_rows(4)),
                              processing_class=AutoTokenizer.from_pretrained(env.model), **extra)


def config_case(name, field, value, **more):
    return Case(f"config-{name}", lambda env: sft(env, **{field: value, **more}), ValueError, field)


def init_kwargs_case(name, kwargs, names, **more):
    return Case(f"model_init_kwargs-{name}", lambda env: sft(env, model_init_kwargs=kwargs, **more), ValueError, names)


def model_case(name, edit, names):
    return Case(f"model-{name}", lambda env: sft(env, model=env.broken_model(edit)), ValueError, names)


def _truncate(directory: Path) -> None:
    path = directory / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-64])


def _corrupt_header(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{["
    path.write_bytes(bytes(data))


def _edit_config(**changes):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))
    return edit


def _missing_shard(directory: Path) -> None:
    header = json.loads((directory / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (directory / "model.safetensors").read_bytes()[:8], "little")])
    weight_map = {k: "model-00001-of-00002.safetensors" for k in header if k != "__metadata__"}
    weight_map[next(iter(weight_map))] = "model-00002-of-00002.safetensors"
    os.rename(directory / "model.safetensors", directory / "model-00001-of-00002.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _save_other(kind: str):
    def run(env: Env):
        import transformers

        directory = env.tmp / kind
        if kind == "t5":
            cfg = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=64)
            transformers.T5ForConditionalGeneration(cfg).save_pretrained(directory)
        else:
            cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, vocab_size=64)
            transformers.BertForMaskedLM(cfg).save_pretrained(directory)
        return directory
    return run


def plan_cli(env: Env, model: str):
    from deg_hf import plan_cli as module

    class Args:
        task, batch, max_length, vram, lora_r = "dpo", 4, 2048, 8.0, 16

    Args.model = model
    module.run(Args)


# deg.json and checkpoints


def deg_checkpoint(env: Env, edit=None) -> Path:
    from deg_hf.checkpoint import write_deg_json

    ckpt = env.tmp / "ckpt" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    _safetensors(ckpt / "adapter_model.safetensors")
    (ckpt / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny-org/tiny-llama",
                                                          "peft_type": "LORA", "r": 8}))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (ckpt / "train.log.jsonl").write_text('{"step": 1, "loss": 0.69}\n')
    write_deg_json(ckpt, _record(env.tmp))
    if edit is not None:
        edit(ckpt)
    return env.watch(ckpt)


def _deg_json(**changes):
    def edit(ckpt: Path) -> None:
        record = json.loads((ckpt / "deg.json").read_text())
        record.update(changes)
        (ckpt / "deg.json").write_text(json.dumps(record))
    return edit


def read(env: Env, edit):
    from deg_hf.checkpoint import read_deg_json

    read_deg_json(deg_checkpoint(env, edit))


def push(env: Env, edit):
    from deg_hf.hub import push_checkpoint

    push_checkpoint(deg_checkpoint(env, edit), "me/tiny-dpo")


def partial_resume(env: Env):
    """A checkpoint-N left half-written by an older deg_hf (no optimizer.pt), resumed by path."""
    trainer = sft(env, stream_layers=False, max_steps=1)
    partial = env.tmp / "old-run" / "checkpoint-3"
    partial.mkdir(parents=True)
    (partial / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    shutil.copy(Path(env.model) / "model.safetensors", partial / "adapter_model.safetensors")
    env.watch(partial)
    trainer.train(resume_from_checkpoint=str(partial))


def longest_row_too_long(env: Env):
    """max_length=None: the pre-flight takes the longest tokenised row, which cannot fit the target."""
    from datasets import Dataset

    from deg_hf.memory.coef import GIB

    rows = sft_rows(6)
    rows[4]["messages"][1]["content"] = " ".join(["good answer please thanks"] * 40)
    fits = sft(env, dataset=Dataset.from_list(rows), max_length=None, mem_target_gb=64.0, stream_layers=False)
    tight = (fits.deg_preflight["smallest_unit_bytes"] - 1) / GIB  # just below what the longest row needs
    sft(env, dataset=Dataset.from_list(rows), max_length=None, mem_target_gb=tight, stream_layers=False)


def kto_one(env: Env):
    from deg_hf import StreamedKTOConfig

    StreamedKTOConfig(**trainer_kwargs(str(env.out), per_device_train_batch_size=1))


def network_down(env: Env, monkeypatch):
    import httpx2

    def refuse(self, *args, **kwargs):
        raise httpx2.ConnectError("[Errno 111] Connection refused")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", refuse)
    push(env, None)


def _outward_symlink(ckpt: Path) -> None:
    secret = ckpt.parent.parent / "elsewhere" / "tokenizer.json"
    secret.parent.mkdir()
    secret.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {}}}))
    os.symlink(secret, ckpt / "tokenizer.json")


def _log_line(ckpt: Path, text: str) -> None:
    with (ckpt / "train.log.jsonl").open("a") as log:
        log.write(json.dumps({"event": "note", "message": text}) + "\n")


CASES = [
    # stream and memory settings: one validator, naming the field
    config_case("stream_buffers-str", "stream_buffers", "3"),
    config_case("stream_buffers-float", "stream_buffers", 1.5),
    config_case("stream_buffers-zero", "stream_buffers", 0),
    config_case("stream_buffers-bool", "stream_buffers", True),
    config_case("mem_target_gb-str", "mem_target_gb", "abc"),
    config_case("mem_target_gb-inf", "mem_target_gb", math.inf),
    config_case("mem_target_gb-nan", "mem_target_gb", math.nan),
    config_case("mem_target_gb-negative", "mem_target_gb", -2.0),
    config_case("oom_max_splits-negative", "oom_max_splits", -1),
    config_case("oom_max_skip_fraction-above-1", "oom_max_skip_fraction", 1.5),
    config_case("oom_max_skip_fraction-str", "oom_max_skip_fraction", "0.1"),
    config_case("stream_layers-str", "stream_layers", "yes"),
    config_case("stream_quantization", "stream_quantization", "int3"),
    config_case("stream_quant_blocksize", "stream_quant_blocksize", 100),
    Case("config-mem_coef_file-missing", lambda env: sft(env, mem_coef_file=str(env.tmp / "coef.json")),
         ValueError, "mem_coef_file"),
    Case("config-mem_coef_file-not-json",
         lambda env: (env.tmp.joinpath("coef.json").write_text("{nope"), sft(env, mem_coef_file=str(env.tmp / "coef.json"))),
         ValueError, "mem_coef_file"),
    Case("config-stream_cache_dir-a-file",
         lambda env: (env.tmp.joinpath("cache").write_text(""), sft(env, stream_cache_dir=str(env.tmp / "cache"))),
         ValueError, "stream_cache_dir"),
    Case("config-kto-batch-1", kto_one, ValueError, "per_device_train_batch_size"),
    # model_init_kwargs under streaming: honoured, or refused by name
    init_kwargs_case("device_map", {"device_map": "auto"}, "device_map"),
    init_kwargs_case("unknown-key", {"use_flash_magic": True}, "use_flash_magic"),
    init_kwargs_case("trust_remote_code", {"trust_remote_code": True}, "trust_remote_code"),
    init_kwargs_case("bad-dtype", {"dtype": "bf16"}, "dtype"),
    init_kwargs_case("8-bit", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}},
                     "quantization_config"),
    init_kwargs_case("gptq", {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantization_config"),
    Case("trainer-quantization_config-argument",
         lambda env: sft(env, trainer_quantization_config={"load_in_4bit": True}), ValueError, "quantization_config"),
    # model files, checked before any weight is read
    model_case("truncated-safetensors", _truncate, "model.safetensors"),
    model_case("corrupt-header", _corrupt_header, "model.safetensors"),
    model_case("missing-shard", _missing_shard, "model-00002-of-00002.safetensors"),
    model_case("shape-mismatch", _edit_config(intermediate_size=48), "model.layers.0.mlp.gate_proj.weight"),
    model_case("fewer-layers-than-weights", _edit_config(num_hidden_layers=1), "num_hidden_layers=1"),
    Case("model-t5", lambda env: sft(env, model=str(_save_other("t5")(env))), ValueError, "not a decoder-only causal LM"),
    Case("model-bert-resident", lambda env: sft(env, model=str(_save_other("bert")(env)), stream_layers=False),
         ValueError, "not a decoder-only causal LM"),
    Case("plan-t5", lambda env: plan_cli(env, str(_save_other("t5")(env))), ValueError, "not a decoder-only causal LM"),
    # deg.json
    Case("deg.json-corrupt", lambda env: read(env, lambda c: (c / "deg.json").write_text('{"task": "dpo",')),
         ValueError, "deg.json"),
    Case("deg.json-future-format", lambda env: read(env, _deg_json(format_version=2)), ValueError, "format_version"),
    Case("deg.json-task-type", lambda env: read(env, _deg_json(task=5)), ValueError, "task"),
    Case("deg.json-missing-field", lambda env: read(env, lambda c: _deg_json()(c) or (
        c / "deg.json").write_text(json.dumps({k: v for k, v in json.loads((c / "deg.json").read_text()).items()
                                               if k != "peft"}))), ValueError, "peft"),
    # datasets and resumes
    Case("dataset-longest-row-too-long", longest_row_too_long, ValueError, "dataset row 4"),
    Case("resume-from-a-partial-checkpoint", partial_resume, ValueError, "optimizer.pt"),
    # push: refused before any remote call, nothing changed
    Case("push-absolute-path-in-log", lambda env: push(env, lambda c: _log_line(c, "saved to /scratch/alice/run7")),
         ValueError, "train.log.jsonl"),
    Case("push-absolute-path-in-tokenizer-config", lambda env: push(env, lambda c: (c / "tokenizer_config.json").write_text(
        json.dumps({"name_or_path": "/data/models/llama-7b"}))), ValueError, "tokenizer_config.json"),
    Case("push-outward-symlink", lambda env: push(env, _outward_symlink), ValueError, "tokenizer.json"),
    Case("push-token-in-log", lambda env: push(env, lambda c: _log_line(c, FAKE_TOKEN)), ValueError, "train.log.jsonl"),
    Case("push-no-deg.json", lambda env: push(env, lambda c: (c / "deg.json").unlink()), ValueError, "deg.json"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_by_name_and_writes_nothing(case, checkpoint, tmp_path, hub, monkeypatch):  # noqa: F811
    env = Env(checkpoint("llama"), tmp_path)
    with pytest.raises(case.error) as info:
        case.run(env)
    message = str(info.value)
    assert case.names in message, message
    assert "Traceback" not in message
    assert not env.out.exists() or not any(env.out.iterdir()), sorted(os.listdir(env.out))
    for directory, before in env.watched.items():
        assert snapshot(directory) == before, directory
    assert hub["calls"] == []  # no remote call


def test_the_catalogue_is_complete_enough():
    assert len(CASES) >= 30
    assert {c.name.split("-")[0] for c in CASES} >= {"config", "model", "deg.json", "dataset", "push", "resume"}


@pytest.mark.parametrize("edit", [
    lambda c: _log_line(c, "saved to /scratch/alice/run7"),
    _outward_symlink,
], ids=["absolute-path", "outward-symlink"])
def test_push_refusals_leave_the_checkpoint_byte_identical(edit, checkpoint, tmp_path, hub):  # noqa: F811
    from deg_hf.hub import push_checkpoint

    env = Env(checkpoint("llama"), tmp_path)
    ckpt = deg_checkpoint(env, edit)
    before = snapshot(ckpt)
    with pytest.raises(ValueError, match="nothing was sent or changed"):
        push_checkpoint(ckpt, "me/tiny-dpo")
    assert snapshot(ckpt) == before and hub["calls"] == []
    # control: the same checkpoint without the bad file pushes, and still is not written to
    (ckpt / "tokenizer.json").unlink(missing_ok=True)
    (ckpt / "train.log.jsonl").write_text('{"step": 1}\n')
    before = snapshot(ckpt)
    push_checkpoint(ckpt, "me/tiny-dpo")
    assert snapshot(ckpt) == before and "README.md" in hub["uploaded"] and not (ckpt / "README.md").exists()


def test_a_network_failure_is_one_line_naming_the_endpoint(checkpoint, tmp_path, hub, monkeypatch, capsys):  # noqa: F811
    from deg_hf.cli import main
    from deg_hf.hub import HubUnreachableError

    env = Env(checkpoint("llama"), tmp_path)
    with pytest.raises(HubUnreachableError) as info:
        network_down(env, monkeypatch)
    assert "https://huggingface.co" in str(info.value) and "HF_ENDPOINT" in str(info.value)
    ckpt = env.tmp / "ckpt" / "checkpoint-10"
    assert main(["push", str(ckpt), "me/tiny-dpo"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "HF_ENDPOINT" in err[0] and "Traceback" not in err[0]


def test_info_offline_says_offline(monkeypatch, capsys):
    from huggingface_hub.errors import LocalEntryNotFoundError

    from deg_hf.cli import main

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("cannot find the requested files in the local cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert main(["info", "someone/tiny-dpo"]) == 1
    err = capsys.readouterr().err
    assert "cannot be reached" in err or "offline" in err
    assert "has no deg.json" not in err
