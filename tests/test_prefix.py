"""Shared-prefix preference forward: packed pairs give TRL's ordinary forward, loss and gradient."""

from __future__ import annotations

import logging

import pytest
import torch
from harness import copy_adapters, randomise_lora_b, trainer_kwargs

from deg_hf.prefix import pack

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
TRAINERS = {
    "dpo": ("StreamedDPOTrainer", "StreamedDPOConfig"),
    "orpo": ("StreamedORPOTrainer", "StreamedORPOConfig"),
    "simpo": ("StreamedSimPOTrainer", "SimPOConfig"),
}

LONG_PROMPTS = ["tell me about the sky and the river and the tree please",
                "what is a river and why is the stone blue or red",
                "how is the tree by the water and the fire today",
                "tell me about fire and water and the kind cat please"]


def rows(n=8, *, shared_prompts=False):
    out = []
    for i in range(n):
        prompt = LONG_PROMPTS[(i % 2 if shared_prompts else i) % len(LONG_PROMPTS)]
        out.append({"prompt": prompt,
                    "chosen": " good answer please thanks" if i % 2 else " sure good kind answer",
                    "rejected": " bad rude no" if i % 3 else " no"})
    return out


def build(task, path, out, *, share=True, stream=True, data=None, **overrides):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PreTrainedTokenizerFast

    import deg_hf

    trainer_name, config_name = TRAINERS[task]
    config = getattr(deg_hf, config_name)(
        **trainer_kwargs(str(out), max_length=64, stream_layers=stream, prefix_sharing=share, **overrides))
    return getattr(deg_hf, trainer_name)(
        model=path, args=config, train_dataset=Dataset.from_list(data or rows()),
        # the harness tokenizer, whatever model_type the config names
        processing_class=PreTrainedTokenizerFast.from_pretrained(path),
        peft_config=LoraConfig(**LORA))


def pair(task, path, tmp_path, **kw):
    """Two trainers on the same adapters (random B): prefix sharing on, and off."""
    on = build(task, path, tmp_path / "on", share=True, **kw)
    off = build(task, path, tmp_path / "off", share=False, **kw)
    assert off.deg_prefix is None
    randomise_lora_b(on.model)
    assert copy_adapters(off.model, on.model) > 0
    return on, off


