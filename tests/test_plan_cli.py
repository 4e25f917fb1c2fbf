"""``deg-hf plan``: config.json only, no torch, and every number the planner's own formula."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deg_hf.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "llama-7b"
ARGV = ["plan", str(FIXTURE), "--task", "dpo", "--batch", "4", "--max-length", "2048", "--vram", "8"]
GIB = 1 << 30


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def _expected(task="dpo", batch=4, max_length=2048, vram=8.0, lora_r=16):
    """The plan recomputed from the planner API, independently of deg_hf.plan_cli."""
    from deg_hf.memory.planner import MemPlanner
    from deg_hf.memory.static import lora_param_count, static_breakdown

    config = json.loads((FIXTURE / "config.json").read_text())
    rows = 2 if task in ("dpo", "orpo", "simpo") else 1
    lora = lora_param_count(config, lora_r, "all-linear")
    target = int(vram * GIB)
    out = {}
    for name, streaming in (("resident", False), ("streamed", True)):
        static = static_breakdown(config, streaming=streaming, stream_buffers=2, lora_params=lora, optimizer="adamw",
                                  dtype_bytes=2, trainable_dtype_bytes=4)
        planner = MemPlanner(target, sum(static.values()), model_config=config, min_rows=rows, checkpointing=True,
                             streaming=streaming, fused_lm_head=task in ("sft", "dpo", "kto"), dtype_bytes=2,
                             attn_implementation="sdpa")
        features = planner.features_of(batch * rows, max_length, batch * rows * max_length)
        activations = planner.estimate(features)
        out[name] = {
            "resident_weights": static["resident"],
            "layers_in_flight": static["layers"],
            "adapter_state": static["adapters"] + static["grads"] + static["optimizer"],
            "activations": activations,
            "total": sum(static.values()) + activations,
            "fits": planner.fits(features),
            "largest_batch": planner.largest_batch(max_length, rows),
            "planner": planner,
            "rows": rows,
        }
    return out


def _row(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(label))
    return line[len(label):].split()


def test_plan_of_a_7b_dpo_run_on_8_gib(capsys):
    assert main(ARGV) == 0
    text = capsys.readouterr().out
    exp = _expected()
    res, st = exp["resident"], exp["streamed"]

    # every printed number is the planner's
    for label, key in (("resident weights", "resident_weights"), ("decoder layers in flight", "layers_in_flight"),
                       ("adapters + grads + optimizer", "adapter_state"), ("activations", "activations"),
                       ("estimated peak", "total")):
        cells = " ".join(_row(text, label))
        assert cells.endswith(f"{_gib(res[key])} {_gib(st[key])}"), (label, cells)
    assert _row(text, "largest per-device batch that fits") == [str(res["largest_batch"]), str(st["largest_batch"])]
    assert _row(text, "batch 4 fits 8 GiB") == ["yes" if res["fits"] else "no", "yes" if st["fits"] else "no"]

    # 7B in bf16 is ~13.5 GB of weights: resident cannot fit 8 GiB at any batch
    assert 12.4 * GIB < res["resident_weights"] + res["layers_in_flight"] < 12.7 * GIB
    assert not res["fits"] and res["largest_batch"] == 0
    assert res["total"] > 8 * GIB
    # streamed, two layers in flight: at least one example fits
    assert st["layers_in_flight"] < GIB
    assert st["largest_batch"] >= 1
    # the largest batch agrees with fits(): it fits, one more does not, and batch 4 fits iff <= largest
    planner, rows = st["planner"], st["rows"]
    n = st["largest_batch"]
    assert planner.fits(planner.features_of(n * rows, 2048, n * rows * 2048))
    assert not planner.fits(planner.features_of((n + 1) * rows, 2048, (n + 1) * rows * 2048))
    assert st["fits"] == (4 <= n)
    parts = _row(text, "micro-batches per step of 4")
    assert parts == ["-", str(math.ceil(4 / n))]

    assert "no weights read" in text
    assert "deg_hf.memory.coef (module docstring" in text and "deg_hf.memory.static (static_breakdown" in text
    assert "resident: does not fit even one example" in text


def test_plan_cli_function_matches_the_planner_for_every_task():
    from deg_hf.plan_cli import plan, read_config

    config, _ = read_config(str(FIXTURE))
    for task in ("sft", "dpo", "kto", "orpo", "simpo"):
        got = plan(config, task=task, batch=3, max_length=1024, vram=24, lora_r=8)
        exp = _expected(task, batch=3, max_length=1024, vram=24, lora_r=8)
        for name in ("resident", "streamed"):
            for key in ("resident_weights", "layers_in_flight", "adapter_state", "activations", "total", "fits",
                        "largest_batch"):
                assert got[name][key] == exp[name][key], (task, name, key)
        assert got["rows_per_example"] == (2 if task in ("dpo", "orpo", "simpo") else 1)
        assert ("total_with_kl_rows" in got["streamed"]) == (task == "kto")


LLAMA_70B = Path(__file__).parent / "fixtures" / "llama-70b"


def test_plan_of_70b_nf4_dpo_on_one_24_gib_gpu_and_a_64_gib_host(capsys):
    """The north star: a 70B Llama in NF4 (double quantization) streams from a 64 GiB host and a DPO
    micro-batch of 2 pairs x 1024 tokens fits a 24 GiB device."""
    from deg_hf.memory.static import layer_param_count, quant_bytes_per_weight
    from deg_hf.plan_cli import plan, read_config

    argv = ["plan", str(LLAMA_70B), "--task", "dpo", "--batch", "2", "--max-length", "1024", "--vram", "24",
            "--quantization", "nf4", "--host-mem", "64"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    config, _ = read_config(str(LLAMA_70B))
    got = plan(config, task="dpo", batch=2, max_length=1024, vram=24, lora_r=16, quantization="nf4", host_mem=64)
    host, st = got["host"], got["streamed"]

    # the store: every decoder Linear weight at 0.5 + 1/64 + 4/(64*256) bytes, the norms in bf16
    linear = layer_param_count(config) - 2 * 8192
    assert linear == 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672  # q, o; k, v (8 of 64 heads); MLP
    assert host["store_bytes"] == math.ceil(80 * (linear * quant_bytes_per_weight(64, True) + 2 * 8192 * 2))
    assert 35e9 <= host["store_bytes"] <= 39e9  # 35.3 GB (32.9 GiB): about a quarter of bf16's
    assert host["store_bytes"] / host["store_unquantized_bytes"] < 0.26
    assert host["disk_layers"] == 0 and host["ram_layers"] == 80  # a 64 GiB host holds it in RAM
    assert "35.3 GB) in NF4" in text and "fits in RAM" in text

    # the device: two layers in flight quantized plus their bf16 compute buffers, and the batch fits
    assert st["dequantized"] == 2 * linear * 2
    assert st["layers_in_flight"] < st["dequantized"] / 3
    assert st["fits"] and st["total"] <= 24 * GIB and st["parts"] == 1
    assert _row(text, "batch 2 fits 24 GiB") == ["no", "yes"]
    cells = " ".join(_row(text, "4-bit weights dequantized for compute"))
    assert cells.endswith(_gib(st["dequantized"]))

    # control: the same run unquantized needs 4x the host memory, which a 64 GiB host cannot hold
    bf16 = plan(config, task="dpo", batch=2, max_length=1024, vram=24, lora_r=16, host_mem=64)
    assert bf16["quantization"] is None
    assert bf16["host"]["store_bytes"] == host["store_unquantized_bytes"]
    assert bf16["host"]["disk_layers"] > 0
    assert bf16["streamed"]["dequantized"] == 0


def test_plan_reads_a_prequantized_config_and_checks_its_flags(tmp_path, capsys):
    config = json.loads((LLAMA_70B / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True,
                                     "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path), "--host-mem", "64"]) == 0
    text = capsys.readouterr().out
    assert "NF4 Linear weights (0.5625 bytes each" in text and "double quantization off" in text
    assert "from the checkpoint" in text
    assert main(["plan", str(tmp_path), "--host-mem", "-1"]) == 2
    assert "--host-mem" in capsys.readouterr().err


def test_plan_runs_without_torch_in_a_fresh_interpreter():
    code = (
        "import sys\n"
        "from deg_hf.cli import main\n"
        f"rc = main({ARGV!r})\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'trl') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
        "sys.exit(rc)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert "estimated peak" in proc.stdout


def test_config_json_path_and_kto_note(capsys):
    assert main(["plan", str(FIXTURE / "config.json"), "--task", "kto", "--batch", "2", "--vram", "80"]) == 0
    text = capsys.readouterr().out
    assert "KL term" in text and "batch >= 2" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "0"], "--batch"),
        (["--max-length", "-5"], "--max-length"),
        (["--vram", "0"], "--vram"),
        (["--vram", "nan"], "--vram"),
        (["--lora-r", "0"], "--lora-r"),
    ],
)
def test_bad_numbers_exit_2(argv, message, capsys):
    assert main(["plan", str(FIXTURE), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_bad_models_exit_2(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "missing" / "model")]) == 2
    assert main(["plan", str(tmp_path)]) == 2  # a directory without config.json
    (tmp_path / "config.json").write_text("{not json")
    assert main(["plan", str(tmp_path)]) == 2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["plan", str(tmp_path)]) == 2  # no hidden_size
    (tmp_path / "weights.bin").write_bytes(b"\0")
    assert main(["plan", str(tmp_path / "weights.bin")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("deg-hf: error:") for line in err)


def test_hub_id_downloads_config_json_only(monkeypatch, capsys):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename))
        return str(FIXTURE / "config.json")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    assert main(["plan", "meta-llama/Llama-2-7b-hf", "--task", "sft"]) == 0
    assert calls == [("meta-llama/Llama-2-7b-hf", "config.json")]
    assert "meta-llama/Llama-2-7b-hf (Hub)" in capsys.readouterr().out


def test_hub_errors_map_to_exit_codes(monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(repo_id, filename, **kwargs):
        raise LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert main(["plan", "org/model"]) == 1
    assert "unreachable" in capsys.readouterr().err


@pytest.mark.parametrize("error", ["RepositoryNotFoundError", "RemoteEntryNotFoundError"])
def test_unknown_repo_or_missing_config_is_bad_input(monkeypatch, capsys, error):
    from types import SimpleNamespace

    import huggingface_hub
    from huggingface_hub import errors

    def missing(repo_id, filename, **kwargs):
        raise getattr(errors, error)("404", response=SimpleNamespace(headers={}, status_code=404, request=None))

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", missing)
    assert main(["plan", "org/model"]) == 2
    assert "org/model" in capsys.readouterr().err
