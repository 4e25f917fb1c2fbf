"""4-bit (NF4/FP4) streaming: the store holds bitsandbytes' own bytes, a streamed NF4 model computes
what resident QLoRA (transformers + bitsandbytes + PEFT) computes, every trainer trains on it, a
pre-quantized checkpoint streams as it is, and the store fills without a full-precision model.

bitsandbytes 0.50 runs NF4 on CPU, so resident QLoRA is the reference here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from harness import ARCHS, copy_adapters, lora_grads, randomise_lora_b, sft_rows, trainer_kwargs

bnb = pytest.importorskip("bitsandbytes")

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
SEP = "#"


def _bnb_config(quant_type="nf4", double=True, dtype=torch.float32, **extra):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                              bnb_4bit_compute_dtype=dtype, **extra)


def _resident_4bit(path, dtype=torch.float32, **cfg):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=_bnb_config(dtype=dtype, **cfg),
                                                device_map="cpu", dtype=dtype)


def _streamed(path, quant_type="nf4", double=True, dtype=torch.float32, skip=None, **kwargs):
    from deg_hf.streaming.build import build_streamed_model
    from deg_hf.streaming.quant import QuantSpec

    spec = QuantSpec(quant_type, 64, double, tuple(skip) if skip else None)
    return build_streamed_model(path, device="cpu", dtype=dtype, quantization=spec, progress=False, **kwargs)


def _stored_pieces(store, i, name):
    views = store.layouts[i].views(store.block(i))
    return {k.split(SEP)[1]: v for k, v in views.items() if k.startswith(name + SEP)}


def _params4bit_pieces(weight):
    qs = weight.quant_state
    out = {"packed": weight.data.view(torch.uint8), "absmax": qs.absmax, "code": qs.code}
    if qs.nested:
        out.update(nested_absmax=qs.state2.absmax, nested_code=qs.state2.code, offset=qs.offset)
    return out


def _assert_same_bytes(store, resident, prefix="model.layers"):
    """Every Linear4bit weight of the resident model is in the store, piece for piece, byte for byte;
    and the store quantized nothing else."""
    compared = 0
    for i, layer in enumerate(resident.get_submodule(prefix)):
        fourbit = {f"{n}.weight" for n, m in layer.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
        assert set(store.layouts[i].quantized) == fourbit
        for name in fourbit:
            want = _params4bit_pieces(layer.get_submodule(name[: -len(".weight")]).weight)
            got = _stored_pieces(store, i, name)
            assert got.keys() == want.keys(), name
            for piece, tensor in want.items():
                assert got[piece].dtype == tensor.dtype, (name, piece)
                assert torch.equal(got[piece].reshape(-1), tensor.reshape(-1)), (i, name, piece)
                compared += 1
    return compared


# ----------------------------------------------------------------------------- same bytes


@pytest.mark.parametrize("arch", ARCHS)
def test_store_holds_the_bytes_transformers_quantizes_to(checkpoint, arch):
    path = checkpoint(arch)
    _, runtime = _streamed(path)
    resident = _resident_4bit(path)
    assert _assert_same_bytes(runtime.store, resident) >= 2 * 7 * 6
    runtime.close()


@pytest.mark.parametrize("case", ["fp4-single", "bf16", "chunked", "skip-list"])
def test_same_bytes_for_other_settings(checkpoint, monkeypatch, case):
    from deg_hf.streaming import store as store_mod

    path = checkpoint("llama")
    kwargs, bnb_kwargs, dtype = {}, {}, torch.float32
    if case == "fp4-single":
        kwargs = bnb_kwargs = {"quant_type": "fp4", "double": False}
    elif case == "bf16":
        dtype = torch.bfloat16
    elif case == "chunked":  # the host quantizer in pieces of 2 blocks gives the whole-tensor bytes
        monkeypatch.setattr(store_mod, "_QUANT_CHUNK", 128)
    else:
        kwargs, bnb_kwargs = {"skip": ["down_proj"]}, {"llm_int8_skip_modules": ["down_proj"]}
    _, runtime = _streamed(path, dtype=dtype, **kwargs)
    resident = _resident_4bit(path, dtype=dtype, **bnb_kwargs)
    assert _assert_same_bytes(runtime.store, resident) > 0
    if case == "skip-list":
        assert all("mlp.down_proj.weight" not in lay.quantized for lay in runtime.store.layouts)
        assert "mlp.down_proj.weight" in runtime.store.host_views(0)  # stored at full precision instead


def test_a_corrupted_byte_is_caught_by_the_comparison(checkpoint):
    """Control: the byte comparison above is not vacuous."""
    path = checkpoint("llama")
    _, runtime = _streamed(path)
    resident = _resident_4bit(path)
    piece = _stored_pieces(runtime.store, 1, "mlp.up_proj.weight")["packed"]
    piece[3] ^= 0x10
    with pytest.raises(AssertionError):
        _assert_same_bytes(runtime.store, resident)


# ----------------------------------------------------------------------------- streamed vs resident QLoRA


def _qlora_pair(path, **kwargs):
    from peft import LoraConfig, get_peft_model

    from deg_hf.streaming.build import materialize_adapters

    model, runtime = _streamed(path, **kwargs)
    streamed = get_peft_model(model, LoraConfig(**LORA))
    materialize_adapters(streamed, "cpu")
    resident = get_peft_model(_resident_4bit(path), LoraConfig(**LORA))
    assert randomise_lora_b(streamed) > 0
    assert copy_adapters(resident, streamed) > 0
    streamed.train()
    resident.train()
    return streamed, resident, runtime


def _batch(rows=3, length=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 40, (rows, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _within_split_tolerance(got: dict, want: dict) -> None:
    total = torch.sqrt(sum(w.double().pow(2).sum() for w in want.values())).item()
    assert got.keys() == want.keys() and want
    for name in want:
        err = (got[name] - want[name]).norm().item()
        assert err <= 1e-4 * want[name].norm().item() + 1e-6 * total, name


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_streamed_nf4_matches_resident_qlora(checkpoint, arch):
    streamed, resident, runtime = _qlora_pair(checkpoint(arch))
    batch = _batch()
    out_s, out_r = streamed(**batch), resident(**batch)
    # bit-exact: both dequantize with the same bitsandbytes ops into float32 and multiply with F.linear
    assert (out_s.logits - out_r.logits).abs().max().item() == 0.0
    assert out_s.loss.item() == out_r.loss.item()
    out_s.loss.backward()
    out_r.loss.backward()
    gs, gr = lora_grads(streamed), lora_grads(resident)
    _within_split_tolerance(gs, gr)
    assert max((gs[n] - gr[n]).abs().max().item() for n in gs) == 0.0  # and in fact exact on CPU float32
    # the 4-bit base is what runs: its logits differ from the full-precision base's
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32)
    with torch.no_grad(), streamed.disable_adapter():
        quantized_base = streamed(**batch).logits
    assert (quantized_base - full(**batch).logits).abs().max().item() > 1e-4
    assert runtime.stats()["dequantized"] > 0
    runtime.close()


def test_no_bitsandbytes_autograd_function_in_the_streamed_backward(checkpoint):
    def node_names(loss):
        seen, stack, names = set(), [loss.grad_fn], set()
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            names.add(type(fn).__name__)
            stack.extend(f for f, _ in fn.next_functions)
        return names

    streamed, resident, _ = _qlora_pair(checkpoint("llama"))
    batch = _batch()
    resident_nodes = node_names(resident(**batch).loss)
    assert any("MatMul4Bit" in n for n in resident_nodes)  # control: the walk sees bitsandbytes' function
    # under checkpointing the streamed layers' backward nodes exist only during recompute: look there too
    seen = set()

    def hook(module, args, output):
        if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.grad_fn is not None:
            seen.update(node_names(output))

    layer = streamed.base_model.model.model.layers[0]
    inner = layer.mlp.down_proj
    handle = inner.register_forward_hook(hook)
    try:
        streamed(**batch).loss.backward()
    finally:
        handle.remove()
    assert seen and not any("MatMul4Bit" in n for n in seen)


def test_ten_optimizer_steps_streamed_nf4_equal_resident_qlora(checkpoint, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    path = checkpoint("llama")

    def make(stream):
        args = StreamedSFTConfig(**trainer_kwargs(str(tmp_path / str(stream)), max_length=32, max_steps=10,
                                                  stream_layers=stream, stream_quantization="nf4",
                                                  gradient_checkpointing=False))
        return StreamedSFTTrainer(model=path, args=args, train_dataset=Dataset.from_list(sft_rows(40)),
                                  processing_class=AutoTokenizer.from_pretrained(path), peft_config=LoraConfig(**LORA))

    streamed, resident = make(True), make(False)
    assert streamed.stream_runtime.store.quantized
    fourbit = [m for m in resident.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert fourbit, "the resident reference must really be QLoRA"
    # TRL casts a quantized model's adapters to bf16 (the QLoRA paper's advice for bf16 compute); the
    # streamed model reaches TRL unquantized, so its adapters keep the training dtype. Same dtype on both
    # sides, so the comparison measures the streaming, not the adapter dtype.
    with torch.no_grad():
        for p in resident.model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    randomise_lora_b(streamed.model)
    copy_adapters(resident.model, streamed.model)
    before = {k: v.clone() for k, v in streamed.model.state_dict().items() if "lora_" in k}
    streamed.train()
    resident.train()
    got = {k: v for k, v in streamed.model.state_dict().items() if "lora_" in k}
    want = {k: v for k, v in resident.model.state_dict().items() if "lora_" in k}
    _within_split_tolerance(got, want)
    assert any(not torch.equal(got[k], before[k]) for k in got)  # it trained


# ----------------------------------------------------------------------------- every trainer


@pytest.mark.parametrize("task", ["sft", "dpo", "kto", "orpo", "simpo"])
def test_every_trainer_trains_on_nf4_with_one_store_and_no_reference_model(checkpoint, tmp_path, task):
    from datasets import Dataset
    from peft import LoraConfig
    from test_preference import build
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer
    from deg_hf.streaming import store

    path = checkpoint("llama")
    before = store.CONSTRUCTED
    if task == "sft":
        trainer = StreamedSFTTrainer(
            model=path, args=StreamedSFTConfig(**trainer_kwargs(str(tmp_path), max_length=32, stream_quantization="nf4")),
            train_dataset=Dataset.from_list(sft_rows(12)), processing_class=AutoTokenizer.from_pretrained(path),
            peft_config=LoraConfig(**LORA))
    else:
        trainer = build(task, path, tmp_path, stream_quantization="nf4")
    assert store.CONSTRUCTED - before == 1
    assert getattr(trainer, "ref_model", None) is None
    runtime = trainer.stream_runtime
    assert runtime.store.quantized and runtime.stats()["quantization"]["quant_type"] == "nf4"
    start = {k: v.clone() for k, v in trainer.model.state_dict().items() if "lora_" in k}
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(v, start[k]) for k, v in trainer.model.state_dict().items() if "lora_" in k)
    stats = runtime.stats()
    assert stats["bytes_moved"] > 0 and stats["dequantized"] > 0
    # honest parameter counts: the base counts at its true size, not as packed 4-bit placeholders
    from deg_hf.memory.static import layer_param_count

    base = trainer.model.base_model.model
    true_total = sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n)
    assert trainer.model.get_nb_trainable_parameters()[1] == true_total + trainer.model.get_nb_trainable_parameters()[0]
    assert true_total >= base.config.num_hidden_layers * layer_param_count(base.config.to_dict())
    trainer.release_stream()


@pytest.mark.parametrize("task", ["dpo", "kto"])
def test_nf4_reference_differs_from_policy_and_equals_it_with_lora_b_zero(checkpoint, tmp_path, task):
    from test_preference import build, first_batch, policy_logps_dpo, policy_logps_kto

    trainer = build(task, checkpoint("llama"), tmp_path, stream_quantization="nf4")
    batch = first_batch(trainer)

    def ref_and_policy():
        ref = trainer.compute_ref_log_probs(trainer.model, batch)  # TRL's own reference path
        if task == "dpo":
            return torch.cat(ref), torch.cat(policy_logps_dpo(trainer, batch))
        return (ref[0] if isinstance(ref, tuple) else ref), policy_logps_kto(trainer, batch)

    randomise_lora_b(trainer.model)
    ref, policy = ref_and_policy()
    assert (policy - ref).abs().max().item() > 1e-4
    with torch.no_grad():  # control: B = 0 makes the adapter a no-op, so reference == policy exactly
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    ref, policy = ref_and_policy()
    assert (policy - ref).abs().max().item() == 0.0
    trainer.release_stream()


# ----------------------------------------------------------------------------- large layers


def test_large_layer_gradients_equal_a_resident_model_of_the_dequantized_weights(checkpoint):
    """A decoder layer over 165 MiB unquantized (hidden 2048, intermediate 8192, float32: 268 MB),
    one device buffer: the streamed NF4 backward equals an ordinary model holding the dequantized
    weights. This is the size where bitsandbytes' own 4-bit matmul, holding the packed weight on its
    autograd context, reads a streaming buffer already refilled with another layer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming.build import materialize_adapters
    from deg_hf.streaming.quant import dequantize_into

    path = checkpoint("llama", n_layers=2, hidden=2048, intermediate_size=8192)
    model, runtime = _streamed(path, stream_buffers=1)
    store = runtime.store
    assert store.unquantized_bytes / store.n_layers > 165 * 2**20
    streamed = get_peft_model(model, LoraConfig(**LORA))
    materialize_adapters(streamed, "cpu")
    randomise_lora_b(streamed)

    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(plain.model.layers):
            lay = store.layouts[i]
            pieces = lay.views(store.block(i))
            for name, meta in lay.quantized.items():
                dequantize_into(name, meta, pieces, layer.get_parameter(name))
    resident = get_peft_model(plain, LoraConfig(**LORA))
    copy_adapters(resident, streamed)
    # the two layers' weights differ, so a backward that read the wrong layer would show
    assert not torch.equal(plain.model.layers[0].mlp.up_proj.weight, plain.model.layers[1].mlp.up_proj.weight)
    batch = _batch(rows=2, length=8)
    streamed.train()
    resident.train()
    streamed(**batch).loss.backward()
    resident(**batch).loss.backward()
    gs, gr = lora_grads(streamed), lora_grads(resident)
    _within_split_tolerance(gs, gr)
    assert all(g.abs().sum() > 0 for n, g in gs.items() if "layers.0." in n)
    assert runtime.stats()["loads"] == 3  # one buffer: layers 0, 1 forward, then 0 again for its recompute
    runtime.close()


