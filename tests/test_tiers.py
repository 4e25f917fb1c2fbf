"""Storage tiers: layers in host RAM or streamed from the disk cache by a background loader. The disk
tier and mixed placements are bit-exact against RAM, placement follows the budget, memory and page
cache stay bounded, an interrupted or corrupted cache is never trusted, a store that fits nowhere is
refused before any weight is read, and closing leaves no thread or file behind."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from harness import copy_adapters, lora_grads, randomise_lora_b, sft_rows, trainer_kwargs

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


def _build(path, cache, **kwargs):
    from peft import LoraConfig, get_peft_model

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    model, runtime = build_streamed_model(path, device="cpu", dtype=torch.float32, cache_dir=str(cache) if cache else None,
                                          progress=False, **kwargs)
    model = get_peft_model(model, LoraConfig(**LORA))
    materialize_adapters(model, "cpu")
    return model, runtime


def _batch(rows=3, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 40, (rows, length), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _layer_bytes(path, quant=None):
    from deg_hf.streaming.quant import QuantSpec

    _, runtime = _build(path, None, tier="ram", quantization=QuantSpec(quant, 64, True) if quant else None)
    sizes = [lay.nbytes for lay in runtime.store.layouts]
    runtime.close()
    return sizes


def _loader_threads():
    return [t for t in threading.enumerate() if t.name == "deg-hf-disk-loader" and t.is_alive()]


def _open_files_under(directory):
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            found.append(target)
    return found


# ----------------------------------------------------------------------------- exactness and placement


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_disk_and_mixed_placements_are_bit_exact_against_ram(checkpoint, tmp_path, quant):
    from deg_hf.streaming.quant import QuantSpec

    path = checkpoint("llama", n_layers=4)
    spec = QuantSpec("nf4", 64, True) if quant else None
    sizes = _layer_bytes(path) if not quant else None
    ram, rt_ram = _build(path, None, tier="ram", quantization=spec)
    disk, rt_disk = _build(path, tmp_path / "c1", tier="disk", quantization=spec, stream_buffers=1)
    half = sum(lay.nbytes for lay in rt_ram.store.layouts[:2]) / 2**30
    mixed, rt_mixed = _build(path, tmp_path / "c2", tier="auto", host_mem_gb=half, quantization=spec)
    assert rt_disk.store.placement == ["disk"] * 4
    assert rt_mixed.store.placement == ["ram", "ram", "disk", "disk"]
    if sizes:
        assert sizes == [lay.nbytes for lay in rt_disk.store.layouts]
    randomise_lora_b(ram)
    copy_adapters(disk, ram)
    copy_adapters(mixed, ram)
    batch = _batch()
    outs = {}
    for name, model in (("ram", ram), ("disk", disk), ("mixed", mixed)):
        model.train()
        out = model(**batch)
        out.loss.backward()
        outs[name] = (out.logits.detach(), out.loss.item(), lora_grads(model))
    for name in ("disk", "mixed"):
        assert torch.equal(outs[name][0], outs["ram"][0]), name
        assert outs[name][1] == outs["ram"][1]
        assert outs[name][2].keys() == outs["ram"][2].keys()
        assert all(torch.equal(outs[name][2][k], outs["ram"][2][k]) for k in outs["ram"][2]), name
    disk_stats = rt_disk.stats()["tiers"]["disk"]
    assert disk_stats["layers"] == 4 and disk_stats["reads"] > 0 and disk_stats["bytes_read"] > 0
    mixed_tiers = rt_mixed.stats()["tiers"]
    assert mixed_tiers["ram"]["layers"] == 2 and mixed_tiers["disk"]["layers"] == 2
    # only the disk layers were read from disk: every read is one of layers 2 and 3
    assert mixed_tiers["disk"]["bytes_read"] % rt_mixed.store.layouts[2].nbytes == 0
    assert rt_mixed.store.flat[0] is not None and rt_mixed.store.flat[3] is None
    for rt in (rt_ram, rt_disk, rt_mixed):
        rt.close()


def test_placement_with_half_the_layers_in_budget(checkpoint):
    from deg_hf.streaming.host import describe_placement, plan_placement

    assert plan_placement("auto", [10, 10, 10, 10], 20) == ["ram", "ram", "disk", "disk"]
    assert plan_placement("auto", [10, 10, 10, 10], 45) == ["ram"] * 4
    assert plan_placement("auto", [10, 10, 10, 10], 5) == ["disk"] * 4
    assert plan_placement("ram", [10, 10], 1) == ["ram", "ram"]
    assert plan_placement("disk", [10, 10], 100) == ["disk", "disk"]
    assert describe_placement(["ram", "ram", "disk", "disk", "disk"]) == "ram 0-1, disk 2-4"


@pytest.mark.parametrize("quant", [None, "nf4"])
def test_ten_train_steps_on_disk_and_mixed_equal_ram(checkpoint, tmp_path, quant):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    path = checkpoint("llama", n_layers=4)
    sizes = _layer_bytes(path, quant)

    def run(name, **settings):
        args = StreamedSFTConfig(**trainer_kwargs(str(tmp_path / name), max_length=32, max_steps=10,
                                                  stream_quantization=quant, stream_cache_dir=str(tmp_path / "cache"),
                                                  **settings))
        trainer = StreamedSFTTrainer(model=path, args=args, train_dataset=Dataset.from_list(sft_rows(40)),
                                     processing_class=AutoTokenizer.from_pretrained(path),
                                     peft_config=LoraConfig(**LORA))
        randomise_lora_b(trainer.model, seed=3)
        trainer.train()
        placement = list(trainer.stream_runtime.store.placement)
        state = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}
        trainer.release_stream()
        return placement, state

    _, ram = run("ram", stream_tier="ram")
    placement, disk = run("disk", stream_tier="disk")
    assert placement == ["disk"] * 4
    placement, mixed = run("mixed", stream_tier="auto", host_mem_gb=(sizes[0] + sizes[1]) / 2**30)
    assert placement == ["ram", "ram", "disk", "disk"]
    for k in ram:
        assert torch.equal(disk[k], ram[k]), k
        assert torch.equal(mixed[k], ram[k]), k


# ----------------------------------------------------------------------------- the cache is never trusted blindly


_KILL_CHILD = r"""
import os, signal, sys, torch
from deg_hf.streaming import cache as cache_mod
from deg_hf.streaming.build import build_streamed_model
real = cache_mod.LayerCache.write_layer
def dying(self, i, block):
    real(self, i, block)
    if i == 1:  # killed while the cache is being written: two layer files exist, no manifest
        os.kill(os.getpid(), signal.SIGKILL)
