"""push_checkpoint and the model card, with huggingface_hub's HfApi intercepted (no network)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import ModelCard

from deg_hf.checkpoint import DEG_JSON, DegJsonError, make_record, write_deg_json
from deg_hf.hub import model_card, push_checkpoint, select_upload_files

FAKE_TOKEN = "hf_" + "ZyXwVuTsRqPoNmLkJiHgFeDcBa76543210"  # the shape of a Hub token, not a real one

BASE_FILES = {
    "adapter_model.safetensors",
    "adapter_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "deg.json",
    "README.md",
    "train.log.jsonl",
}
OPTIMIZER_FILES = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"}


def _safetensors(path: Path) -> None:
    header = json.dumps(
        {"__metadata__": {"format": "pt"}, "base_model.model.layers.0.q_proj.lora_A.weight": {
            "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 0.5, -0.25))


def _record(tmp_path: Path, **overrides):
    kwargs = dict(
        task="dpo",
        base_model={"name_or_path": "tiny-org/tiny-llama", "revision": "c0ffee", "config_sha256": "b" * 64},
        peft={"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
        train_args={
            "output_dir": str(tmp_path / "outputs" / "run"),
            "learning_rate": 5e-6,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 4,
            "num_train_epochs": 1.0,
            "hub_token": FAKE_TOKEN,
        },
        stream={"enabled": True, "layer_fetches": 40},
        memory={"target_bytes": 8 * 1024**3, "scale": 0.9, "totals": {"parts": 6, "oom_retry": 1, "oom_skip": 0}},
        data={"name_or_path": "trl-lib/ultrafeedback_binarized", "fingerprint": "abc123", "sizes": {"train": 32}},
        metrics={"train_loss": 0.69},
        default_lora_applied=True,
    )
    kwargs.update(overrides)
    return make_record(**kwargs)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A checkpoint directory as a deg_hf trainer leaves it, with everything a Trainer adds."""
    ckpt = tmp_path / "outputs" / "run" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    _safetensors(ckpt / "adapter_model.safetensors")
    (ckpt / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": "tiny-org/tiny-llama", "peft_type": "LORA", "r": 8,
                    "target_modules": ["q_proj", "v_proj"]})
    )
    (ckpt / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"<unk>": 0}}}))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    (ckpt / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<pad>"}))
    (ckpt / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (ckpt / "train.log.jsonl").write_text('{"step": 1, "loss": 0.69, "parts": 2}\n')
    (ckpt / "README.md").write_text("---\nlibrary_name: peft\n---\n# PEFT's own card\n")
    write_deg_json(ckpt, _record(tmp_path))
    # written by transformers.Trainer: uploaded only on request, or never
    (ckpt / "optimizer.pt").write_bytes(b"PK\x03\x04optimizer-state")
    (ckpt / "scheduler.pt").write_bytes(b"PK\x03\x04scheduler-state")
    (ckpt / "rng_state.pth").write_bytes(b"PK\x03\x04rng")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 10, "best_model_checkpoint": None}))
    # a pickle of the TrainingArguments: holds the token and local paths
    (ckpt / "training_args.bin").write_bytes(f"\x80\x04{FAKE_TOKEN}{ckpt}".encode())
    (ckpt / "notes.txt").write_text(f"scratch notes from {ckpt}")
    (ckpt / "runs").mkdir()
    (ckpt / "runs" / "events.out.tfevents.1").write_bytes(b"events")
    return ckpt