# ----------------------------------------------------------------------------- pre-quantized checkpoints


def test_prequantized_checkpoint_streams_as_saved_and_equals_a_resident_load(checkpoint, tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from deg_hf.streaming import quant
    from deg_hf.streaming.build import build_streamed_model, materialize_adapters
    from deg_hf.streaming.sources import CheckpointSource

    saved = tmp_path / "bnb-4bit"
    _resident_4bit(checkpoint("qwen2")).save_pretrained(saved)
    assert json.load(open(saved / "config.json"))["quantization_config"]["load_in_4bit"]

    reads = []
    real_read = CheckpointSource.read

    def recording_read(self, key, out=None):
        got = real_read(self, key, out)
        reads.append((key, got.dtype, got.numel()))
        return got

    monkeypatch.setattr(CheckpointSource, "read", recording_read)
    monkeypatch.setattr(quant, "quantize_into", lambda *a, **k: pytest.fail("a pre-quantized weight was re-quantized"))
    model, runtime = build_streamed_model(str(saved), device="cpu", dtype=torch.float32, progress=False)
    monkeypatch.undo()
    assert runtime.store.quantized and runtime.stats()["quantization"]["prequantized"]
    hidden = model.config.hidden_size
    # no full-precision copy of a 4-bit weight: every decoder Linear weight was read as uint8
    big_float_reads = [k for k, dt, n in reads if ".layers." in k and dt.is_floating_point and n >= hidden * hidden]
    assert big_float_reads == []

    resident = AutoModelForCausalLM.from_pretrained(str(saved), device_map="cpu", dtype=torch.float32)
    assert _assert_same_bytes(runtime.store, resident) > 0
    streamed = get_peft_model(model, LoraConfig(**LORA))
    materialize_adapters(streamed, "cpu")
    resident = get_peft_model(resident, LoraConfig(**LORA))
    randomise_lora_b(streamed)
    copy_adapters(resident, streamed)
    streamed.train()
    resident.train()
    batch = _batch()
    out_s, out_r = streamed(**batch), resident(**batch)
    assert (out_s.logits - out_r.logits).abs().max().item() == 0.0
    out_s.loss.backward()
    out_r.loss.backward()
    _within_split_tolerance(lora_grads(streamed), lora_grads(resident))
    runtime.close()


@pytest.mark.parametrize("method", ["8bit", "gptq", "awq"])
def test_other_quantization_methods_are_refused_with_the_reason(checkpoint, tmp_path, method):
    import shutil

    from deg_hf.streaming.build import build_streamed_model
    from deg_hf.streaming.store import StreamingError

    path = tmp_path / method
    shutil.copytree(checkpoint("llama"), path)
    cfg = json.load(open(path / "config.json"))
    cfg["quantization_config"] = (
        {"quant_method": "bitsandbytes", "load_in_8bit": True} if method == "8bit" else {"quant_method": method, "bits": 4}
    )
    json.dump(cfg, open(path / "config.json", "w"))
    with pytest.raises(StreamingError, match="unquantized base") as err:
        build_streamed_model(str(path), device="cpu", progress=False)
    assert ("8bit" if method == "8bit" else method) in str(err.value)


def test_quantization_requests_are_honoured_or_refused_by_name(checkpoint, tmp_path):
    from transformers import BitsAndBytesConfig

    from deg_hf import StreamedSFTConfig
    from deg_hf.streaming.quant import resolve_spec

    cfg = StreamedSFTConfig(**trainer_kwargs(str(tmp_path)))
    spec = resolve_spec(cfg, _bnb_config("nf4", double=True))
    assert (spec.quant_type, spec.double, spec.blocksize) == ("nf4", True, 64)
    assert resolve_spec(cfg, {"quant_method": "bitsandbytes", "load_in_4bit": True}).quant_type == "fp4"  # bnb default
    with pytest.raises(ValueError, match="8-bit"):
        resolve_spec(cfg, BitsAndBytesConfig(load_in_8bit=True))
    fp4 = StreamedSFTConfig(**trainer_kwargs(str(tmp_path), stream_quantization="fp4"))
    with pytest.raises(ValueError, match="disagree"):
        resolve_spec(fp4, _bnb_config("nf4"))
    with pytest.raises(ValueError, match="stream_quantization"):
        StreamedSFTConfig(**trainer_kwargs(str(tmp_path), stream_quantization="int4"))
    with pytest.raises(ValueError, match="stream_quant_blocksize"):
        StreamedSFTConfig(**trainer_kwargs(str(tmp_path), stream_quant_blocksize=100))


def test_bitsandbytes_missing_names_the_extra(monkeypatch):
    from deg_hf.streaming import quant

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r"deg_hf\[nf4\]"):
        quant.require_bitsandbytes()