cache_mod.LayerCache.write_layer = dying
build_streamed_model(sys.argv[1], device="cpu", dtype=torch.float32, cache_dir=sys.argv[2], tier="disk", progress=False)
"""


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(**_batch()).logits


def test_a_cache_killed_while_written_is_rebuilt_and_exact(checkpoint, tmp_path):
    path = checkpoint("llama", n_layers=4)
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-c", _KILL_CHILD, path, str(cache)], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    (key,) = os.listdir(cache)
    left = sorted(os.listdir(cache / key))
    assert "manifest.json" not in left and "layer-00001.bin" in left  # half-written, and says so

    fresh, rt_fresh = _build(path, None, tier="ram")
    rebuilt, rt = _build(path, cache, tier="disk")
    assert (cache / key / "manifest.json").is_file()
    assert sorted(n for n in os.listdir(cache / key) if n.startswith("layer-")) == [f"layer-{i:05d}.bin" for i in range(4)]
    assert torch.equal(_logits(rebuilt), _logits(fresh))
    rt.close()
    rt_fresh.close()


@pytest.mark.parametrize("damage", ["same-size", "truncated", "other-fingerprint"])
def test_a_damaged_cache_is_detected_and_rebuilt(checkpoint, tmp_path, damage, caplog):
    path = checkpoint("llama", n_layers=4)
    cache = tmp_path / "cache"
    _, rt = _build(path, cache, tier="ram")  # writes a complete cache
    rt.close()
    (key,) = os.listdir(cache)
    victim = cache / key / "layer-00002.bin"
    if damage == "same-size":
        data = bytearray(victim.read_bytes())
        data[100:108] = b"\xff" * 8  # NaN-shaped bytes at the same size
        victim.write_bytes(bytes(data))
    elif damage == "truncated":
        with open(victim, "r+b") as fh:
            fh.truncate(victim.stat().st_size - 64)
    else:  # a manifest from another checkpoint's cache, copied over this one
        manifest = json.loads((cache / key / "manifest.json").read_text())
        manifest["key"] = "0123456789abcdef-float32"
        (cache / key / "manifest.json").write_text(json.dumps(manifest))
    fresh, rt_fresh = _build(path, None, tier="ram")
    with caplog.at_level(logging.WARNING):
        model, rt = _build(path, cache, tier="auto")
    if damage == "same-size":
        assert "do not match their checksums" in caplog.text and "layer-00002.bin" in caplog.text
    assert torch.equal(_logits(model), _logits(fresh))
    assert json.loads((cache / key / "manifest.json").read_text())["key"] == key
    rt.close()
    rt_fresh.close()


def test_the_checksum_comparison_is_not_vacuous(checkpoint, tmp_path):
    """Control: damaged bytes whose checksum the manifest agrees with are read as they are (NaNs)."""
    from deg_hf.streaming.cache import checksum

    path = checkpoint("llama", n_layers=4)
    cache = tmp_path / "cache"
    _, rt = _build(path, cache, tier="ram")
    rt.close()
    (key,) = os.listdir(cache)
    victim = cache / key / "layer-00001.bin"
    data = bytearray(victim.read_bytes())
    data[64:72] = b"\x00\x00\xc0\x7f" * 2  # two float32 NaNs
    victim.write_bytes(bytes(data))
    manifest = json.loads((cache / key / "manifest.json").read_text())
    manifest["layers"][1]["xxh3"] = checksum(memoryview(bytes(data)))
    (cache / key / "manifest.json").write_text(json.dumps(manifest))
    model, rt = _build(path, cache, tier="ram")
    assert torch.isnan(_logits(model)).any()
    rt.close()


# ----------------------------------------------------------------------------- refusal, defaults, cleanup


def test_a_store_that_fits_nowhere_is_refused_with_figures_before_any_weight_is_read(checkpoint, tmp_path, monkeypatch):
    from deg_hf.streaming import store as store_mod
    from deg_hf.streaming.sources import CheckpointSource
    from deg_hf.streaming.store import StreamingError

    monkeypatch.setattr(store_mod, "_disk_free", lambda p: 1000)
    monkeypatch.setattr(CheckpointSource, "read", lambda *a, **k: pytest.fail("a weight was read"))
    path = checkpoint("llama", n_layers=4)
    with pytest.raises(StreamingError) as err:
        _build(path, tmp_path / "cache", tier="auto", host_mem_gb=1e-6)
    message = str(err.value)
    assert "fits neither tier" in message and "GiB" in message and "free" in message and "host_mem_gb" in message
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.bin"))
    with pytest.raises(StreamingError, match="stream_tier='ram'"):
        _build(path, None, tier="ram", host_mem_gb=1e-6)


def test_the_disk_tier_defaults_to_the_hf_cache_home_and_says_where(checkpoint, tmp_path, monkeypatch, caplog):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    with caplog.at_level(logging.WARNING):
        _, rt = _build(checkpoint("llama", n_layers=4), None, tier="disk")
    where = rt.stats()["tiers"]["cache_dir"]
    assert where.startswith(str(tmp_path / "hf" / "deg_hf" / "stream-cache"))
    assert where in caplog.text and "4 of 4 decoder layers" in caplog.text
    rt.close()


def test_close_stops_the_loader_and_closes_every_file_also_when_train_raises(checkpoint, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    path = checkpoint("llama", n_layers=4)
    _, rt = _build(path, tmp_path / "c", tier="disk")
    rt.fetch(0)
    assert _loader_threads() and _open_files_under(tmp_path / "c")
    rt.close()
    rt.close()  # twice is harmless
    assert not _loader_threads() and not _open_files_under(tmp_path / "c")

    args = StreamedSFTConfig(**trainer_kwargs(str(tmp_path / "out"), max_length=32, stream_tier="disk",
                                              stream_cache_dir=str(tmp_path / "c2")))
    trainer = StreamedSFTTrainer(model=path, args=args, train_dataset=Dataset.from_list(sft_rows(8)),
                                 processing_class=AutoTokenizer.from_pretrained(path), peft_config=LoraConfig(**LORA))

    def boom(*a, **k):
        raise RuntimeError("injected failure")

    trainer.set_fault_hook(lambda info, phase: boom() if phase == "backward" else None)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.train()
    assert trainer.stream_runtime.closed
    assert not _loader_threads() and not _open_files_under(tmp_path / "c2")


# ----------------------------------------------------------------------------- memory (subprocess)


_MEMORY_CHILD = r"""
import json, mmap, os, sys, ctypes
import torch
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
def cached_bytes(directory):
    libc = ctypes.CDLL(None, use_errno=True)
    page, total = os.sysconf("SC_PAGE_SIZE"), 0
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if not size:
                continue
            with open(path, "rb") as fh:
                mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
                addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
                n = (size + page - 1) // page
                vec = (ctypes.c_ubyte * n)()
                assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
                total += sum(v & 1 for v in vec) * page
                del vec
                mm.close()
    return total
