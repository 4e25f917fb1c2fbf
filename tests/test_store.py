"""WeightStore: sharded checkpoints with and without an index, the pinning fallback, and an on-disk
cache keyed by the source's fingerprint (never by name)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import requires_cuda


def _layer_keys(path, n_layers=2):
    from safetensors import safe_open

    from deg_hf.streaming.store import safetensors_files

    keys = [{} for _ in range(n_layers)]
    for f in safetensors_files(path):
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                if k.startswith("model.layers."):
                    i = int(k.split(".")[2])
                    keys[i][k.split(".", 3)[3]] = k
    return keys


def _full_state(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.parametrize("keep_index", [True, False])
def test_sharded_checkpoint_with_or_without_index(checkpoint, tmp_path, keep_index):
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming.store import WeightStore

    src = checkpoint("llama")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    shards = [n for n in os.listdir(sharded) if n.endswith(".safetensors")]
    assert len(shards) > 1
    if not keep_index:
        os.remove(sharded / "model.safetensors.index.json")
    store = WeightStore(str(sharded), _layer_keys(str(sharded)), torch.float32, progress=False)
    state = model.state_dict()
    for i in range(store.n_layers):
        for local, tensor in store.host_views(i).items():
            assert torch.equal(tensor, state[f"model.layers.{i}.{local}"])


def test_pinning_failure_falls_back_to_pageable_memory_with_a_warning(checkpoint, monkeypatch):
    from deg_hf.streaming import store as store_mod

    real_empty = torch.empty

    def failing_empty(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("cannot pin memory (injected)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(store_mod.torch, "empty", failing_empty)
    path = checkpoint("llama")
    with pytest.warns(UserWarning, match="pageable memory"):
        store = store_mod.WeightStore(path, _layer_keys(path), torch.float32, pin=True, progress=False)
    assert store.pinned is False and store.nbytes > 0


def test_cache_is_keyed_by_fingerprint_so_a_retrained_checkpoint_is_never_stale(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming.store import WeightStore, fingerprint

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint("llama"), path)
    cache = tmp_path / "cache"
    first = WeightStore(str(path), _layer_keys(str(path)), torch.float32, cache_dir=str(cache), progress=False)
    assert os.listdir(cache) == [f"{first.fingerprint}-float32"]
    again = WeightStore(str(path), _layer_keys(str(path)), torch.float32, cache_dir=str(cache), progress=False)
    assert torch.equal(again.flat[0], first.flat[0])  # served from the cache

    # retrain: same directory name, new weights -> new fingerprint, fresh read, not the stale cache
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(1.0)
    model.save_pretrained(str(path))
    assert fingerprint(str(path)) != first.fingerprint
    fresh = WeightStore(str(path), _layer_keys(str(path)), torch.float32, cache_dir=str(cache), progress=False)
    assert torch.equal(fresh.host_views(0)["mlp.up_proj.weight"], model.model.layers[0].mlp.up_proj.weight)
    assert not torch.equal(fresh.flat[0], first.flat[0])
    assert len(os.listdir(cache)) == 2


@requires_cuda
@pytest.mark.cuda
def test_cuda_pinned_store_prefetch_and_lower_peak_than_resident(checkpoint):
    import gc

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters

    path = checkpoint("llama", n_layers=8, hidden=256, vocab=512)
    ids = torch.randint(7, 40, (2, 64), device="cuda")

    def peak(model):
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    streamed, runtime = build_streamed_model(path, device="cuda", dtype=torch.float32)
    streamed = get_peft_model(streamed, lora)
    materialize_adapters(streamed, "cuda")
    assert runtime.store.pinned
    streamed_peak = peak(streamed)
    stats = runtime.stats()
    assert stats["in_flight_peak"] <= 2 and stats["loads"] >= 8
    resident = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda(), lora)
    resident.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})
    assert streamed_peak < peak(resident)
    runtime.close()
