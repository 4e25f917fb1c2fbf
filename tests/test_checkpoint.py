"""deg.json: record, schema, redaction, read errors and the resident load() round trip."""

from __future__ import annotations

import enum
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from deg_hf.checkpoint import (
    DEG_JSON,
    FORMAT_VERSION,
    DegJsonError,
    check_checkpoint,
    config_sha256,
    jsonable,
    load,
    load_schema,
    make_record,
    read_deg_json,
    summarize,
    validate_record,
    write_deg_json,
)

FAKE_TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWxYz01234567"  # the shape of a Hub token, not a real one


class Color(enum.Enum):
    RED = "red"


class Strategy(str, enum.Enum):
    NO = "no"


def _record(**overrides):
    kwargs = dict(
        task="dpo",
        base_model={"name_or_path": "tiny-org/tiny-llama", "revision": "0123abcd", "config_sha256": "a" * 64},
        peft={"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "target_modules": {"v_proj", "q_proj"}},
        train_args={
            "learning_rate": 5e-6,
            "num_train_epochs": 1.0,
            "max_steps": -1,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 8,
        },
        stream={"enabled": True, "prefetch": 2, "store_fingerprint": "f" * 16, "layer_fetches": 96},
        memory={
            "target_bytes": 8 * 1024**3,
            "coefficients": {"a": 1.5, "b": 2048},
            "scale": 1.0,
            "totals": {"parts": 12, "oom_retry": 1, "oom_skip": 1},
            "skipped_ids": [17],
        },
        data={"name_or_path": "trl-lib/ultrafeedback_binarized", "fingerprint": "1234abcd", "sizes": {"train": 64, "eval": 8}},
        metrics={"train_loss": 0.6931, "rewards/accuracies": 0.75},
        default_lora_applied=True,
    )
    kwargs.update(overrides)
    return make_record(**kwargs)


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _strings(item)


# ---------------------------------------------------------------------------------------------------
# record and schema
# ---------------------------------------------------------------------------------------------------


def test_record_validates_against_the_shipped_schema():
    jsonschema = pytest.importorskip("jsonschema")
    record = _record()
    jsonschema.Draft202012Validator.check_schema(load_schema())
    jsonschema.Draft202012Validator(load_schema()).validate(record)
    assert record["format_version"] == FORMAT_VERSION == 1
    assert record["task"] == "dpo"
    assert record["base_model"] == {"name_or_path": "tiny-org/tiny-llama", "revision": "0123abcd", "config_sha256": "a" * 64}
    assert record["peft"] == {
        "type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "target_modules": ["q_proj", "v_proj"],
        "default_lora_applied": True,
    }
    assert set(record["versions"]) >= {"torch", "transformers", "trl", "peft", "accelerate", "deg_hf"}
    assert record["versions"]["deg_hf"] == record["deg_hf_version"]
    assert record["created_at"].endswith("Z")
    json.dumps(record, allow_nan=False)  # strict JSON


def test_make_record_does_not_import_the_training_stack():
    code = (
        "import sys; from deg_hf.checkpoint import make_record, summarize;"
        "r = make_record(task='sft', base_model={'name_or_path': 'a/b'}, peft={'r': 4}, train_args={},"
        " stream=None, memory=None, data=None, metrics=None, default_lora_applied=False); summarize(r);"
        "print(sorted(m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules))"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_train_args_stringification_is_exact():
    args = {
        "lr": 1e-4,
        "steps": 10,
        "flag": True,
        "name": "run-1",
        "nothing": None,
        "color": Color.RED,
        "strategy": Strategy.NO,
        "path": Path("outputs/run"),
        "inf": float("inf"),
        "ninf": float("-inf"),
        "nan": float("nan"),
        "pair": (1, 2),
        "nested": {"a": [1, 2.5, Path("x/y"), Color.RED], "b": {"c": float("inf")}, 3: "int key"},
    }
    record = _record(train_args=args)
    assert record["train_args"] == {
        "lr": 1e-4,
        "steps": 10,
        "flag": True,
        "name": "run-1",
        "nothing": None,
        "color": "Color.RED",
        "strategy": str(Strategy.NO),
        "path": "outputs/run",
        "inf": "inf",
        "ninf": "-inf",
        "nan": "nan",
        "pair": [1, 2],
        "nested": {"a": [1, 2.5, "x/y", "Color.RED"], "b": {"c": "inf"}, "3": "int key"},
    }
    assert type(record["train_args"]["lr"]) is float
    assert type(record["train_args"]["steps"]) is int
    assert type(record["train_args"]["flag"]) is bool
    assert jsonable({"s": {2, 1}}) == {"s": [1, 2]}


def test_training_arguments_dataclass_is_recorded_whole(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), hub_token=FAKE_TOKEN, report_to=[], learning_rate=3e-4)
    record = _record(train_args=args)
    path = write_deg_json(tmp_path / "ckpt", record)
    written = read_deg_json(path)["train_args"]
    assert written["learning_rate"] == 3e-4
    assert "hub_token" not in written and "push_to_hub_token" not in written
    assert written["output_dir"] == "<local>/out"
    assert "save_strategy" in written and isinstance(written["save_strategy"], str)
    text = path.read_text()
    assert FAKE_TOKEN not in text and str(tmp_path) not in text


def test_written_deg_json_has_no_absolute_path_and_no_token(tmp_path):
    home = os.path.expanduser("~")
    ckpt = tmp_path / "outputs" / "run" / "checkpoint-10"
    args = {
        "output_dir": str(tmp_path / "outputs" / "run"),
        "logging_dir": tmp_path / "outputs" / "run" / "logs",
        "resume_from_checkpoint": os.path.join(home, "runs", "old", "checkpoint-5"),
        "dataset_path": "~/data/prefs.jsonl",
        "command": f"train.py --out {ckpt} --cache={home}/.cache/x",
        "hub_token": FAKE_TOKEN,
        "push_to_hub_token": FAKE_TOKEN,
        "api_token": "secret-value",
        "run_name": f"run-{FAKE_TOKEN}",
        "report_to": ["none"],
        "pad_token": "<pad>",
        "include_num_input_tokens_seen": True,
    }
    record = _record(
        base_model={"name_or_path": str(tmp_path / "models" / "base"), "revision": None, "config_sha256": None},
        train_args=args,
        data={"name_or_path": str(tmp_path / "data" / "train.jsonl"), "fingerprint": None, "sizes": {"train": 3}},
    )
    path = write_deg_json(ckpt, record)
    text = path.read_text(encoding="utf-8")
    assert FAKE_TOKEN not in text and not re.search(r"hf_[A-Za-z0-9]{20,}", text)
    assert str(tmp_path) not in text
    if home not in ("/", "~"):
        assert home not in text
    written = json.loads(text)
    for value in _strings(written):
        assert not os.path.isabs(value), value
        assert not value.startswith("~"), value
    train = written["train_args"]
    assert "hub_token" not in train and "push_to_hub_token" not in train
    assert train["api_token"] == "<redacted>"
    assert train["run_name"] == "run-<redacted>"
    assert train["output_dir"] == "<local>/run"
    assert train["logging_dir"] == "<local>/logs"
    assert train["resume_from_checkpoint"] == "<local>/checkpoint-5"
    assert train["dataset_path"] == "<local>/prefs.jsonl"
    assert train["command"] == "train.py --out <local>/checkpoint-10 --cache=<local>/x"
    assert train["pad_token"] == "<pad>"
    assert train["include_num_input_tokens_seen"] is True
    assert written["base_model"]["name_or_path"] == "<local>/base"
    assert written["data"]["name_or_path"] == "<local>/train.jsonl"
    # atomic write: no temporary file left behind
    assert sorted(p.name for p in ckpt.iterdir()) == [DEG_JSON]


def test_paths_under_the_working_directory_become_relative(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    record = _record(train_args={"output_dir": str(tmp_path / "outputs" / "run"), "here": str(tmp_path)})
    path = write_deg_json(tmp_path / "outputs" / "run" / "checkpoint-1", record)
    train = json.loads(path.read_text())["train_args"]
    assert train["output_dir"] == "outputs/run"
    assert train["here"] == "."


def test_config_sha256_is_canonical(tmp_path):
    config = {"model_type": "llama", "hidden_size": 32, "rope": {"b": 1, "a": 2}}
    (tmp_path / "config.json").write_text(json.dumps({**config, "transformers_version": "5.0.0"}, indent=4))
    digest = config_sha256(tmp_path)
    assert len(digest) == 64
    assert digest == config_sha256(tmp_path / "config.json")
    assert digest == config_sha256(dict(reversed(list(config.items()))))
    assert digest != config_sha256({**config, "hidden_size": 64})


# ---------------------------------------------------------------------------------------------------
# reading: every way a deg.json can be wrong
# ---------------------------------------------------------------------------------------------------


def _write_raw(directory: Path, content: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DEG_JSON).write_text(content, encoding="utf-8")
    return directory


def test_round_trip_and_summary(tmp_path):
    record = _record()
    write_deg_json(tmp_path, record)
    assert read_deg_json(tmp_path) == record
    assert read_deg_json(tmp_path / DEG_JSON) == record
    text = summarize(record)
    for expected in (
        "task:        dpo",
        "tiny-org/tiny-llama @ 0123abcd",
        "LORA r=8 alpha=16 dropout=0.05 targets=q_proj, v_proj",
        "trl-lib/ultrafeedback_binarized",
        "learning rate 5e-06",
        "epochs 1",
        "batch per device 2",
        "gradient accumulation 8",
        "target 8.00 GiB",
        "OOM retries 1",
        "OOM skips 1",
        "skipped examples [17]",
        "on, 96 layer fetches",
        "train_loss 0.6931",
        "deg_hf 0.1.0",
        record["created_at"],
    ):
        assert expected in text, expected


def test_missing_deg_json(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    with pytest.raises(DegJsonError, match=r"has no deg\.json: it was not saved by deg_hf, or") as info:
        read_deg_json(tmp_path)
    assert "adapter_model.safetensors" in str(info.value)
    with pytest.raises(DegJsonError, match="does not exist"):
        read_deg_json(tmp_path / "nope")


def test_corrupt_deg_json_names_line_and_column(tmp_path):
    _write_raw(tmp_path, '{\n  "format_version": 1,\n  "task": ,\n}')
    with pytest.raises(DegJsonError, match=r"not valid JSON: .* at line 3, column 11"):
        read_deg_json(tmp_path)


def test_unknown_format_version(tmp_path):
    record = _record()
    record["format_version"] = 99
    _write_raw(tmp_path, json.dumps(record))
    with pytest.raises(DegJsonError) as info:
        read_deg_json(tmp_path)
    message = str(info.value)
    assert "format_version 99" in message
    assert "reads format version(s) 1" in message
    assert "upgrade deg_hf" in message


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.update(task="ppo"), "'task'"),
        (lambda r: r["base_model"].pop("config_sha256"), "'base_model.config_sha256'"),
        (lambda r: r["peft"].update(r="eight"), "'peft.r'"),
        (lambda r: r["memory"]["totals"].update(oom_retry=-1), "'memory.totals.oom_retry'"),
        (lambda r: r.pop("versions"), "'versions'"),
        (lambda r: r.update(created_at="yesterday"), "'created_at'"),
    ],
)
def test_schema_violation_names_the_field(tmp_path, mutate, field):
    record = _record()
    mutate(record)
    _write_raw(tmp_path, json.dumps(record))
    with pytest.raises(DegJsonError, match="does not match the deg.json schema") as info:
        read_deg_json(tmp_path)
    assert field in str(info.value)