from peft import LoraConfig, get_peft_model
from deg_hf.streaming.build import build_streamed_model, materialize_adapters
path, cache = sys.argv[1], sys.argv[2]
before = status("VmRSS")
model, runtime = build_streamed_model(path, device="cpu", dtype=torch.float32, cache_dir=cache, tier="auto",
                                      host_mem_gb=0.2, progress=False)
model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
materialize_adapters(model, "cpu")
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(7, 60, (1, 16))
for _ in range(3):
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
stats = runtime.stats()
resident = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
print(json.dumps({"before": before, "peak": status("VmHWM"), "store": stats["store_bytes"],
                  "ring": stats["tiers"]["disk"]["ring_bytes"], "buffers": stats["buffer_bytes"],
                  "resident": resident, "cached": cached_bytes(cache), "tiers": stats["tiers"]}))
"""


@pytest.mark.slow
def test_disk_tier_memory_and_page_cache_stay_bounded(checkpoint, tmp_path):
    """A 1.55 GiB store trained from disk with host_mem_gb=0.2: RSS grows by the staging ring, the
    store's RAM share (what host_mem_gb allows) and the weights resident on the device (on CPU: the
    device buffers, embeddings, head, adapters) plus 300 MiB at most; it does not grow with the model.
    The page cache holds under two rings' worth of the cache files."""
    path = checkpoint("llama", n_layers=8, hidden=2048, intermediate_size=6400)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, path, str(tmp_path / "cache")], capture_output=True,
                         text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["store"] >= 1.5 * 2**30
    # 0.2 GiB holds one 198 MiB layer: the rest stream from disk
    assert got["tiers"]["placement"] == "ram 0, disk 1-7"
    growth = got["peak"] - got["before"]
    bound = got["ring"] + got["buffers"] + got["tiers"]["ram"]["bytes"] + got["resident"] + 300 * 2**20
    assert growth <= bound, (growth / 2**20, bound / 2**20)
    assert got["cached"] < 2 * got["ring"], (got["cached"] / 2**20, got["ring"] / 2**20)
    assert got["tiers"]["disk"]["bytes_read"] >= 3 * got["store"]  # it really streamed from disk each step