@pytest.fixture
def hub(monkeypatch):
    """Intercept HfApi: record every remote call and the exact files upload_folder would send."""
    calls: list[tuple[str, tuple, dict]] = []
    uploaded: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", (repo_id,), kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'me/' + repo_id}")

    def create_branch(self, repo_id, **kwargs):
        calls.append(("create_branch", (repo_id,), kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        calls.append(("create_commit", (repo_id,), kwargs))
        for op in operations:
            source = op.path_or_fileobj
            uploaded[op.path_in_repo] = source if isinstance(source, bytes) else Path(source).read_bytes()
        return None

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: FAKE_TOKEN)
    return {"calls": calls, "uploaded": uploaded}


def _assert_clean(uploaded: dict[str, bytes], checkpoint: Path) -> None:
    home = os.path.expanduser("~")
    for name, content in uploaded.items():
        assert FAKE_TOKEN.encode() not in content, name
        assert str(checkpoint).encode() not in content, name
        assert str(checkpoint.parents[2]).encode() not in content, name  # the pytest tmp dir
        if home not in ("/", "~"):
            assert home.encode() not in content, name


def test_push_uploads_exactly_the_adapter_files(checkpoint, hub):
    url = push_checkpoint(checkpoint, "me/tiny-dpo")
    assert url == "https://huggingface.co/me/tiny-dpo"
    assert [c[0] for c in hub["calls"]] == ["create_repo", "create_commit"]
    _, args, kwargs = hub["calls"][0]
    assert args == ("me/tiny-dpo",)
    assert kwargs == {"private": False, "exist_ok": True, "repo_type": "model"}
    _, args, upload = hub["calls"][1]
    assert args == ("me/tiny-dpo",) and upload["repo_type"] == "model" and upload["revision"] is None
    assert set(hub["uploaded"]) == BASE_FILES
    _assert_clean(hub["uploaded"], checkpoint)
    assert select_upload_files(checkpoint) == sorted(BASE_FILES)
    # the card went up rendered from deg.json; the one in the directory is untouched
    assert "PEFT's own card" in (checkpoint / "README.md").read_text()


def test_push_with_optimizer_and_revision(checkpoint, hub):
    url = push_checkpoint(checkpoint, "me/tiny-dpo", private=True, revision="exp-1", include_optimizer=True,
                          commit_message="resume state")
    assert url == "https://huggingface.co/me/tiny-dpo/tree/exp-1"
    assert [c[0] for c in hub["calls"]] == ["create_repo", "create_branch", "create_commit"]
    assert hub["calls"][0][2]["private"] is True
    assert hub["calls"][1][1] == ("me/tiny-dpo",)
    assert hub["calls"][1][2] == {"branch": "exp-1", "repo_type": "model", "exist_ok": True}
    upload = hub["calls"][2][2]
    assert upload["revision"] == "exp-1" and upload["commit_message"] == "resume state"
    assert set(hub["uploaded"]) == BASE_FILES | OPTIMIZER_FILES
    assert "training_args.bin" not in hub["uploaded"]
    _assert_clean(hub["uploaded"], checkpoint)


def test_push_to_a_bare_repo_name_uses_the_returned_namespace(checkpoint, hub):
    assert push_checkpoint(checkpoint, "tiny-dpo") == "https://huggingface.co/me/tiny-dpo"
    assert hub["calls"][-1][1] == ("me/tiny-dpo",)


def test_model_card_metadata_and_body(checkpoint, hub):
    push_checkpoint(checkpoint, "me/tiny-dpo")
    card = ModelCard(hub["uploaded"]["README.md"].decode("utf-8"))
    data = card.data.to_dict()
    assert data["base_model"] == "tiny-org/tiny-llama"
    assert data["library_name"] == "peft"
    assert data["pipeline_tag"] == "text-generation"
    assert {"deg-hf", "dpo", "lora", "peft", "trl"} <= set(data["tags"])
    assert data["datasets"] == ["trl-lib/ultrafeedback_binarized"]
    text = card.text
    assert 'deg_hf.load("me/tiny-dpo")' in text
    assert 'PeftModel.from_pretrained(base, "me/tiny-dpo")' in text
    assert "| Out-of-memory retries | 1 |" in text
    assert "| Memory target | 8.00 GiB |" in text
    assert "40 layer fetches" in text
    assert "| train_loss | 0.69 |" in text
    assert "| learning rate | 5e-06 |" in text
    assert "PEFT's own card" not in text


def test_model_card_for_a_local_base_and_data_file(tmp_path):
    record = _record(
        tmp_path,
        base_model={"name_or_path": str(tmp_path / "models" / "llama"), "revision": None, "config_sha256": None},
        data={"name_or_path": "data/prefs.jsonl", "fingerprint": None, "sizes": None},
        memory=None,
        stream=None,
        metrics=None,
    )
    card = model_card(record)
    data = card.data.to_dict()
    assert "base_model" not in data and "datasets" not in data
    assert {"deg-hf", "dpo"} <= set(data["tags"])
    assert "<local>/llama" in card.text and str(tmp_path) not in str(card)
    assert "No memory plan was used" in card.text and "resident" in card.text


def test_refuses_a_token_in_an_uploaded_file(checkpoint, hub):
    with (checkpoint / "train.log.jsonl").open("a") as log:
        log.write(json.dumps({"event": "login", "token": FAKE_TOKEN}) + "\n")
    with pytest.raises(ValueError, match=r"refusing to upload .*train\.log\.jsonl contains your Hugging Face token") as info:
        push_checkpoint(checkpoint, "me/tiny-dpo")
    assert FAKE_TOKEN not in str(info.value)
    assert hub["calls"] == []


def test_refuses_a_token_passed_explicitly(checkpoint, hub, monkeypatch):
    other = "tok-" + "q" * 30  # not hf_-shaped: found only because it is the token in use
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    (checkpoint / "chat_template.jinja").write_text(f"{{# {other} #}}")
    with pytest.raises(ValueError, match="chat_template.jinja contains your Hugging Face token"):
        push_checkpoint(checkpoint, "me/tiny-dpo", token=other)
    assert hub["calls"] == []


def test_refuses_local_paths_in_files_it_would_upload(checkpoint, hub):
    (checkpoint / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": str(checkpoint)}))
    with pytest.raises(ValueError, match="trainer_state.json contains the local path of the checkpoint directory"):
        push_checkpoint(checkpoint, "me/tiny-dpo", include_optimizer=True)
    assert hub["calls"] == []
    push_checkpoint(checkpoint, "me/tiny-dpo")  # not uploaded without include_optimizer: fine
    assert "trainer_state.json" not in hub["uploaded"]


def test_refuses_an_adapter_config_naming_a_local_base(checkpoint, hub, tmp_path):
    base = tmp_path / "models" / "llama"
    base.mkdir(parents=True)
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (checkpoint / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="base_model_name_or_path") as info:
        push_checkpoint(checkpoint, "me/tiny-dpo")
    assert "adapter_config.json contains the local path" in str(info.value)
    assert hub["calls"] == []


def _remove_deg_json(ckpt: Path) -> None:
    (ckpt / DEG_JSON).unlink()


def _corrupt_deg_json(ckpt: Path) -> None:
    (ckpt / DEG_JSON).write_text('{"format_version": 1, "task": "dpo",')


def _future_deg_json(ckpt: Path) -> None:
    record = json.loads((ckpt / DEG_JSON).read_text())
    record["format_version"] = 2
    (ckpt / DEG_JSON).write_text(json.dumps(record))


def _remove_weights(ckpt: Path) -> None:
    (ckpt / "adapter_model.safetensors").unlink()


@pytest.mark.parametrize(
    ("breaker", "message"),
    [
        (_remove_deg_json, "has no deg.json"),
        (_corrupt_deg_json, "not valid JSON"),
        (_future_deg_json, "format_version 2"),
        (_remove_weights, "has no adapter weights"),
    ],
)
def test_bad_checkpoints_make_no_remote_call(checkpoint, hub, breaker, message):
    breaker(checkpoint)
    readme_before = (checkpoint / "README.md").read_text()
    with pytest.raises(DegJsonError, match=message):
        push_checkpoint(checkpoint, "me/tiny-dpo")
    assert hub["calls"] == []
    assert (checkpoint / "README.md").read_text() == readme_before


@pytest.mark.parametrize("repo_id", ["a/b/c", "bad id", "", "me/repo--x", "me/.hidden"])
def test_invalid_repo_ids_make_no_remote_call(checkpoint, hub, repo_id):
    with pytest.raises(ValueError, match="invalid Hub repo id"):
        push_checkpoint(checkpoint, repo_id)
    assert hub["calls"] == []


def test_missing_checkpoint_dir_makes_no_remote_call(tmp_path, hub):
    with pytest.raises(DegJsonError, match="does not exist"):
        push_checkpoint(tmp_path / "nope", "me/tiny-dpo")
    assert hub["calls"] == []
