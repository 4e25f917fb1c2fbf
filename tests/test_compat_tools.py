"""The pieces of `make compat` that run without TRL's repository: the offline stand-ins and the
classification of the streamed misses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

COMPAT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "compat")
sys.path.insert(0, COMPAT)

import run as compat_run  # noqa: E402
import standins  # noqa: E402

_LOAD_CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
import standins
from transformers import AutoModelForCausalLM, AutoTokenizer
m = AutoModelForCausalLM.from_pretrained(standins.QWEN2_ID)
t = AutoTokenizer.from_pretrained(standins.QWEN2_ID)
text = t.apply_chat_template([{"role": "user", "content": "H\u00e9llo?"}], tokenize=False, add_generation_prompt=True)
d = standins.load_dataset(sys.argv[2], standins.ZEN_ID, "standard_preference")
print(json.dumps({"cls": type(m).__name__, "dtype": str(m.dtype), "round": t.decode(t(text)["input_ids"]) == text,
                  "sizes": [len(d["train"]), len(d["test"])]}))
"""


def test_zen_stand_in_has_the_configurations_columns_and_split_sizes():
    columns = {
        "standard_preference": {"prompt", "chosen", "rejected"},
        "standard_implicit_prompt_preference": {"chosen", "rejected"},
        "standard_unpaired_preference": {"prompt", "completion", "label"},
        "conversational_preference": {"prompt", "chosen", "rejected"},
        "conversational_implicit_prompt_preference": {"chosen", "rejected"},
        "conversational_unpaired_preference": {"prompt", "completion", "label"},
    }
    configs = standins.zen_configs()
    assert set(configs) == set(columns)
    for name, rows in configs.items():
        assert len(rows) == 19 and all(set(r) == columns[name] for r in rows), name
    labels = [r["label"] for r in configs["standard_unpaired_preference"]]
    assert any(labels) and not all(labels)


def test_stand_ins_load_offline_under_their_hub_ids(tmp_path):
    """In a fresh interpreter (the Hub libraries read HF_HOME at import): the tiny Qwen2 and its
    chat-template tokenizer load by Hub id, the byte-level tokenizer round-trips any text, and the
    zen splits are 17 + 2 rows."""
    env = {**os.environ, **standins.environment(str(tmp_path))}
    assert standins.write_all(str(tmp_path)) == standins.environment(str(tmp_path))
    args = [sys.executable, "-c", _LOAD_CHILD, COMPAT, env["DEG_COMPAT_DATASETS"]]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"cls": "Qwen2ForCausalLM", "dtype": "torch.bfloat16", "round": True, "sizes": [17, 2]}


@pytest.mark.parametrize("entry, expected", [
    ({"reason": "AssertionError: Parameter base_model.model.model.embed_tokens.weight has not changed."}, True),
    ({"reason": "assert not True", "line": "assert not torch.equal(param, new_param)"}, True),
    ({"reason": "AssertionError: Parameter base_model.model.x.lora_A.default.weight has not changed."}, False),
    ({"reason": "assert not True", "line": "assert trainer.ref_model is None"}, False),
])
def test_only_every_parameter_changed_asserts_count_as_full_fine_tuning(entry, expected):
    assert compat_run.full_fine_tune_assertion(entry) is expected


def test_report_fails_on_a_miss_with_another_cause(capsys):
    ok = {"outcome": "passed"}
    frozen = {"outcome": "failed", "reason": "AssertionError: Parameter model.embed_tokens.weight has not changed."}
    runs = {"plain": {"t::a": ok, "t::b": ok}, "resident": {"t::a": ok, "t::b": ok},
            "streamed": {"t::a": ok, "t::b": frozen}}
    assert compat_run.report(runs, "trl/tests") == 0
    runs["resident"]["t::b"] = {"outcome": "failed", "reason": "boom"}
    assert compat_run.report(runs, "trl/tests") == 1
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["resident_missed_other"] == 1 and summary["streamed_missed_every_parameter_changed"] == 1
