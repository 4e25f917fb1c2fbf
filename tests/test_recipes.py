"""The recipes run end to end on the embedded tiny model (two steps each), `make demo`'s run reaches
held-out reward accuracy >= 0.8 with its summary table, and plot_run.py draws a log."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FAST = ["--max_steps", "2", "--report_to", "none", "--logging_steps", "1", "--per_device_train_batch_size", "4",
        "--disable_tqdm", "true"]


def run_recipe(name: str, *args: str) -> subprocess.CompletedProcess:
    # one thread: a tiny model gains nothing from more, and loses a lot when the cores are shared
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    env.pop("TRL_EXPERIMENTAL_SILENCE", None)  # deg_hf keeps TRL's notice about its own imports quiet
    return subprocess.run([sys.executable, str(REPO / "recipes" / f"{name}.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


#: upstream notices a user of the recipes did not cause (deg_hf/notices.py)
UPSTREAM_NOISE = ("is deprecated and will be removed in v6", "'pin_memory' argument is set as true",
                  "TRLExperimentalWarning")


def assert_saved(proc: subprocess.CompletedProcess, out: Path) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if any(n in line for n in UPSTREAM_NOISE)]
    assert not noise, noise
    for name in ("deg.json", "adapter_model.safetensors", "README.md", "train.log.jsonl"):
        assert (out / name).is_file(), f"{name} missing from {sorted(os.listdir(out))}"


RECIPES = ["sft", "dpo", "kto", "orpo", "simpo"]


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_runs_without_config(name, tmp_path):
    out = tmp_path / name
    assert_saved(run_recipe(name, *FAST, "--output_dir", str(out)), out)


def test_recipe_load_in_4bit_streams_nf4(tmp_path):
    """TRL's --load_in_4bit flags mean QLoRA under streaming too: the store holds NF4."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "dpo4"
    proc = run_recipe("dpo", *FAST, "--max_steps", "3", "--load_in_4bit", "true", "--use_bnb_nested_quant", "true",
                      "--output_dir", str(out))
    assert_saved(proc, out)
    quant = json.loads((out / "deg.json").read_text())["stream"]["quantization"]
    assert (quant["method"], quant["quant_type"], quant["double_quant"]) == ("bitsandbytes-4bit", "nf4", True)


def demo_args() -> list[str]:
    """The arguments `make demo` passes to recipes/dpo.py, read from the Makefile."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if "recipes/dpo.py" in line and "--summary" in line]
    args = shlex.split(line)
    return args[args.index("recipes/dpo.py") + 1:]


def test_demo_reaches_held_out_reward_accuracy(tmp_path):
    args = demo_args()
    args[args.index("--output_dir") + 1] = str(tmp_path / "demo")
    proc = run_recipe("dpo", *args, "--disable_tqdm", "true")
    out = tmp_path / "demo"
    assert_saved(proc, out)
    table = proc.stdout[proc.stdout.index("deg_hf dpo: StreamedDPOTrainer"):]
    before, after = map(float, re.search(r"held-out reward accuracy +([\d.]+) -> ([\d.]+)", table).groups())
    assert before == 0.5  # the untrained adapter: policy == reference, every pair ties
    assert after >= 0.8, table
    for row in ("train loss (first -> last log)", "layer fetches (loads + buffer hits)", "bytes moved host -> device",
                "memory plan: parts / retries / skips", "reference model"):
        assert row in table, row
    loads = int(re.search(r"layer fetches \(loads \+ buffer hits\) +\d+ \((\d+) loads\)", table).group(1))
    record = json.loads((out / "deg.json").read_text())
    assert record["stream"]["stream_buffers"] == 1 and record["stream"]["loads"] == loads > 0
    assert record["memory"]["totals"]["oom_skip"] == 0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_yaml_with_overrides(name, tmp_path):
    import yaml

    out = tmp_path / name
    config = yaml.safe_load((REPO / "recipes" / "configs" / f"{name}.yaml").read_text())
    proc = run_recipe(name, "--config", f"recipes/configs/{name}.yaml", "--max_steps", "2", "--output_dir", str(out),
                      "--per_device_train_batch_size", "4", "--disable_tqdm", "true", "--learning_rate", "0.000123")
    assert_saved(proc, out)
    # the YAML's LoRA settings reached the adapter, and the command line overrode the YAML
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert adapter["r"] == config["lora_r"] and adapter["lora_alpha"] == config["lora_alpha"]
    record = json.loads((out / "deg.json").read_text())
    assert record["train_args"]["learning_rate"] == 0.000123 != config.get("learning_rate")
    assert record["train_args"]["max_steps"] == 2


def test_configs_parse():
    import yaml

    for name in ("sft", "dpo", "kto", "orpo", "simpo"):
        config = yaml.safe_load((REPO / "recipes" / "configs" / f"{name}.yaml").read_text())
        assert config["stream_layers"] is True and config["use_peft"] is True
    for name in ("single_device", "multi_gpu_ddp", "fsdp2", "deepspeed_zero3"):
        config = yaml.safe_load((REPO / "recipes" / "accelerate" / f"{name}.yaml").read_text())
        assert config["compute_environment"] == "LOCAL_MACHINE"
    assert yaml.safe_load((REPO / "recipes/accelerate/fsdp2.yaml").read_text())["fsdp_config"]["fsdp_version"] == 2
    ds = yaml.safe_load((REPO / "recipes/accelerate/deepspeed_zero3.yaml").read_text())
    assert ds["deepspeed_config"]["zero_stage"] == 3


def test_plot_run(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import plot_run
    finally:
        sys.path.remove(str(REPO / "scripts"))
    rows = [{"event": "mem_plan", "step": 0, "streaming": True}]
    rows += [{"step": s, "loss": 0.7 - 0.05 * s, "rewards/margins": 0.1 * s, "est_peak_gib": 1.5, "peak_gib": 1.2 + 0.01 * s}
             for s in range(1, 11)]
    (tmp_path / "train.log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert plot_run.main([str(tmp_path)]) == 0
    png = tmp_path / "run.png"
    assert png.is_file() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # no train.log.jsonl: trainer_state.json's log_history, to the --out path
    other = tmp_path / "state"
    other.mkdir()
    (other / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}]}))
    assert plot_run.main([str(other), "--out", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").stat().st_size > 1000


def test_recipe_help():
    proc = run_recipe("simpo", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--stream_layers" in proc.stdout and "--lora_r" in proc.stdout


def test_the_upstream_notices_exist_without_deg_hf():
    """Control for assert_saved's noise check: TRL's own config prints the rename notice."""
    code = "import tempfile\nfrom trl import DPOConfig\nDPOConfig(output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert UPSTREAM_NOISE[0] in proc.stderr
