"""Split-and-retry inside real trainer.train() runs with gradient accumulation (SFT, DPO, KTO):
the same gradient as the unsplit step, skips that leave no trace, errors that propagate."""

from __future__ import annotations

import json
import os

import pytest
import torch
from harness import kto_rows, pref_rows, randomise_lora_b, sft_rows, trainer_kwargs
from transformers import TrainerCallback

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
TASKS = {
    "sft": ("StreamedSFTTrainer", "StreamedSFTConfig", sft_rows),
    "dpo": ("StreamedDPOTrainer", "StreamedDPOConfig", pref_rows),
    "kto": ("StreamedKTOTrainer", "StreamedKTOConfig", kto_rows),
}


def build(task, path, out, rows=12, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    import deg_hf

    trainer_name, config_name, make_rows = TASKS[task]
    kwargs = trainer_kwargs(str(out), max_length=32, max_steps=1, gradient_accumulation_steps=2,
                            per_device_train_batch_size=3)
    kwargs.update(overrides)
    trainer = getattr(deg_hf, trainer_name)(
        model=path,
        args=getattr(deg_hf, config_name)(**kwargs),
        train_dataset=Dataset.from_list(make_rows(rows)),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(**LORA),
    )
    torch.manual_seed(5)
    randomise_lora_b(trainer.model)
    return trainer


class Capture(TrainerCallback):
    """Gradients just before each optimizer step; weights, optimizer and scheduler after it."""

    def __init__(self, trainer):
        self.trainer, self.grads, self.after = trainer, [], []

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.grads.append({n: p.grad.clone() for n, p in self.trainer.model.named_parameters() if p.grad is not None})

    def on_step_end(self, args, state, control, **kw):
        opt = self.trainer.optimizer
        self.after.append({
            "weights": {n: p.detach().clone() for n, p in self.trainer.model.named_parameters() if p.requires_grad},
            "moments": {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                        for i, s in enumerate(opt.state.values())},
            "scheduler": self.trainer.lr_scheduler.last_epoch,
        })


def run(trainer):
    cap = Capture(trainer)
    trainer.add_callback(cap)
    trainer.train()
    return cap


def oom(*_):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")


def assert_close_gradients(got, want):
    assert got.keys() == want.keys() and want
    full = float(torch.stack([g.norm() for g in want.values()]).norm())
    for name, g in want.items():
        assert float((got[name] - g).norm()) <= 1e-4 * float(g.norm()) + 1e-6 * full, name


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


# ----------------------------------------------------------------------------- split equals unsplit


@pytest.mark.parametrize("task", list(TASKS))
def test_split_and_retry_gives_the_unsplit_gradient_and_loss(checkpoint, tmp_path, task):
    path = checkpoint("llama")
    ref = build(task, path, tmp_path / "ref")
    want = run(ref)
    assert ref.deg_counters["oom_retry"] == 0

    seen = []

    def fault(info, phase):
        seen.append((phase, len(info)))
        if len(info) > 2 and phase == "forward":
            oom()
        if len(info) > 1 and phase == "backward":  # after the part's gradients were written
            oom()

    split = build(task, path, tmp_path / "split")
    split.set_fault_hook(fault)
    got = run(split)
    counters = split.deg_counters
    assert counters["oom_retry"] > 0 and counters["parts"] > 2
    assert ("backward", 2) in seen  # a part failed after writing its gradients, and was restored
    if counters["oom_skip"] == 0:
        assert_close_gradients(got.grads[0], want.grads[0])
        loss_ref = next(h["loss"] for h in ref.state.log_history if "loss" in h)
        loss_split = next(h["loss"] for h in split.state.log_history if "loss" in h)
        assert loss_split == pytest.approx(loss_ref, rel=1e-4, abs=1e-6)
    else:  # an example too long for the backward threshold: covered by the skip tests
        pytest.fail(f"unexpected skip in the split test: {counters}")


def test_cuda_oom_runtime_error_is_recognised_and_other_errors_propagate(checkpoint, tmp_path):
    from deg_hf.memory.split_retry import is_oom

    assert is_oom(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom(torch.OutOfMemoryError("x"))
    assert not is_oom(RuntimeError("expected scalar type Float"))
    assert not is_oom(ValueError("out of patience"))

    trainer = build("sft", checkpoint("llama"), tmp_path)

    def fault(info, phase):
        raise ValueError("not memory")

    trainer.set_fault_hook(fault)
    with pytest.raises(ValueError, match="not memory"):
        trainer.train()
    assert trainer.deg_counters["oom_retry"] == 0


# ----------------------------------------------------------------------------- skips


class DropExample:
    """A collator that leaves example ``position`` out of its ``call``-th micro-batch: the batch of a
    run that never contained that example."""

    def __init__(self, collator, call, position):
        self.collator, self.call, self.position, self.calls = collator, call, position, 0

    def __call__(self, features):
        features = list(features)
        if self.calls == self.call:
            del features[self.position]
        self.calls += 1
        return self.collator(features)


@pytest.mark.parametrize("task", list(TASKS))
def test_a_skipped_example_leaves_no_trace(checkpoint, tmp_path, task):
    path = checkpoint("llama")
    micro_batch, position = 1, 1

    never = build(task, path, tmp_path / "never")
    never.data_collator.collator = DropExample(never.data_collator.collator, micro_batch, position)
    want = run(never)

    # 1 skip in 6 examples: past the default oom_max_skip_fraction, which test_memory_limits.py covers
    skipping = build(task, path, tmp_path / "skip", oom_max_skip_fraction=0.5)
    row = []

    def fault(info, phase):  # that example never fits, not even alone; the rest always do
        if info.micro_batch == micro_batch and position in info.indices:
            row.append(info.uids[info.indices.index(position)])
            oom()

    skipping.set_fault_hook(fault)
    got = run(skipping)
    assert skipping.deg_counters["oom_skip"] == 1 and skipping.deg_counters["skipped"] == row[-1:]
    assert row[-1] in range(len(skipping.train_dataset))  # a dataset row id
    assert_same(got.grads[0], want.grads[0])  # bit for bit
    assert_same(got.after[0], want.after[0])  # weights, optimizer moments, scheduler
    rows = [json.loads(x) for x in open(os.path.join(tmp_path / "skip", "train.log.jsonl"))]
    skips = [r for r in rows if r.get("event") == "oom_skip"]
    assert [(s["micro_batch"], s["index"]) for s in skips] == [(micro_batch, position)]


def test_a_window_with_every_example_skipped_takes_no_step(checkpoint, tmp_path):
    trainer = build("sft", checkpoint("llama"), tmp_path, max_steps=2, learning_rate=1e-2, oom_max_skip_fraction=0.5)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    def fault(info, phase):
        if info.step == 0:
            oom()

    trainer.set_fault_hook(fault)
    cap = run(trainer)
    first, second = cap.after
    assert_same(first["weights"], initial)
    assert first["moments"] == {} and first["scheduler"] == 0  # no optimizer step, no scheduler step
    assert cap.grads[0] == {}  # and no gradient left behind
    assert second["scheduler"] == 1 and second["moments"]  # the next window trains as usual
    assert any(not torch.equal(second["weights"][n], initial[n]) for n in initial)
    assert trainer.deg_counters["oom_skip"] == 6  # 2 micro-batches x 3 examples
    rows = [json.loads(x) for x in open(tmp_path / "train.log.jsonl")]
    assert any(r.get("event") == "step_skipped" for r in rows)


# ----------------------------------------------------------------------------- logs


def test_counters_and_events_reach_the_logs_and_train_log_jsonl(checkpoint, tmp_path):
    trainer = build("dpo", checkpoint("llama"), tmp_path, max_steps=2, rows=24, oom_max_skip_fraction=0.2)

    def fault(info, phase):
        if len(info) > 1 and phase == "forward":
            oom()
        if info.micro_batch == 0 and 2 in info.indices:
            oom()

    trainer.set_fault_hook(fault)
    trainer.train()
    rows = [json.loads(x) for x in open(tmp_path / "train.log.jsonl")]
    plan = [r for r in rows if r.get("event") == "mem_plan"]
    assert len(plan) == 1 and "coefficients" in plan[0] and "static_gib" in plan[0]
    steps = [r for r in rows if "oom_retry" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    skips = [r for r in rows if r.get("event") == "oom_skip"]
    assert len(skips) == 2 and all(s["index"] == 2 and s["rows"] == 2 for s in skips)  # a pair: 2 rows
    assert sum(r["oom_skip"] for r in steps) == len(skips) == trainer.deg_counters["oom_skip"]
    assert sum(r["oom_retry"] for r in steps) == trainer.deg_counters["oom_retry"] > 0
    assert sum(r["parts"] for r in steps) == trainer.deg_counters["parts"]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert all("oom_retry" in h and "est_peak_gib" in h for h in logged)


# ----------------------------------------------------------------------------- an enforced CPU target


def test_an_enforced_cpu_target_forces_splits_and_keeps_the_gradient(checkpoint, tmp_path):
    """mem_plan off (nothing planned ahead) and a target the whole micro-batch does not fit: the CPU
    meter raises out-of-memory inside the part, split-and-retry recovers with the unsplit gradient."""
    from deg_hf.memory.calibrate import record
    from deg_hf.memory.coef import GIB

    path = checkpoint("llama")
    ref = build("sft", path, tmp_path / "ref")
    measured = record(ref)
    want = run(ref)
    in_use = ref.deg_memory.last.start_bytes
    whole = max(s.peak_bytes for s in measured)  # a 3-example micro-batch's peak
    target = in_use + 0.6 * whole  # one or two examples fit, three do not
    trainer = build("sft", path, tmp_path / "cpu", mem_target_gb=target / GIB, mem_plan=False)
    got = run(trainer)
    assert trainer.deg_memory.enforces and trainer.deg_memory.meter.raised > 0
    assert trainer.deg_counters["oom_retry"] > 0 and trainer.deg_counters["oom_skip"] == 0
    assert_close_gradients(got.grads[0], want.grads[0])

    control = build("sft", path, tmp_path / "control", mem_target_gb=target / GIB, mem_plan=False, oom_retry=False)
    with pytest.raises(torch.OutOfMemoryError, match="CPU out of memory"):  # the meter really bites
        control.train()


# ----------------------------------------------------------------------------- pre-flight


def test_preflight_budgets_rows_per_example_per_trainer(checkpoint, tmp_path):
    """DPO budgets 2 rows per example and KTO 2 examples x (1 row + its KL row): a target between
    the SFT and the DPO need admits SFT and refuses DPO; one between DPO and KTO refuses KTO."""
    from transformers import AutoConfig

    from deg_hf.config import StreamConfig
    from deg_hf.memory.coef import GIB
    from deg_hf.memory.preflight import make_planner

    path = checkpoint("llama")
    config = AutoConfig.from_pretrained(path).to_dict()
    settings = StreamConfig(mem_target_gb=1.0)
    planner = make_planner(config, settings, device=torch.device("cpu"), streaming=True, trainable_params=4096,
                           dtype_bytes=4, rows_per_example=1, attn_implementation=None, fused_lm_head=True)

    def need(rows, max_length=32):
        return planner.static_bytes + planner.estimate(planner.features_of(rows, max_length))

    def target_between(lo_rows, hi_rows):
        lo, hi = need(lo_rows), need(hi_rows)
        assert lo < hi
        return (lo + hi) / 2 / GIB

    # the planner used by the trainer counts the trainer's own LoRA size; keep our margins wide
    mid_1_2 = target_between(1, 2)
    build("sft", path, tmp_path / "sft", mem_target_gb=mid_1_2, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=r"StreamedDPOTrainer cannot fit.*2 row"):
        build("dpo", path, tmp_path / "dpo", mem_target_gb=mid_1_2, per_device_train_batch_size=2)
    mid_2_4 = target_between(2, 4)
    build("dpo", path, tmp_path / "dpo2", mem_target_gb=mid_2_4, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=r"StreamedKTOTrainer cannot fit.*2 example"):
        build("kto", path, tmp_path / "kto", mem_target_gb=mid_2_4, per_device_train_batch_size=2)
