"""The activation-memory estimate and the micro-batch planner (pure Python, no torch):

* coefficient files round-trip and refuse unknown keys and bad values;
* the estimate is monotone in every size and every coefficient, and equals its breakdown;
* a part pays its padded width; the fused LM head is cheaper than full logits for a big vocabulary;
* plan() keeps every example exactly once, in order, in fitting parts when each example fits;
* observe() raises the scale at once, lowers it only from a full window, ignores tiny parts;
* the module imports nothing outside the standard library and deg_hf.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deg_hf.memory.coef import (
    GIB,
    LAYER_TERMS,
    LM_HEAD_TERMS,
    MIB,
    SIZE_FIELDS,
    TRL_LM_HEAD_TILE_TOKENS,
    TRL_LM_HEAD_TILE_VOCAB,
    Features,
    MemCoef,
    activation_bytes,
    breakdown,
    estimate,
    features,
)
from deg_hf.memory.dims import model_dims
from deg_hf.memory.planner import Example, MemPlanner
from deg_hf.memory.static import layer_param_count, lora_param_count, static_breakdown, static_bytes

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# a small Llama-shaped decoder (GQA 4:1)
SMALL = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
}
# Llama-2-7B's shape
LLAMA7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# Qwen2.5-7B's shape: a large vocabulary
QWEN7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}


def _planner(budget: int, config=SMALL, **kw) -> MemPlanner:
    return MemPlanner(budget + 3 * GIB, 3 * GIB, model_config=config, dtype_bytes=2, **kw)


# ------------------------------------------------------------------------- coefficients


def test_coef_round_trip(tmp_path):
    c = MemCoef(boundary=1.5, logits=0.0, workspace=1234.0)
    path = tmp_path / "coef.json"
    c.save(path)
    assert MemCoef.load(path) == c
    assert MemCoef.from_dict(c.to_dict()) == c
    assert json.loads(path.read_text()) == c.to_dict()
    path.write_text('{"layer_inter": 9, "workspace": 0}')  # partial: the rest keep defaults
    got = MemCoef.load(path)
    assert got.layer_inter == 9.0 and got.workspace == 0.0 and got.boundary == MemCoef().boundary


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"nope": 1}, "nope"),
        ({"boundary": -1}, "boundary"),
        ({"logits": float("nan")}, "logits"),
        ({"lm_tile": float("inf")}, "lm_tile"),
        ({"embed": "2"}, "embed"),
        ({"inputs": True}, "inputs"),
    ],
)
def test_coef_refuses_unknown_keys_and_bad_values(data, key):
    with pytest.raises(ValueError, match=key):
        MemCoef.from_dict(data)


def test_coef_file_errors(tmp_path):
    path = tmp_path / "coef.json"
    path.write_text('{"nope": 1}')
    with pytest.raises(ValueError, match="nope"):
        MemCoef.load(path)
    path.write_text('{"workspace": -5}')
    with pytest.raises(ValueError, match="workspace"):
        MemCoef.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError):
        MemCoef.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError):
        MemCoef.load(path)
    with pytest.raises(ValueError, match="attn_scores"):
        MemCoef(attn_scores=-0.5)


# ------------------------------------------------------------------------- model config


def test_model_dims_reads_dicts_objects_and_nested_text_config():
    d = model_dims(LLAMA7B)
    assert (d.hidden, d.intermediate, d.layers, d.vocab, d.heads, d.kv_heads, d.head_dim) == (
        4096, 11008, 32, 32000, 32, 32, 128)
    assert model_dims(SimpleNamespace(**LLAMA7B)) == d
    gemma3 = {  # multimodal: the language model sits in text_config, some keys at the top
        "model_type": "gemma3",
        "tie_word_embeddings": True,
        "vision_config": {"hidden_size": 1152},
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "vocab_size": 262208, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        },
    }  # fmt: skip
    g = model_dims(gemma3)
    assert (g.hidden, g.layers, g.vocab, g.head_dim, g.kv_heads) == (2560, 34, 262208, 256, 4)
    assert g.tie_word_embeddings and g.mask_kinds == 2
    assert model_dims(SimpleNamespace(text_config=SimpleNamespace(**gemma3["text_config"]))).hidden == 2560
    minimal = model_dims({"hidden_size": 1024, "num_hidden_layers": 2, "vocab_size": 100})
    assert minimal.intermediate == 4096 and minimal.heads == 8 and minimal.kv_heads == 8
    with pytest.raises(ValueError, match="hidden_size"):
        model_dims({"num_hidden_layers": 2, "vocab_size": 100})
    with pytest.raises(ValueError, match="vocab_size"):
        model_dims({"hidden_size": 64, "num_hidden_layers": 2})


def test_moe_activation_width_counts_routed_experts():
    mixtral = {**LLAMA7B, "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
               "num_key_value_heads": 8}
    d = model_dims(mixtral)
    assert d.intermediate == 2 * 14336 and d.experts == 8
    assert layer_param_count(mixtral) > 8 * 3 * 4096 * 14336


# ------------------------------------------------------------------------- the estimate


def _feat(**kw) -> Features:
    return features(SMALL, **{"rows": 4, "padded_len": 512, "dtype_bytes": 2, **kw})


def test_estimate_is_made_of_its_breakdown():
    """Without checkpointing every term adds; with it, the LM head's terms and a layer's working set
    are alternatives (the larger counts), the rest adds."""
    for kw in ({}, {"fused_lm_head": True, "completion_tokens": 900}, {"checkpointing": False},
               {"attn_implementation": "eager"}, {"rows": 1}):
        f = _feat(**kw)
        parts = breakdown(f, MemCoef())
        assert all(v >= 0 for v in parts.values())
        head = sum(parts[k] for k in LM_HEAD_TERMS)
        layer = sum(parts[k] for k in LAYER_TERMS)
        always = sum(parts.values()) - head - layer - parts["workspace"]
        rest = always + (max(head, layer) if f.checkpointing else head + layer)
        assert activation_bytes(parts, f.checkpointing) == rest
        assert estimate(f, MemCoef()) == parts["workspace"] + rest
        assert estimate(f, MemCoef(), scale=1.5) == parts["workspace"] + math.ceil(1.5 * rest)
        if not f.checkpointing:
            assert estimate(f, MemCoef()) == sum(parts.values())
    f = _feat()
    parts = breakdown(f, MemCoef())
    assert 0 < sum(parts[k] for k in LAYER_TERMS) and 0 < sum(parts[k] for k in LM_HEAD_TERMS)
    assert estimate(f) < sum(parts.values())  # the alternatives are not summed (control of the max)
    assert estimate(_feat()) == estimate(_feat(), MemCoef())  # default coefficients


_sizes = st.integers(min_value=0, max_value=1 << 14)
_flags = st.fixed_dictionaries({
    "checkpointing": st.booleans(),
    "streaming": st.booleans(),
    "fused_lm_head": st.booleans(),
    "attn_implementation": st.sampled_from(["sdpa", "eager", "flash_attention_2", "flex_attention"]),
})  # fmt: skip


@st.composite
def _features(draw) -> Features:
    values = {name: draw(_sizes) for name in SIZE_FIELDS}
    return Features(**values, **draw(_flags))


@FAST
@given(f=_features(), name=st.sampled_from(SIZE_FIELDS), bump=st.integers(1, 1 << 14),
       coef=st.dictionaries(st.sampled_from([x.name for x in dataclasses.fields(MemCoef)]),
                            st.floats(0, 1e3, allow_nan=False)))
def test_estimate_monotone_in_every_size(f, name, bump, coef):
    c = MemCoef.from_dict(coef)
    bigger = dataclasses.replace(f, **{name: getattr(f, name) + bump})
    assert estimate(bigger, c) >= estimate(f, c)
    assert estimate(bigger, c, scale=1.3) >= estimate(f, c, scale=1.3)


@FAST
@given(f=_features(), name=st.sampled_from([x.name for x in dataclasses.fields(MemCoef)]),
       base=st.floats(0, 1e3, allow_nan=False), bump=st.floats(0, 1e3, allow_nan=False),
       scale=st.floats(0, 10, allow_nan=False), scale_bump=st.floats(0, 10, allow_nan=False))
def test_estimate_monotone_in_every_coefficient_and_the_scale(f, name, base, bump, scale, scale_bump):
    c = MemCoef(**{name: base})
    assert estimate(f, MemCoef(**{name: base + bump}), scale) >= estimate(f, c, scale)
    assert estimate(f, c, scale + scale_bump) >= estimate(f, c, scale)


def test_size_features_each_add_memory():
    base = _feat()
    assert estimate(_feat(rows=5)) > estimate(base)
    assert estimate(_feat(padded_len=600)) > estimate(base)
    assert estimate(_feat(dtype_bytes=4)) > estimate(base)
    assert estimate(_feat(checkpointing=False)) > estimate(base)
    saved_all, recompute_one = breakdown(_feat(checkpointing=False)), breakdown(base)
    for name in ("layer_hidden", "layer_hidden_fp32", "layer_qkv", "layer_inter", "layer_inter_fp32"):
        assert saved_all[name] == SMALL["num_hidden_layers"] * recompute_one[name]  # every layer's set
    assert estimate(_feat(attn_implementation="eager")) > estimate(base)
    assert estimate(_feat(attn_implementation="flash_attention_2")) < estimate(base)  # no mask


def test_a_short_row_beside_a_long_one_pays_the_long_width():
    pl = _planner(64 * GIB)
    long, short = Example(0, (4096,)), Example(1, (200,))
    mixed = pl.estimate([long, short])
    assert mixed == pl.estimate([long, Example(1, (4096,))])  # rows x padded width, not true lengths
    assert mixed == estimate(features(SMALL, rows=2, padded_len=4096, dtype_bytes=2))
    assert mixed > pl.estimate([short, Example(2, (200,))])
    assert mixed > pl.estimate([long]) + pl.estimate([short]) - MemCoef().workspace
    part = pl.plan([long, short])[0]
    assert part.features.rows == 2 and part.features.padded_len == 4096
    assert part.features.tokens == 2 * 4096


def test_fused_lm_head_is_cheaper_than_full_logits_for_a_big_vocabulary():
    full = features(QWEN7B, rows=2, padded_len=4096, dtype_bytes=2)
    fused = features(QWEN7B, rows=2, padded_len=4096, dtype_bytes=2, fused_lm_head=True)
    assert estimate(fused) < estimate(full)
    b_full, b_fused = breakdown(full), breakdown(fused)
    assert b_full["lm_tile"] == 0 and b_fused["logits"] == b_fused["logits_fp32"] == 0
    # TRL's tile: 4096 tokens x 32768 vocabulary columns, whatever the batch
    assert TRL_LM_HEAD_TILE_TOKENS == 4096 and TRL_LM_HEAD_TILE_VOCAB == 32768
    assert b_fused["lm_tile"] == math.ceil(MemCoef().lm_tile * 4096 * 32768 * 2)
    assert b_fused["lm_tile"] < b_full["logits"] + b_full["logits_fp32"]
    # the fused head scores labelled positions only
    labelled = features(QWEN7B, rows=2, padded_len=4096, dtype_bytes=2, fused_lm_head=True,
                        completion_tokens=500)
    assert labelled.lm_tokens == 500 and estimate(labelled) <= estimate(fused)
    head = [sum(breakdown(f)[k] for k in LM_HEAD_TERMS) for f in (labelled, fused)]
    assert head[0] < head[1]
    # ... where Triton runs; elsewhere (CPU) every position but each row's last, with fp32 temporaries
    everywhere = features(QWEN7B, rows=2, padded_len=4096, dtype_bytes=2, fused_lm_head=True,
                          completion_tokens=500, lm_head_compact=False)
    assert everywhere.lm_tokens == 2 * 4095 and breakdown(everywhere)["lm_fold"] > 0 == breakdown(fused)["lm_fold"]
    assert features(QWEN7B, rows=2, padded_len=4096, completion_tokens=500).lm_tokens == 2 * 4096


def test_features_validate_their_inputs():
    with pytest.raises(ValueError, match="rows"):
        features(SMALL, rows=-1, padded_len=10)
    with pytest.raises(ValueError, match="padded_len"):
        features(SMALL, rows=1, padded_len=2.5)
    f = features(SMALL, rows=1, padded_len=10, tokens=7, prompt_tokens=3)
    assert f.tokens == 7 and f.prompt_tokens == 3 and f.to_dict()["rows"] == 1


# ------------------------------------------------------------------------- static memory


def test_lora_param_count_matches_the_known_llama_figure():
    # r=16 on all seven projections of Llama-2-7B: 39,976,960 parameters
    assert lora_param_count(LLAMA7B, 16) == 39_976_960
    assert lora_param_count(LLAMA7B, 16, ["q_proj", "v_proj"]) == 32 * 2 * 16 * (4096 + 4096)
    assert lora_param_count(LLAMA7B, 16, ["q", "v"]) == lora_param_count(LLAMA7B, 16, ["q_proj", "v_proj"])
    assert lora_param_count(LLAMA7B, 16, "q_proj") == 32 * 16 * 8192
    with pytest.raises(ValueError, match="lm_head"):
        lora_param_count(LLAMA7B, 16, ["lm_head"])


def test_static_bytes_components():
    lora = lora_param_count(LLAMA7B, 16)
    layer = layer_param_count(LLAMA7B)
    assert layer == 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    streamed = static_breakdown(LLAMA7B, streaming=True, stream_buffers=2, lora_params=lora,
                                dtype_bytes=2, trainable_dtype_bytes=4)
    assert streamed == {
        "resident": (2 * 32000 * 4096 + 4096) * 2,
        "layers": 2 * layer * 2,
        "adapters": lora * 4,
        "grads": lora * 4,
        "optimizer": lora * 8,
    }
    resident = static_bytes(LLAMA7B, streaming=False, lora_params=lora, dtype_bytes=2)
    assert resident - sum(streamed.values()) == 30 * layer * 2
    assert static_bytes(LLAMA7B, lora_params=lora, dtype_bytes=2, optimizer="sgd") == (
        sum(streamed.values()) - lora * 8)
    tied = static_breakdown({**LLAMA7B, "tie_word_embeddings": True}, dtype_bytes=2)
    assert tied["resident"] == (32000 * 4096 + 4096) * 2
    nf4 = static_breakdown(LLAMA7B, dtype_bytes=2, weight_dtype_bytes=0.5625)
    assert nf4["layers"] == math.ceil(2 * layer * 0.5625)


# ------------------------------------------------------------------------- planning


_lengths = st.lists(
    st.tuples(st.integers(1, 2), st.integers(1, 3000), st.integers(1, 3000)), min_size=0, max_size=30,
)


def _examples(spec) -> list[Example]:
    return [Example(i, (a,) if rows == 1 else (a, b)) for i, (rows, a, b) in enumerate(spec)]


def _greedy_count(pl: MemPlanner, examples: list[Example]) -> int:
    count, current = 0, []
    for ex in examples:
        if current and pl.fits([*current, ex]):
            current.append(ex)
        else:
            count, current = count + 1, [ex]
    return count


@FAST
@given(spec=_lengths, budget_mib=st.integers(1, 4096))
def test_plan_keeps_every_example_once_in_order(spec, budget_mib):
    pl = _planner(budget_mib * MIB)
    batch = _examples(spec)
    parts = pl.plan(batch)
    assert [i for p in parts for i in p.indices] == [ex.index for ex in batch]
    assert [ex for p in parts for ex in p.examples] == batch
    assert all(p.examples for p in parts)
    for p in parts:
        assert p.fits == pl.fits(p) == (p.estimate <= pl.budget())
        assert p.features.padded_len == max(ex.max_len for ex in p.examples)
        assert p.features.rows == sum(ex.rows for ex in p.examples)
        if not p.fits:
            assert len(p.examples) == 1  # only an example too big alone may miss the budget
    if all(pl.fits([ex]) for ex in batch):
        assert all(p.fits for p in parts)
    assert len(parts) == _greedy_count(pl, batch)  # as few parts as greedy packing


def test_plan_one_part_when_the_batch_fits():
    pl = _planner(64 * GIB)
    batch = _examples([(1, 300, 0)] * 6)
    parts = pl.plan(batch)
    assert len(parts) == 1 and parts[0].examples == tuple(batch) and parts[0].fits
    assert pl.plan([]) == []


def test_oversized_example_is_its_own_part_marked_not_fitting():
    cfg = SMALL
    three_wide = estimate(features(cfg, rows=3, padded_len=1000, dtype_bytes=2))
    pl = _planner(three_wide, cfg)
    batch = [Example(0, (100,)), Example(1, (100,)), Example(2, (200_000,)), Example(3, (100,))]
    parts = pl.plan(batch)
    assert [p.indices for p in parts] == [(0, 1), (2,), (3,)]
    assert [p.fits for p in parts] == [True, False, True]
    assert not pl.fits(batch[2])


def test_plan_cuts_where_padding_costs_least():
    # room for three rows 1000 wide: greedy would pad two short rows to 1000 beside the long one
    three_wide = estimate(features(SMALL, rows=3, padded_len=1000, dtype_bytes=2))
    pl = _planner(three_wide)
    batch = _examples([(1, 1000, 0), (1, 100, 0), (1, 100, 0), (1, 100, 0)])
    assert _greedy_count(pl, batch) == 2
    assert [p.indices for p in pl.plan(batch)] == [(0,), (1, 2, 3)]


def test_pairs_stay_together_and_split_rows_respects_min_rows():
    one_row = estimate(features(SMALL, rows=2, padded_len=2000, dtype_bytes=2))
    pl = _planner(one_row, min_rows=2)
    pair = Example(7, (2000, 1500), prompt_len=100)
    assert pl.fits(pair)
    assert pl.split_rows(pair) == [pl.plan([pair])[0]]  # fits whole: one chunk, all rows
    big = Example(9, tuple(range(1500, 2000, 50)))  # 10 rows
    chunks = pl.split_rows(big)
    assert len(chunks) == 5
    assert [c.row_range for c in chunks] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert all(c.fits and c.indices == (9,) for c in chunks)
    odd = Example(3, (1000,) * 5)
    assert [c.row_range for c in pl.split_rows(odd)] == [(0, 2), (2, 5)]  # tail joins its neighbour


def test_split_rows_partitions_rows_into_fitting_chunks():
    pl = _planner(estimate(features(SMALL, rows=3, padded_len=3000, dtype_bytes=2)))
    big = Example("big", (3000, 10, 2500, 40, 3000, 20, 20, 20, 2900), prompt_len=5)
    assert not pl.fits(big)
    chunks = pl.split_rows(big)
    assert len(chunks) > 1
    ranges = [c.row_range for c in chunks]
    assert ranges[0][0] == 0 and ranges[-1][1] == big.rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in order
    assert all(c.fits and c.examples == (big,) for c in chunks)
    for c in chunks:
        lo, hi = c.row_range
        assert c.features.rows == hi - lo and c.features.padded_len == max(big.lengths[lo:hi])
    # a chunk of a chunk stays inside it
    sub = pl.split_rows(chunks[0])
    assert sub[0].row_range[0] == ranges[0][0] and sub[-1].row_range[1] == ranges[0][1]
    with pytest.raises(ValueError):
        pl.split_rows(pl.plan([Example(0, (5,)), Example(1, (5,))])[0])
    # a row that cannot fit alone is a chunk marked not fitting
    huge = Example("huge", (10, 500_000, 10))
    assert [c.fits for c in pl.split_rows(huge)] == [True, False, True]


def test_halve_splits_examples_then_rows():
    pl = _planner(64 * GIB)
    a, b, c = (Example(u, (100,) * 5) for u in "abc")
    first, second = pl.halve(pl.plan([a, b, c])[0])
    assert first.indices == ("a",) and second.indices == ("b", "c")
    halves = pl.halve(pl.plan([a])[0])
    assert halves is not None and [h.row_range for h in halves] == [(0, 2), (2, 5)]
    assert [h.row_range for h in pl.halve(halves[1])] == [(2, 3), (3, 5)]
    assert pl.halve(pl.plan([Example(0, (100,))])[0]) is None
    assert pl.halve([Example(0, (100,) * 3)]) is not None
    pairs = _planner(64 * GIB, min_rows=2)
    assert pairs.halve(pairs.plan([Example(0, (100, 90))])[0]) is None  # a pair stays whole
    assert [h.row_range for h in pairs.halve([Example(0, (100,) * 6)])] == [(0, 2), (2, 6)]


def test_largest_batch():
    pl = _planner(4 * GIB)
    n = pl.largest_batch(1024)
    assert n > 1
    assert pl.fits([Example(i, (1024,)) for i in range(n)])
    assert not pl.fits([Example(i, (1024,)) for i in range(n + 1)])
    assert pl.largest_batch(1024, rows_per_example=2) == n // 2
    assert pl.largest_batch(1024, max_examples=3) == 3
    assert pl.largest_batch(10_000_000) == 0


def test_budget_is_target_minus_static_and_never_negative():
    pl = MemPlanner(10 * GIB, 4 * GIB, model_config=SMALL)
    assert pl.budget() == 6 * GIB
    assert MemPlanner(1 * GIB, 4 * GIB, model_config=SMALL).budget() == 0
    assert not MemPlanner(1 * GIB, 4 * GIB, model_config=SMALL).fits([Example(0, (1,))])


# ------------------------------------------------------------------------- calibration


def _calibrating(**kw) -> tuple[MemPlanner, Features, int, int]:
    pl = MemPlanner(80 * GIB, 20 * GIB, model_config=LLAMA7B, dtype_bytes=2, **kw)
    f = pl.features_of(4, 2048)
    parts = breakdown(f, pl.coef)
    workspace = parts["workspace"]
    rest = activation_bytes(parts, f.checkpointing)
    assert workspace + rest > pl.noise_floor_bytes
    return pl, f, workspace, rest


def test_observe_raises_at_once_and_lowers_only_from_a_full_window():
    pl, f, ws, rest = _calibrating()
    m = 1 + pl.margin
    raw = pl.estimate(f)
    assert pl.observe(f, ws + 1.5 * rest)  # under-estimate: raised at once, with the margin
    assert pl.scale == pytest.approx(1.5 * m)
    assert pl.estimate(f) > raw
    assert pl.observe(f, ws + 0.5 * rest)  # one over-estimate lowers nothing
    assert pl.scale == pytest.approx(1.5 * m)
    for _ in range(pl.observe_window - 3):
        pl.observe(f, ws + 1.2 * rest)
    assert pl.scale == pytest.approx(1.5 * m)  # the window is not full yet
    pl.observe(f, ws + 1.2 * rest)  # full, still holding the 1.5: no lower
    assert pl.scale == pytest.approx(1.5 * m)
    pl.observe(f, ws + 1.2 * rest)  # the 1.5 left the window: lowered to the max of 0.5 and 1.2s
    assert pl.scale == pytest.approx(1.2 * m)
    assert pl.counters == {"observed": pl.observe_window + 1, "ignored": 0, "raised": 1, "lowered": 1}
    for _ in range(pl.observe_window):
        pl.observe(f, ws + 0.01 * rest)
    assert pl.scale == pl.min_scale  # never below the floor


def test_an_out_of_memory_lower_bound_only_raises_and_static_follows_measurement():
    pl, f, ws, rest = _calibrating()
    assert pl.observe(f, ws + 0.5 * rest, lower_bound=True)  # below the scale: changes nothing
    assert pl.scale == 1.0 and not pl.window
    pl.observe(f, ws + 1.4 * rest, lower_bound=True)  # the part had used this much when it failed
    assert pl.scale == pytest.approx(1.4 * (1 + pl.margin)) and not pl.window
    static = pl.static_bytes
    pl.observe_static(static - 1)  # measured less than the estimate: the estimate stays
    assert pl.static_bytes == static
    pl.observe_static(static + GIB)  # measured more: the budget shrinks accordingly
    assert pl.static_bytes == static + GIB and pl.budget() == pl.target_bytes - static - GIB


def test_observe_can_tighten_down_to_a_configured_floor():
    pl, f, ws, rest = _calibrating(min_scale=0.5, margin=0.0)
    for _ in range(pl.observe_window - 1):
        pl.observe(f, ws + 0.7 * rest)
    assert pl.scale == 1.0
    pl.observe(f, ws + 0.7 * rest)
    assert pl.scale == pytest.approx(0.7)
    for _ in range(pl.observe_window):
        pl.observe(f, ws + 0.1 * rest)
    assert pl.scale == 0.5


def test_observe_ignores_tiny_batches():
    pl, f, ws, rest = _calibrating()
    assert pl.noise_floor_bytes > 0  # the default, kept on CUDA (the trainers set 0 on CPU)
    tiny = pl.features_of(1, 8)
    assert pl.estimate(tiny) < pl.noise_floor_bytes
    assert not pl.observe(tiny, 100 * GIB)
    assert pl.scale == 1.0 and pl.counters["ignored"] == 1 and not pl.window
    assert not pl.observe([Example(0, (4,))], 10 * GIB)  # examples work too
    with pytest.raises(ValueError):
        pl.observe(f, -1)
    with pytest.raises(ValueError):
        pl.observe(f, float("nan"))


def test_state_dict_round_trip():
    pl, f, ws, rest = _calibrating()
    pl.observe(f, ws + 1.3 * rest)
    pl.observe(f, ws + 0.9 * rest)
    pl.observe(pl.features_of(1, 4), GIB)
    state = json.loads(json.dumps(pl.state_dict()))  # JSON-serialisable
    fresh, *_ = _calibrating()
    fresh.load_state_dict(state)
    assert fresh.scale == pl.scale and list(fresh.window) == list(pl.window)
    assert fresh.counters == pl.counters
    assert fresh.state_dict() == pl.state_dict()
    # the next samples act the same on both
    for p in (pl, fresh):
        for _ in range(p.observe_window):
            p.observe(f, ws + 1.0 * rest)
    assert fresh.scale == pl.scale == pytest.approx(1 + pl.margin)
    with pytest.raises(ValueError):
        fresh.load_state_dict({**state, "extra": 1})
    with pytest.raises(ValueError):
        fresh.load_state_dict({**state, "scale": float("inf")})


# ------------------------------------------------------------------------- dependencies


def test_module_imports_only_the_standard_library():
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import deg_hf.memory.planner, deg_hf.memory.coef, deg_hf.memory.dims, deg_hf.memory.static\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "bad = sorted(m for m in new if m not in sys.stdlib_module_names and m != 'deg_hf')\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(new)\n"
        "assert not bad, bad\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
