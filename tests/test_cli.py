"""The deg-hf command line: help without heavy imports, info, push and the plan stub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import huggingface_hub
import pytest

from deg_hf.checkpoint import DEG_JSON, make_record, write_deg_json
from deg_hf.cli import main

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "trl", "peft")


def _run(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def _checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    record = make_record(
        task="kto",
        base_model={"name_or_path": "tiny-org/tiny-llama", "revision": None, "config_sha256": "c" * 64},
        peft={"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj"]},
        train_args={"learning_rate": 1e-4, "max_steps": 50, "per_device_train_batch_size": 1,
                    "gradient_accumulation_steps": 16},
        stream=None,
        memory={"target_bytes": 6 * 1024**3, "totals": {"parts": 50, "oom_retry": 0, "oom_skip": 0}},
        data={"name_or_path": "trl-lib/kto-mix-14k", "fingerprint": "ff00", "sizes": {"train": 800}},
        metrics={"train_loss": 0.4},
        default_lora_applied=False,
    )
    write_deg_json(directory, record)
    (directory / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    (directory / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny-org/tiny-llama"}))
    return directory


def test_help_lists_the_subcommands_without_heavy_imports():
    result = _run("-m", "deg_hf.cli", "--help")
    assert result.returncode == 0, result.stderr
    for command in ("info", "push", "plan"):
        assert command in result.stdout
    code = (
        "import sys\nfrom deg_hf.cli import main\n"
        "for argv in (['--help'], ['info', '--help'], ['push', '--help'], ['plan', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        f"print('HEAVY', sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_importing_the_cli_imports_no_training_stack():
    result = _run("-X", "importtime", "-c", "import deg_hf.cli")
    assert result.returncode == 0, result.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert "deg_hf" in imported
    assert not imported & set(HEAVY), imported & set(HEAVY)


def test_info_on_a_local_checkpoint(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path / "checkpoint-50")
    assert main(["info", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "task:        kto" in out
    assert "tiny-org/tiny-llama" in out
    assert "LORA r=16 alpha=32" in out
    assert "max steps 50" in out and "gradient accumulation 16" in out
    assert "target 6.00 GiB" in out
    assert main(["info", str(ckpt / DEG_JSON)]) == 0


def test_info_without_deg_json_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x")
    result = _run("-m", "deg_hf.cli", "info", str(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("deg-hf: error: ") and "has no deg.json" in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_info_on_a_broken_deg_json_in_process(tmp_path, capsys):
    (tmp_path / DEG_JSON).write_text("{not json")
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "line 1, column 2" in err


def test_info_on_a_hub_repo(tmp_path, monkeypatch, capsys):
    ckpt = _checkpoint(tmp_path / "remote")
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs))
        return str(ckpt / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert main(["info", "me/tiny-kto", "--revision", "v1"]) == 0
    assert calls == [("me/tiny-kto", "deg.json", {"revision": "v1"})]
    assert "task:        kto" in capsys.readouterr().out


def test_info_on_a_hub_repo_without_deg_json(monkeypatch, capsys):
    from huggingface_hub.errors import EntryNotFoundError

    def fake_download(repo_id, filename, **kwargs):
        raise EntryNotFoundError(f"{filename} not found in {repo_id}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert main(["info", "someone/plain-model"]) == 2
    err = capsys.readouterr().err
    assert "someone/plain-model has no deg.json" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def fake_hub(monkeypatch):
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, **kwargs):
        calls.append(("create_branch", repo_id, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        calls.append(("create_commit", repo_id, {**kwargs, "files": [op.path_in_repo for op in operations]}))

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_branch", create_branch)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", create_commit)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return calls


def test_push_in_process(tmp_path, fake_hub, capsys):
    ckpt = _checkpoint(tmp_path / "checkpoint-50")
    (ckpt / "optimizer.pt").write_bytes(b"state")
    assert main(["push", str(ckpt), "me/tiny-kto", "--private", "--revision", "exp", "--include-optimizer"]) == 0
    assert capsys.readouterr().out.strip() == "https://huggingface.co/me/tiny-kto/tree/exp"
    assert [c[0] for c in fake_hub] == ["create_repo", "create_branch", "create_commit"]
    assert fake_hub[0][2]["private"] is True
    assert fake_hub[1][2]["branch"] == "exp"
    upload = fake_hub[2][2]
    assert upload["revision"] == "exp"
    assert "optimizer.pt" in upload["files"] and "README.md" in upload["files"]


def test_push_errors_are_one_line_and_make_no_remote_call(tmp_path, fake_hub, capsys):
    ckpt = _checkpoint(tmp_path / "checkpoint-50")
    assert main(["push", str(ckpt), "a/b/c"]) == 2
    assert main(["push", str(tmp_path / "empty-missing"), "me/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "invalid Hub repo id" in err[0] and "does not exist" in err[1]
    assert fake_hub == []


def test_plan_calls_plan_cli_with_the_defaults(monkeypatch):
    seen = []
    module = types.ModuleType("deg_hf.plan_cli")
    module.run = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, "deg_hf.plan_cli", module)
    assert main(["plan", "org/model"]) == 0
    args = seen[0]
    assert (args.model, args.task, args.batch, args.max_length, args.vram, args.lora_r) == ("org/model", "dpo", 4, 2048, 8.0, 16)
    assert main(["plan", "org/model", "--task", "orpo", "--batch", "2", "--max-length", "512", "--vram", "24",
                 "--lora-r", "8"]) == 0
    args = seen[1]
    assert (args.task, args.batch, args.max_length, args.vram, args.lora_r) == ("orpo", 2, 512, 24.0, 8)
    with pytest.raises(SystemExit) as exc:
        main(["plan", "org/model", "--task", "ppo"])
    assert exc.value.code == 2


def test_plan_without_plan_cli_is_a_clean_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "deg_hf.plan_cli", None)  # as if the module were absent
    assert main(["plan", "org/model"]) == 2
    assert "not available" in capsys.readouterr().err