def test_schema_check_without_jsonschema(monkeypatch):
    monkeypatch.setitem(sys.modules, "jsonschema", None)  # as if it were not installed
    record = _record()
    validate_record(record)
    record["task"] = "ppo"
    with pytest.raises(DegJsonError, match="'task'"):
        validate_record(record)


def test_invalid_record_is_not_written(tmp_path):
    record = _record()
    del record["versions"]
    with pytest.raises(DegJsonError, match="'versions'"):
        write_deg_json(tmp_path, record)
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_without_adapter_weights(tmp_path):
    write_deg_json(tmp_path, _record())
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(DegJsonError, match="has no adapter weights") as info:
        check_checkpoint(tmp_path)
    assert "adapter_config.json" in str(info.value) and DEG_JSON in str(info.value)
    (tmp_path / "adapter_model.bin").write_bytes(b"x")
    assert check_checkpoint(tmp_path).name == "adapter_model.bin"


# ---------------------------------------------------------------------------------------------------
# load(): resident round trip on a tiny real Llama + LoRA
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    torch = pytest.importorskip("torch")
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("load")
    base_dir, ckpt_dir = root / "base", root / "run" / "checkpoint-1"
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(base_dir)
    base = LlamaForCausalLM.from_pretrained(base_dir)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    with torch.no_grad():  # lora_B starts at zero: randomise it so the adapter changes the logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.eval()
    model.save_pretrained(ckpt_dir)

    vocab = {"<unk>": 0, "<pad>": 1, **{f"w{i}": i for i in range(2, 64)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>").save_pretrained(ckpt_dir)

    record = make_record(
        task="sft",
        base_model={"name_or_path": str(base_dir), "revision": None, "config_sha256": config_sha256(base_dir)},
        peft=lora,
        train_args={"learning_rate": 1e-3, "output_dir": str(ckpt_dir.parent)},
        stream=None,
        memory=None,
        data=None,
        metrics=None,
        default_lora_applied=False,
    )
    write_deg_json(ckpt_dir, record)
    input_ids = torch.tensor([[2, 5, 9, 33, 63, 1, 17]])
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits
        plain = model.get_base_model()
        with model.disable_adapter():
            base_logits = plain(input_ids=input_ids).logits
    assert (expected - base_logits).abs().max() > 1e-3  # the adapter matters
    return {"base": base_dir, "ckpt": ckpt_dir, "input_ids": input_ids, "expected": expected}


def test_load_gives_the_same_logits(tiny_checkpoint):
    import torch

    record = read_deg_json(tiny_checkpoint["ckpt"])
    assert record["base_model"]["name_or_path"] == "<local>/base"  # the local path is not recorded
    assert record["peft"]["target_modules"] == ["q_proj", "v_proj"]
    model, tokenizer = load(tiny_checkpoint["ckpt"])
    with torch.no_grad():
        logits = model(input_ids=tiny_checkpoint["input_ids"]).logits
    assert (logits - tiny_checkpoint["expected"]).abs().max().item() == 0.0
    assert tokenizer("w2 w5")["input_ids"] == [2, 5]


def test_load_refuses_a_base_with_another_config(tiny_checkpoint, tmp_path):
    import torch

    changed = tmp_path / "base-changed"
    shutil.copytree(tiny_checkpoint["base"], changed)
    config = json.loads((changed / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (changed / "config.json").write_text(json.dumps(config))
    with pytest.raises(DegJsonError, match="trust_config_mismatch=True"):
        load(tiny_checkpoint["ckpt"], base_model=changed)
    model, _ = load(tiny_checkpoint["ckpt"], base_model=changed, trust_config_mismatch=True)
    assert model.get_base_model().config.rms_norm_eps == 1e-3
    with torch.no_grad():
        logits = model(input_ids=tiny_checkpoint["input_ids"]).logits
    assert logits.shape == tiny_checkpoint["expected"].shape
    # the untouched base passes through the same override
    same, _ = load(tiny_checkpoint["ckpt"], base_model=tiny_checkpoint["base"])
    with torch.no_grad():
        assert (same(input_ids=tiny_checkpoint["input_ids"]).logits - tiny_checkpoint["expected"]).abs().max() == 0


def test_load_accepts_a_base_config_rewritten_in_another_layout(tiny_checkpoint, tmp_path):
    import torch

    rewritten = tmp_path / "base-rewritten"
    shutil.copytree(tiny_checkpoint["base"], rewritten)
    config = json.loads((rewritten / "config.json").read_text())
    config["transformers_version"] = "5.99.0"
    (rewritten / "config.json").write_text(json.dumps(dict(reversed(list(config.items()))), indent=1))
    model, _ = load(tiny_checkpoint["ckpt"], base_model=rewritten)
    with torch.no_grad():
        assert (model(input_ids=tiny_checkpoint["input_ids"]).logits - tiny_checkpoint["expected"]).abs().max() == 0


def test_load_asks_for_a_base_it_cannot_find(tiny_checkpoint, tmp_path):
    moved = tmp_path / "checkpoint-moved"
    shutil.copytree(tiny_checkpoint["ckpt"], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(DegJsonError, match=r"<local>/base.*pass base_model=PATH"):
        load(moved)


def test_load_from_a_hub_repo_downloads_the_snapshot(tiny_checkpoint, monkeypatch):
    import huggingface_hub
    import torch

    import deg_hf

    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tiny_checkpoint["ckpt"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    model, _ = deg_hf.load("me/tiny-sft", revision="v1")
    assert calls[0][0] == "me/tiny-sft" and calls[0][1]["revision"] == "v1"
    assert "optimizer.pt" not in calls[0][1]["allow_patterns"] and DEG_JSON in calls[0][1]["allow_patterns"]
    with torch.no_grad():
        assert (model(input_ids=tiny_checkpoint["input_ids"]).logits - tiny_checkpoint["expected"]).abs().max() == 0


def test_load_streamed_gives_the_same_logits(tiny_checkpoint):
    import torch

    model, _ = load(tiny_checkpoint["ckpt"], streamed=True, device="cpu")
    with torch.no_grad():
        logits = model(input_ids=tiny_checkpoint["input_ids"]).logits
    assert (logits - tiny_checkpoint["expected"]).abs().max().item() == 0.0
    model._deg_stream_runtime.close()


def test_load_rejects_a_directory_without_deg_json(tmp_path):
    with pytest.raises(DegJsonError, match="has no deg.json"):
        load(tmp_path)
    with pytest.raises(DegJsonError, match="not a checkpoint directory"):
        load(str(tmp_path / "missing" / "dir"))
