"""The tiny model and data set shipped in ``deg_hf/assets``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deg_hf import assets

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "make_tiny_model.py"
COLUMNS = {
    "preference": {"prompt", "chosen", "rejected"},
    "kto": {"prompt", "completion", "label"},
    "sft": {"messages"},
}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _prompts(view: str, split: str) -> set[str]:
    rows = assets.tiny_rows(view, split)
    if view == "sft":
        return {r["messages"][0]["content"] for r in rows}
    return {r["prompt"] for r in rows}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(assets.tiny_model_path())


# -------------------------------------------------------------------------------------------- paths
def test_paths_exist():
    model = Path(assets.tiny_model_path())
    assert model.is_absolute() and model.is_dir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).is_file(), name
    assert (model / "model.safetensors").stat().st_size < 4_000_000
    assert Path(assets.data_dir()).is_dir()


def test_import_is_light():
    code = (
        "import sys, deg_hf.assets as a; a.tiny_rows('kto', 'test'); a.tiny_model_path(); "
        "heavy = [m for m in ('torch', 'transformers', 'datasets', 'trl', 'peft') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------------- model, tokenizer
def test_model_and_tokenizer_load_offline():
    code = (
        "import json, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast\n"
        "from deg_hf.assets import tiny_model_path\n"
        "m = AutoModelForCausalLM.from_pretrained(tiny_model_path())\n"
        "t = AutoTokenizer.from_pretrained(tiny_model_path())\n"
        "ids = t('Question: Ann has a red ball and Bob has a blue kite. What does Ann have?\\nAnswer:', "
        "return_tensors='pt')\n"
        "out = m(**ids)\n"
        "print(json.dumps({'model': type(m).__name__, 'fast': isinstance(t, PreTrainedTokenizerFast),\n"
        "  'dtype': str(next(m.parameters()).dtype), 'params': sum(p.numel() for p in m.parameters()),\n"
        "  'vocab': m.config.vocab_size, 'len_tok': len(t), 'logits': list(out.logits.shape),\n"
        "  'pad': t.pad_token_id, 'eos': t.eos_token_id, 'cfg_pad': m.config.pad_token_id,\n"
        "  'cfg_eos': m.config.eos_token_id, 'finite': bool(out.logits.isfinite().all())}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["model"] == "LlamaForCausalLM"
    assert info["fast"]
    assert info["dtype"] == "torch.float32"
    assert 50_000 < info["params"] < 1_000_000
    assert info["vocab"] >= info["len_tok"]
    assert info["logits"][-1] == info["vocab"]
    assert info["finite"]
    assert info["pad"] is not None and info["pad"] != info["eos"]
    assert (info["cfg_pad"], info["cfg_eos"]) == (info["pad"], info["eos"])


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What does Ann have?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat does Ann have?<|im_end|>\n<|im_start|>assistant\n"
    full = messages + [{"role": "assistant", "content": "Ann has a red ball."}]
    rendered = tokenizer.apply_chat_template(full, tokenize=False)
    assert rendered.startswith(text) and rendered.endswith("Ann has a red ball.<|im_end|>\n")
    # the prompt renders the same alone and followed by the answer (TRL's prompt/completion split)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    full_ids = tokenizer.apply_chat_template(full, return_dict=True)["input_ids"]
    assert full_ids[: len(ids)] == ids
    # special tokens are single tokens and the template marks the assistant turn
    for token in ("<|im_start|>", "<|im_end|>", "<|pad|>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    mask = tokenizer.apply_chat_template(full, return_dict=True, return_assistant_tokens_mask=True)
    assert 0 < sum(mask["assistant_masks"]) < len(full_ids)


def test_prompt_tokens_are_a_prefix(tokenizer):
    for split in assets.SPLITS:
        for row in assets.tiny_rows("preference", split):
            prompt = tokenizer(row["prompt"])["input_ids"]
            for key in ("chosen", "rejected"):
                assert tokenizer(row["prompt"] + row[key])["input_ids"][: len(prompt)] == prompt
                assert tokenizer.decode(tokenizer(row["prompt"] + row[key])["input_ids"]) == row["prompt"] + row[key]


# --------------------------------------------------------------------------------------------- data
@pytest.mark.parametrize("view", assets.VIEWS)
def test_views(view):
    pairs = {s: len(assets.tiny_rows("preference", s)) for s in assets.SPLITS}
    assert 200 <= pairs["train"] <= 600 and 64 <= pairs["test"] <= 100
    for split in assets.SPLITS:
        rows = assets.tiny_rows(view, split)
        assert len(rows) == pairs[split] * (2 if view == "kto" else 1)
        assert all(set(r) == COLUMNS[view] for r in rows)
        ds = assets.tiny_dataset(view, split)
        assert set(ds.column_names) == COLUMNS[view] and len(ds) == len(rows)
    assert _prompts(view, "train").isdisjoint(_prompts(view, "test"))


def test_default_split_and_errors():
    assert assets.tiny_rows("preference") == assets.tiny_rows("preference", "train")
    with pytest.raises(ValueError, match="preference, kto, sft"):
        assets.tiny_rows("dpo")
    with pytest.raises(ValueError, match="train, test"):
        assets.tiny_dataset("sft", "validation")


def test_preference_format():
    for split in assets.SPLITS:
        rows = assets.tiny_rows("preference", split)
        assert len({r["prompt"] for r in rows}) == len(rows)
        for r in rows:
            assert all(isinstance(r[k], str) for k in COLUMNS["preference"])
            assert r["prompt"].endswith("\nAnswer:")
            assert r["chosen"].startswith(" ") and r["rejected"].startswith(" ")
            assert r["chosen"] != r["rejected"]
        # the two completions have about the same length: length is not the signal
        mean_chosen = sum(len(r["chosen"]) for r in rows) / len(rows)
        mean_rejected = sum(len(r["rejected"]) for r in rows) / len(rows)
        assert abs(mean_chosen - mean_rejected) < 0.1 * mean_chosen


def test_views_agree():
    for split in assets.SPLITS:
        pairs = assets.tiny_rows("preference", split)
        kto = assets.tiny_rows("kto", split)
        sft = assets.tiny_rows("sft", split)
        assert sum(r["label"] for r in kto) == len(pairs)
        for i, pair in enumerate(pairs):
            good, bad = kto[2 * i], kto[2 * i + 1]
            assert (good["prompt"], good["completion"], good["label"]) == (pair["prompt"], pair["chosen"], True)
            assert (bad["prompt"], bad["completion"], bad["label"]) == (pair["prompt"], pair["rejected"], False)
            user, assistant = sft[i]["messages"]
            assert user["role"] == "user" and user["content"] in pair["prompt"]
            assert assistant == {"role": "assistant", "content": pair["chosen"].strip()}


def test_data_regeneration_is_deterministic(tmp_path):
    for out in ("a", "b"):
        cmd = [sys.executable, str(SCRIPT), "--data-only", "--seed", "0", "--out", str(tmp_path / out)]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    shipped = Path(assets.data_dir())
    files = sorted(p.relative_to(shipped) for p in shipped.rglob("*.jsonl"))
    assert len(files) == len(assets.VIEWS) * len(assets.SPLITS)
    for rel in files:
        assert (tmp_path / "a" / "data" / rel).read_bytes() == (shipped / rel).read_bytes(), rel
        assert (tmp_path / "b" / "data" / rel).read_bytes() == (shipped / rel).read_bytes(), rel
    other = tmp_path / "seed1"
    cmd = [sys.executable, str(SCRIPT), "--data-only", "--seed", "1", "--out", str(other)]
    subprocess.run(cmd, env=_env(), check=True, capture_output=True, timeout=60)
    assert (other / "data" / files[0]).read_bytes() != (shipped / files[0]).read_bytes()