def batch_of(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def assert_grads_close(got, want):
    assert want and set(got) == set(want)
    whole = torch.sqrt(sum((g.double() ** 2).sum() for g in want.values())).item()
    assert whole > 0
    for name, g in want.items():
        err = (got[name] - g).norm().item()
        assert err <= 1e-4 * g.norm().item() + 1e-6 * whole, (name, err, g.norm().item())


def loss_and_grads(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), grads(trainer.model)


def sequence_logps(task, trainer, batch):
    """Per-sequence (chosen, rejected) log-probs of the policy and, for DPO, of the reference."""
    model = trainer.model
    with torch.no_grad():
        if task != "dpo":
            out = trainer.concatenated_forward(model, batch)
            return {"policy": (out[0], out[1])}
        kwargs = {k: v for k, v in batch.items() if k not in {"completion_mask", "ref_chosen_logps", "ref_rejected_logps"}}
        labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        with trainer._deg_pairs(trainer._deg_prompt_lens(batch)) if trainer.deg_prefix else _null():
            logps = model(**kwargs, use_cache=False, labels=labels, fused_lm_head=True).log_probs.sum(1)
        return {"policy": logps.chunk(2), "reference": trainer.compute_ref_log_probs(model, batch)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- the packing itself


def test_pack_plan_shares_prompts_and_masks_branches_apart():
    # two pairs with the same prompt [5 6 7], one pair with its own; rows are [chosen; rejected]
    ids = torch.tensor([[5, 6, 7, 10, 11, 0], [5, 6, 7, 12, 0, 0], [8, 9, 20, 21, 22, 23],
                        [5, 6, 7, 13, 0, 0], [5, 6, 7, 10, 11, 0], [8, 9, 24, 0, 0, 0]])
    mask = (ids != 0).long()
    plan = pack.build(ids, mask, [3, 3, 2, 3, 3, 2])
    assert len(plan.groups) == 2  # one packed row per distinct prompt
    # the shared prompt once, and the completion [10 11] (chosen of pair 0 and rejected of pair 1) once
    assert plan.tokens_packed == (3 + 2 + 1 + 1) + (2 + 4 + 1)
    assert plan.tokens_rows == int(mask.sum())
    g0 = plan.input_ids[0].tolist()
    assert g0[:7] == [5, 6, 7, 10, 11, 12, 13]
    assert plan.position_ids[0, :7].tolist() == [0, 1, 2, 3, 4, 3, 3]  # every branch restarts after the prompt
    allowed = plan.mask(torch.float32)[0, 0] == 0
    assert allowed[5, :3].all() and not allowed[5, 3:5].any() and allowed[5, 5]  # branch 2 sees prompt and itself
    assert not allowed[6, 3:6].any()
    # unpacking puts every row's tokens back where the ordinary forward has them
    unpacked = plan.unpack(plan.input_ids[..., None].float())[..., 0].long()
    assert torch.equal(unpacked * mask, ids)


def test_pairs_that_do_not_share_a_prompt_are_not_packable():
    ids = torch.tensor([[5, 6, 10], [5, 9, 11]])
    with pytest.raises(pack.NotPackable, match="do not share their prompt"):
        pack.build(ids, torch.ones_like(ids), [2, 2])
    with pytest.raises(pack.NotPackable, match="right-padded"):
        pack.build(ids, torch.tensor([[0, 1, 1], [1, 1, 1]]), [2, 2])


# ----------------------------------------------------------------------------- equal to TRL's forward


CASES = [("dpo", "llama", {"loss_type": "sigmoid"}), ("dpo", "llama", {"loss_type": "ipo"}),
         ("dpo", "qwen2", {"loss_type": "sigmoid"}), ("dpo", "gemma2", {"loss_type": "hinge"}),
         ("dpo", "qwen3", {"loss_type": "sigmoid"}),
         ("orpo", "llama", {}), ("orpo", "qwen2", {}), ("orpo", "gemma2", {}),
         ("simpo", "llama", {}), ("simpo", "qwen2", {}), ("simpo", "gemma2", {})]


@pytest.mark.parametrize(("task", "arch", "extra"), CASES, ids=[f"{t}-{a}-{e.get('loss_type', '')}" for t, a, e in CASES])
def test_packed_forward_equals_the_ordinary_forward(checkpoint, tmp_path, task, arch, extra):
    on, off = pair(task, checkpoint(arch), tmp_path, **extra)
    batch = batch_of(on)
    got, want = sequence_logps(task, on, batch), sequence_logps(task, off, batch)
    for kind in want:
        for a, b in zip(got[kind], want[kind]):
            assert (a - b).abs().max().item() <= 1e-5, kind
    loss_on, grads_on = loss_and_grads(on, batch)
    loss_off, grads_off = loss_and_grads(off, batch)
    assert abs(loss_on.item() - loss_off.item()) <= 1e-5
    assert_grads_close(grads_on, grads_off)
    # control: the packed path really ran, on fewer tokens than the rows hold
    stats = on.deg_prefix.stats
    assert stats["packed_calls"] >= 2 and stats["fallback_calls"] == 0
    assert stats["tokens_packed"] < stats["tokens_rows"]


def test_streamed_and_resident_agree_bit_for_bit_on_the_packed_path(checkpoint, tmp_path):
    path = checkpoint("llama")
    streamed = build("dpo", path, tmp_path / "s", stream=True)
    resident = build("dpo", path, tmp_path / "r", stream=False)
    randomise_lora_b(streamed.model)
    copy_adapters(resident.model, streamed.model)
    batch = batch_of(streamed)
    loss_s, grads_s = loss_and_grads(streamed, batch)
    loss_r, grads_r = loss_and_grads(resident, batch)
    assert loss_s.item() == loss_r.item()
    assert set(grads_s) == set(grads_r)
    assert max((grads_s[n] - grads_r[n]).abs().max().item() for n in grads_r) == 0.0
    assert streamed.deg_prefix.stats["packed_calls"] and resident.deg_prefix.stats["packed_calls"]


def test_pairs_of_one_prompt_share_it_within_the_micro_batch(checkpoint, tmp_path):
    on, off = pair("dpo", checkpoint("llama"), tmp_path, data=rows(8, shared_prompts=True))
    batch = batch_of(on)
    lens = on._deg_prompt_lens(batch)
    plan = on.deg_prefix.plan(batch["input_ids"], batch["attention_mask"], lens)
    assert len(plan.groups) <= 2 < len(lens) // 2  # four pairs, at most two prompts
    per_pair = sum(plan.row_lens) - sum(lens[: len(lens) // 2])  # P + C + R per pair, summed
    assert plan.tokens_packed < per_pair
    loss_on, grads_on = loss_and_grads(on, batch)
    loss_off, grads_off = loss_and_grads(off, batch)
    assert abs(loss_on.item() - loss_off.item()) <= 1e-5
    assert_grads_close(grads_on, grads_off)


# ----------------------------------------------------------------------------- fallbacks


def test_rows_without_a_shared_prompt_fall_back_once_and_stay_exact(checkpoint, tmp_path, caplog):
    on, off = pair("dpo", checkpoint("llama"), tmp_path)
    batch = dict(batch_of(on))
    b = batch["input_ids"].shape[0] // 2
    ids = batch["input_ids"].clone()
    ids[b, 0] = (ids[b, 0] + 1) % 40 + 7  # the rejected row of pair 0 now starts differently
    batch["input_ids"] = ids
    with caplog.at_level(logging.WARNING, logger="deg_hf.prefix.sharing"):
        loss_on, grads_on = loss_and_grads(on, batch)
        loss_on2, _ = loss_and_grads(on, batch)
    loss_off, grads_off = loss_and_grads(off, batch)
    assert loss_on.item() == loss_off.item() == loss_on2.item()
    assert_grads_close(grads_on, grads_off)
    reasons = list(on.deg_prefix.fallbacks)
    assert reasons == ["the chosen and rejected rows of a pair do not share their prompt"]
    assert on.deg_prefix.stats["packed_calls"] == 0
    said = [r for r in caplog.records if "prefix sharing off" in r.getMessage()]
    assert len(said) == 1  # once, however often it happens
    assert on._deg_shared_prompt_lens(batch) is None  # and the planner counts the rows unpacked


def test_a_sliding_window_shorter_than_the_rows_falls_back(checkpoint, tmp_path):
    on, off = pair("dpo", checkpoint("mistral", sliding_window=4), tmp_path)
    batch = batch_of(on)
    loss_on, grads_on = loss_and_grads(on, batch)
    loss_off, grads_off = loss_and_grads(off, batch)
    assert loss_on.item() == loss_off.item()
    assert_grads_close(grads_on, grads_off)
    assert any("sliding-window" in r for r in on.deg_prefix.fallbacks)
    assert on.deg_prefix.stats["packed_calls"] == 0


def test_attention_without_arbitrary_masks_turns_sharing_off(checkpoint, tmp_path):
    from deg_hf.prefix.sharing import sliding_window, static_reason

    class Cfg:
        _attn_implementation = "flash_attention_2"

    assert "flash_attention_2" in static_reason(Cfg())
    Cfg._attn_implementation = "sdpa"
    Cfg.layer_types = ["full_attention", "linear_attention"]
    assert "hybrid" in static_reason(Cfg())
    Cfg.layer_types = ["full_attention", "sliding_attention"]
    Cfg.sliding_window = 16
    assert static_reason(Cfg()) is None and sliding_window(Cfg()) == 16
    Cfg.layer_types = ["full_attention"]
    assert sliding_window(Cfg()) is None


# ----------------------------------------------------------------------------- trunk and forks


def _oom(phase_to_fail=None, *, packed_fails=True):
    def hook(info, phase):
        if phase == phase_to_fail or (packed_fails and phase == "forward" and hook.trainer.deg_prefix.mode == "packed"):
            raise torch.OutOfMemoryError("CUDA out of memory. (injected)")
    return hook


def _step_grads(trainer, batch):
    trainer.current_gradient_accumulation_steps = 1  # set by train(); this calls one step directly
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.training_step(trainer.model, batch)
    return grads(trainer.model)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "resident"])
@pytest.mark.parametrize("fail", [None, "fork_forward", "fork_backward", "trunk_backward"])
def test_a_pair_that_does_not_fit_packed_runs_as_trunk_and_forks(checkpoint, tmp_path, fail, stream):
    on, off = pair("dpo", checkpoint("llama"), tmp_path, stream=stream, per_device_train_batch_size=2)
    batch = batch_of(on)
    hook = _oom(fail)
    hook.trainer = on
    on.set_fault_hook(hook)
    got = _step_grads(on, batch)
    want = _step_grads(off, batch)
    assert_grads_close(got, want)
    counters = on.deg_counters
    assert counters["oom_retry"] == 1 and counters["oom_skip"] == 0  # halved, then each pair alone
    assert counters["trunk_forks"] == 2
    stats = on.deg_prefix.stats
    if fail is None:
        assert stats["trunk_forks"] == 2 and stats["fork_fallbacks"] == 0
    else:  # the shared-trunk run dropped its gradients and ran each completion whole
        assert stats["fork_fallbacks"] == 2


def test_trunk_and_forks_needs_the_trunk_backward(checkpoint, tmp_path, monkeypatch):
    """Control: without the trunk's own backward the forks' gradients alone are measurably wrong."""
    from deg_hf.prefix import trunk

    on, off = pair("dpo", checkpoint("llama"), tmp_path, per_device_train_batch_size=2)
    batch = batch_of(on)
    monkeypatch.setattr(torch.autograd, "backward", _skipping_multi_tensor_backward(torch.autograd.backward))
    with on.deg_prefix.use_mode("trunk_forks"):
        got = _step_grads(on, batch)
    want = _step_grads(off, batch)
    with pytest.raises(AssertionError):
        assert_grads_close(got, want)
    assert trunk.TrunkForks  # the module under test


def _skipping_multi_tensor_backward(real):
    def backward(tensors, grad_tensors=None, *args, **kwargs):
        if isinstance(tensors, list) and len(tensors) > 1:  # the trunk backward (hidden + keys/values)
            return None
        return real(tensors, grad_tensors, *args, **kwargs)
    return backward


def test_a_pair_that_fails_packed_and_as_trunk_and_forks_is_skipped(checkpoint, tmp_path):
    on, _ = pair("dpo", checkpoint("llama"), tmp_path, per_device_train_batch_size=2)
    batch = batch_of(on)

    def hook(info, phase):  # the two pairs together never fit; pair 0 fits no way at all
        if phase == "forward" and (len(info) > 1 or info.indices == (0,)):
            raise torch.OutOfMemoryError("CUDA out of memory. (injected)")

    on.set_fault_hook(hook)
    _step_grads(on, batch)
    counters = on.deg_counters
    assert counters["oom_retry"] == 1 and counters["oom_skip"] == 1 and counters["trunk_forks"] == 0
    assert counters["skipped"] == [0]


# ----------------------------------------------------------------------------- planner


def test_planner_counts_a_packed_pair_as_one_row_of_prompt_plus_completions(checkpoint, tmp_path):
    on = build("dpo", checkpoint("llama"), tmp_path / "on", mem_target_gb=64)
    batch = batch_of(on)
    shared = on._deg_shared_prompt_lens(batch)
    lens = on._deg_prompt_lens(batch)
    b = len(lens) // 2
    assert shared == lens[:b] and min(shared) > 0
    engine = on.deg_engine
    parts = engine._plan(batch, list(range(b)))
    assert parts == [list(range(b))]
    from deg_hf.memory import batch as mb
    from deg_hf.memory.planner import Example

    lengths = mb.row_lengths(batch, True)
    packed = [Example(i, (sum(lengths[i]) - shared[i],), prompt_len=shared[i]) for i in range(b)]
    rows = [Example(i, lengths[i]) for i in range(b)]
    assert on.deg_planner.estimate(packed) < on.deg_planner.estimate(rows)


def test_packed_pass_is_one_layer_sweep_like_the_ordinary_one(checkpoint, tmp_path):
    on, off = pair("dpo", checkpoint("llama"), tmp_path)
    batch = batch_of(on)
    fetches = {}
    for name, trainer in (("on", on), ("off", off)):
        runtime = trainer.stream_runtime
        runtime.reset_stats()
        _step_grads(trainer, batch)
        fetches[name] = runtime.loads + runtime.hits
    n_layers = on.stream_runtime.stats()["n_layers"]
    # reference forward + policy forward + the policy's recompute, packed or not
    assert fetches["on"] == fetches["off"] == 3 * n_layers
    assert on.deg_prefix.stats["packed_calls"] == 2


def ranked_rows(prompts=4, pairs_per_prompt=3):
    """Ranked responses turned into pairs: each prompt appears in several pairs."""
    answers = [" sure good kind answer", " good answer please thanks", " bad rude no", " no"]
    out = []
    for p in range(prompts):
        for k in range(pairs_per_prompt):
            out.append({"prompt": LONG_PROMPTS[p], "chosen": answers[k], "rejected": answers[k + 1]})
    return out


def test_group_by_prompt_puts_a_prompts_pairs_in_one_micro_batch(checkpoint, tmp_path):
    path, data = checkpoint("llama"), ranked_rows()
    groups = {}
    for grouped in (True, False):
        trainer = build("dpo", path, tmp_path / str(grouped), data=data, group_by_prompt=grouped,
                        per_device_train_batch_size=3)
        seen, counts = [], []
        for batch in trainer.get_train_dataloader():
            batch = trainer._prepare_inputs(batch)
            plan = trainer.deg_prefix.plan(batch["input_ids"], batch["attention_mask"], trainer._deg_prompt_lens(batch))
            counts.append(len(plan.groups))
            seen.append(batch["input_ids"].shape[0] // 2)
        assert sum(seen) == len(data)  # every pair once per epoch
        groups[grouped] = counts
    assert groups[True] == [1, 1, 1, 1]  # each micro-batch: one prompt, run once for its three pairs
    assert max(groups[False]) > 1  # control: shuffling pairs mixes prompts


def test_prompt_grouped_sampler_is_a_seeded_permutation():
    from deg_hf.prefix.sampler import PromptGroupedSampler

    keys = ["a", "b", "a", "c", "b", "a"]
    sampler = PromptGroupedSampler(keys, seed=3)
    first, second = list(sampler), list(sampler)
    assert sorted(first) == sorted(second) == list(range(6))
    for order in (first, second):  # the members of a prompt are contiguous
        ks = [keys[i] for i in order]
        assert sum(1 for i in range(1, 6) if ks[i] != ks[i - 1]) == 2
    assert list(PromptGroupedSampler(keys, seed=3)) == first


@pytest.mark.parametrize("task", ["dpo", "orpo"])
def test_trunk_and_forks_of_a_prompt_with_several_pairs(checkpoint, tmp_path, task):
    """One trunk, several forks (a completion that is one pair's rejected and the next pair's chosen
    runs once): the gradient of the whole micro-batch, as TRL computes it row by row."""
    on, off = pair(task, checkpoint("llama"), tmp_path, data=ranked_rows(), group_by_prompt=True,
                   per_device_train_batch_size=3)
    batch = batch_of(on)
    if task == "dpo":
        plan = on.deg_prefix.plan(batch["input_ids"], batch["attention_mask"], on._deg_prompt_lens(batch))
        (prompt_len, branches), = plan.groups
        assert len(branches) == 4  # six rows, three pairs, four distinct completions
    with on.deg_prefix.use_mode("trunk_forks"):
        loss_on, grads_on = loss_and_grads(on, batch)
    loss_off, grads_off = loss_and_grads(off, batch)
    assert abs(loss_on.item() - loss_off.item()) <= 1e-5
    assert_grads_close(grads_on, grads_off)
    assert on.deg_prefix.stats["trunk_forks"] == 1
