"""The tensor-memory meter (deg_hf.memory.meter): exact on a known allocation pattern, a leak shows up,
the backward pass and checkpoint recomputation are counted, the CPU target raises out-of-memory at the
allocation that crosses it, and measuring changes no number of a training step."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from deg_hf.memory.meter import DeviceMemory, TensorMeter


def test_the_meter_reads_a_known_allocation_pattern_exactly():
    meter = TensorMeter()
    with meter:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(250, dtype=torch.float64)  # 2000
        view = a.view(10, 100)  # a view: no new storage
        a.add_(1.0)  # in place: nothing new
        torch.mul(b, 2, out=b)  # written into an input: nothing new
        c = a + 1  # 4000, freed below
        del c
        d = torch.empty(10, dtype=torch.int64)  # 80
        halves = a.split(500)  # views
    assert meter.allocations == 4
    assert meter.allocated == 4000 + 2000 + 80
    assert meter.peak == 4000 + 2000 + 4000
    del a, view, halves  # the storage dies with its last view, the meter hears of it outside the mode too
    assert meter.allocated == 2000 + 80
    del b, d
    assert meter.allocated == 0


def test_a_leaked_tensor_shows_up_and_the_same_step_without_the_leak_reads_zero():
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 32, requires_grad=True)

    def step(leak):
        meter = TensorMeter()
        with meter:
            h = (x @ w).tanh()
            if leak is not None:
                leak.append(h.detach() * 1.0)  # kept past the step: 64 x 32 floats
            h.sum().backward()
        x.grad = w.grad = None  # the gradients are the step's output, not a leak
        return meter

    kept: list = []
    clean, leaky = step(None), step(kept)
    assert clean.allocated == 0  # everything the step allocated was freed (control)
    assert leaky.allocated == 64 * 32 * 4
    assert leaky.peak == clean.peak + 64 * 32 * 4
    kept.clear()
    assert leaky.allocated == 0


class _BigBackward(torch.autograd.Function):
    """Identity forward; its backward allocates one known buffer before returning the gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _BigBackward.threads.add(threading.get_ident())
        scratch = torch.zeros(1 << 16)  # 256 KiB, alive until backward returns
        return grad + scratch[: grad.numel()].view_as(grad)


def test_the_backward_pass_and_checkpoint_recomputation_are_counted():
    _BigBackward.threads = set()
    x = torch.randn(8, 8, requires_grad=True)
    meter = TensorMeter()
    with meter:
        y = _BigBackward.apply(x).sum()
        meter.reset_peak()
        y.backward()
    # the engine ran the backward with the mode it captured when backward() was called
    assert meter.peak_above_base() >= (1 << 16) * 4
    outside = TensorMeter()
    with outside:
        y = _BigBackward.apply(x).sum()
    outside.reset_peak()
    y.backward()  # the mode is off here: the backward's scratch goes unseen (control)
    assert outside.peak_above_base() == 0

    # non-reentrant checkpointing recomputes the block in the backward: its 512 x 512 intermediate
    # is counted again there, on top of the gradients
    lin = torch.nn.Linear(512, 512, bias=False)
    inp = torch.randn(512, 512, requires_grad=True)
    meter = TensorMeter()
    with meter:
        out = torch.utils.checkpoint.checkpoint(lambda t: lin(t).relu().sum(), inp, use_reentrant=False)
        meter.reset_peak()
        out.backward()
    block = 512 * 512 * 4
    assert meter.peak_above_base() >= 3 * block  # recomputed lin(t), its relu, and a gradient at least


def test_the_target_raises_out_of_memory_at_the_crossing_allocation_in_forward_and_backward():
    meter = TensorMeter()
    with meter:
        meter.reset_peak(limit=10_000)
        a = torch.empty(1000)  # 4000: fits
        b = torch.empty(1000)  # 8000: fits
        with pytest.raises(torch.OutOfMemoryError, match="CPU out of memory"):
            torch.empty(1000)  # 12000: the crossing allocation
        assert meter.raised == 1
        del a, b
        torch.empty(2000)  # room again once freed
    x = torch.randn(8, 8, requires_grad=True)
    y = _BigBackward.apply(x).sum()
    meter = TensorMeter()
    with meter:
        meter.reset_peak(limit=100_000)
        with pytest.raises(torch.OutOfMemoryError):
            y.backward()  # the 256 KiB scratch inside the backward crosses it
    assert x.grad is None


def test_device_memory_is_off_on_cpu_without_a_target_and_enforces_one():
    off = DeviceMemory("cpu")
    assert off.meter is None and not off.measures and not off.enforces
    with off.part() as reading:
        torch.empty(1000)
    assert reading.peak_bytes == 0

    held = torch.empty(2500)  # 10000 bytes the trainer keeps on the device
    memory = DeviceMemory("cpu", target_bytes=30_000, resident=lambda: [held, None])
    with memory.part() as reading:
        torch.empty(4000)  # 16000: start 10000 + 16000 < 30000
    assert reading.start_bytes == 10_000 and reading.peak_bytes == 16_000 and reading.limit_bytes == 20_000
    with pytest.raises(torch.OutOfMemoryError), memory.part():
        torch.empty(6000)  # 24000 more: past the target
    assert memory.last.out_of_memory


def test_measuring_changes_no_number_of_a_training_step(checkpoint):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = checkpoint("llama")
    grads = []
    for metered in (False, True):
        torch.manual_seed(0)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                               LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights="gaussian"))
        ids = torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(1))
        meter = TensorMeter()
        with meter if metered else contextlib.nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if metered:
            assert meter.peak > 0
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert torch.equal(grads[0][name], grads[1][name]), name