def test_model_init_kwargs_quantization_config_streams_4bit(checkpoint, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer

    from deg_hf import StreamedSFTConfig, StreamedSFTTrainer

    path = checkpoint("llama")
    args = StreamedSFTConfig(**trainer_kwargs(str(tmp_path), max_length=32),
                             model_init_kwargs={"quantization_config": _bnb_config("nf4", double=True)})
    trainer = StreamedSFTTrainer(model=path, args=args, train_dataset=Dataset.from_list(sft_rows(8)),
                                 processing_class=AutoTokenizer.from_pretrained(path))
    q = trainer.stream_runtime.stats()["quantization"]
    assert q["quant_type"] == "nf4" and q["double_quant"] is True
    trainer.release_stream()


# ----------------------------------------------------------------------------- fill memory

_FILL_CHILD = r"""
import json, os, sys, torch
from deg_hf.streaming.quant import QuantSpec
from deg_hf.streaming.store import WeightStore
path, n_layers = sys.argv[1], int(sys.argv[2])
def status(field):  # VmHWM, not ru_maxrss: the latter keeps the forking parent's peak across exec
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
names = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
         "post_attention_layernorm.weight"]
keys = [{n: f"model.layers.{i}.{n}" for n in names} for i in range(n_layers)]
quantize = [set(n for n in names if n.endswith("proj.weight")) for _ in range(n_layers)]
before = status("VmRSS")
store = WeightStore(path, keys, torch.bfloat16, quant=QuantSpec("nf4", 64, True), quantize=quantize, progress=False)
peak = status("VmHWM")
print(json.dumps({"before": before, "peak": peak, "store": store.nbytes, "unquantized": store.unquantized_bytes,
                  "layer": store.unquantized_bytes // n_layers}))
"""


def _write_big_checkpoint(directory, n_layers, hidden, inter):
    """A sharded bf16 checkpoint, one shard per layer, written a layer at a time."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shapes = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (hidden, hidden),
              "self_attn.v_proj.weight": (hidden, hidden), "self_attn.o_proj.weight": (hidden, hidden),
              "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
              "mlp.down_proj.weight": (hidden, inter), "input_layernorm.weight": (hidden,),
              "post_attention_layernorm.weight": (hidden,)}
    weight_map = {}
    for i in range(n_layers):
        tensors = {f"model.layers.{i}.{n}": (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
                   for n, s in shapes.items()}
        fname = f"model-{i:05d}.safetensors"
        save_file(tensors, os.path.join(directory, fname))
        weight_map.update({k: fname for k in tensors})
        del tensors
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)


@pytest.mark.slow
def test_filling_a_4bit_store_never_holds_the_unquantized_model(tmp_path):
    n_layers, hidden, inter = 8, 2048, 8192
    _write_big_checkpoint(tmp_path / "big", n_layers, hidden, inter)
    out = subprocess.run([sys.executable, "-c", _FILL_CHILD, str(tmp_path / "big"), str(n_layers)],
                         capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["unquantized"] >= 2**30  # a bf16 store of at least 1 GiB
    assert got["store"] <= 0.3 * got["unquantized"]
    growth = got["peak"] - got["before"]
    bound = got["store"] + 2 * got["layer"] + 300 * 2**20
    assert growth <= bound, (growth / 2**20, bound / 2**20)
    assert growth >= got["store"]  # the measurement sees the store itself (not a vacuous bound)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_dequantization_is_a_small_share_of_the_step(checkpoint):
    """On CUDA the 4-bit weights are dequantized on the device into the compute buffer: under 5% of a
    training step at a realistic layer size (bf16, hidden 2048)."""
    from conftest import cuda_available

    if not cuda_available():
        pytest.skip("needs CUDA (run by scripts/gpu_check.sh)")
    import time

    from peft import LoraConfig, get_peft_model

    from deg_hf.streaming.build import build_streamed_model, materialize_adapters
    from deg_hf.streaming.quant import QuantSpec

    path = checkpoint("llama", n_layers=4, hidden=2048, intermediate_size=5632, vocab=256)
    model, runtime = build_streamed_model(path, device="cuda", dtype=torch.bfloat16,
                                          quantization=QuantSpec("nf4", 64, True), progress=False)
    model = get_peft_model(model, LoraConfig(**LORA))
    materialize_adapters(model, "cuda")
    ids = torch.randint(7, 60, (4, 512), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()  # warm-up
    torch.cuda.synchronize()
    runtime.reset_stats()
    t0 = time.perf_counter()
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / 3
    share = runtime.dequantize_seconds() / 3 / step
    assert runtime.stats()["dequantized"] >= 3 * 4
    assert share < 0.05, share
    runtime.close()


def test_the_planner_counts_quantized_layers_and_their_compute_buffers(checkpoint, tmp_path):
    """A streamed NF4 trainer plans with the quantized bytes of the layers in flight plus their
    dequantized compute buffers: the runtime's own device buffers, up to per-tensor constants."""
    from test_preference import build

    from deg_hf.memory.static import layer_linear_count, quant_bytes_per_weight, static_breakdown

    path = checkpoint("llama", hidden_size=128, intermediate_size=256)
    trainer = build("dpo", path, tmp_path, stream_quantization="nf4", mem_target_gb=4)
    runtime, planner = trainer.stream_runtime, trainer.deg_planner
    cfg = trainer.model.get_base_model().config.to_dict()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    est = static_breakdown(cfg, streaming=True, stream_buffers=runtime.n_buffers, lora_params=trainable,
                           dtype_bytes=4, quant_bytes_per_weight=quant_bytes_per_weight(64, True))
    assert planner.static_bytes == sum(est.values())
    actual = runtime.stats()["device_bytes_peak"]  # n_buffers x (packed layer block + compute buffer)
    counted = est["layers"] + est["dequantized"]
    per_tensor = runtime.n_buffers * runtime.stats()["quantization"]["weights_per_layer"] * (16 + 256 + 4) * 4
    assert counted <= actual <= counted + per_tensor + 4096, (counted, actual)
    # control: counted as an unquantized fp32 layer, or without the compute buffers, it is off
    assert abs(runtime.n_buffers * layer_linear_count(cfg) * 4 - actual) > per_tensor + 4096
    assert actual - est["layers"] > per_tensor + 4096
    trainer.release_stream()


def test_nf4_checkpoint_records_its_base_and_load_rebuilds_it(checkpoint, tmp_path):
    """deg.json records the 4-bit base, the card and ``deg-hf info`` say so, and ``deg_hf.load``
    rebuilds the same base: streamed and resident logits equal the trained model's."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import deg_hf
    from deg_hf.checkpoint import read_deg_json, summarize

    path = checkpoint("llama")
    trainer = deg_hf.StreamedSFTTrainer(
        model=path, args=deg_hf.StreamedSFTConfig(**trainer_kwargs(str(tmp_path / "run"), max_length=32, max_steps=1,
                                                                   stream_quantization="nf4")),
        train_dataset=Dataset.from_list(sft_rows(8)), processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA))
    assert randomise_lora_b(trainer.model) > 0
    trainer.train()
    final = tmp_path / "final"
    trainer.save_model(str(final))
    ids = _batch()["input_ids"]
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=ids).logits
    trainer.release_stream()

    record = read_deg_json(final)  # validates against the schema
    quant = record["base_model"]["quantization"]
    assert quant["method"] == "bitsandbytes-4bit" and quant["quant_type"] == "nf4"
    assert quant["blocksize"] == 64 and quant["double_quant"] is True and quant["compute_dtype"] == "float32"
    card = (final / "README.md").read_text()
    assert "trained against a **NF4** (4-bit, bitsandbytes) base" in card
    assert 'bnb_4bit_quant_type="nf4"' in card and "quantization_config=quantization" in card
    assert "NF4 (bitsandbytes 4-bit), blocksize 64, double quantization on, compute float32" in summarize(record)

    for streamed in (True, False):
        model, _ = deg_hf.load(final, streamed=streamed, device="cpu")
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        if streamed:
            runtime = model._deg_stream_runtime
            assert runtime.store.quantization()["quant_type"] == "nf4"
            runtime.close()
            assert (logits - expected).abs().max().item() == 0.0
        else:
            assert any(type(m).__name__ == "Linear4bit" for m in model.modules())
            assert (logits - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()

    # control: loading the recorded base unquantized changes the outputs
    record["base_model"]["quantization"] = None
    (final / "deg.json").write_text(json.dumps(record))
    model, _ = deg_hf.load(final, streamed=True, device="cpu")
    with torch.no_grad():
        assert (model(input_ids=ids).logits - expected).abs().max().item() > 1e-4
    model._deg_stream_runtime.close()


def test_a_second_run_reads_the_4bit_cache_back_and_other_settings_get_their_own(checkpoint, tmp_path, monkeypatch):
    """stream_cache_dir entries are keyed by the source and the 4-bit settings: a second run with the
    same settings reads the quantized store back (quantizing nothing), other settings quantize anew."""
    from deg_hf.streaming import quant as q
    from deg_hf.streaming.quant import QuantSpec

    calls = []
    for name in ("quantize_into", "quantize_chunked"):
        original = getattr(q, name)

        def counting(*args, _original=original, **kwargs):
            calls.append(1)
            return _original(*args, **kwargs)

        monkeypatch.setattr(q, name, counting)
    path, cache = checkpoint("llama"), tmp_path / "cache"

    def store_of(spec):
        calls.clear()
        model, runtime = _streamed(path, spec.quant_type, spec.double, cache_dir=str(cache))
        return runtime, len(calls)

    first, quantized = store_of(QuantSpec("nf4", 64, True))
    assert quantized > 0  # control: the counter sees the first fill
    again, quantized_again = store_of(QuantSpec("nf4", 64, True))
    assert quantized_again == 0
    assert all(torch.equal(a, b) for a, b in zip(first.store.flat, again.store.flat))
    keys = set(os.listdir(cache))
    assert len(keys) == 1 and next(iter(keys)).endswith("-float32-nf4-b64-dq")
    for runtime in (first, again):
        runtime.close()

    for spec in (QuantSpec("fp4", 64, True), QuantSpec("nf4", 64, False)):
        other, quantized = store_of(spec)
        assert quantized > 0
        other.close()
    assert len(set(os.listdir(cache))) == 3
