"""The micro-batch planner (pure Python: no torch, no numpy).

:class:`MemPlanner` cuts a micro-batch of :class:`Example` s into contiguous :class:`Part` s whose
estimated activation memory (:func:`deg_hf.memory.coef.estimate`) fits ``target - static``, splits
one example's rows, halves a part for a retry after running out of memory, and calibrates its
``scale`` from measured peaks (:meth:`MemPlanner.observe`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

from deg_hf.memory.coef import (
    MIB,
    TRL_LM_HEAD_TILE_TOKENS,
    TRL_LM_HEAD_TILE_VOCAB,
    Features,
    MemCoef,
    activation_bytes,
    breakdown,
    estimate,
    features,
)
from deg_hf.memory.dims import model_dims, non_negative_int

__all__ = ["Example", "Part", "MemPlanner"]

# ----------------------------------------------------------------------------- batches and parts


@dataclass(frozen=True)
class Example:
    """One training example as the planner sees it: its position and its rows' token lengths.

    SFT/KTO examples have one row; preference pairs (DPO, ORPO, SimPO) have two, chosen and
    rejected, which the pairs path keeps together. ``prompt_len`` (tokens of each row that carry
    no label) lets the fused LM head be charged for labelled positions only. ``lm_lengths`` are
    the rows the LM head scores when they are not the decoder's: a pair packed as one
    ``prompt | chosen | rejected`` row is scored as its two rows ``prompt + chosen`` and
    ``prompt + rejected``.
    """

    index: Any
    lengths: tuple[int, ...]
    prompt_len: int | None = None
    lm_lengths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        raw = (self.lengths,) if isinstance(self.lengths, int) else tuple(self.lengths)
        if not raw:
            raise ValueError(f"example {self.index!r} has no rows")
        object.__setattr__(self, "lengths", tuple(non_negative_int("row length", n) for n in raw))
        if self.prompt_len is not None:
            object.__setattr__(self, "prompt_len", non_negative_int("prompt_len", self.prompt_len))
        if self.lm_lengths is not None:
            lm = tuple(non_negative_int("LM-head row length", n) for n in self.lm_lengths)
            object.__setattr__(self, "lm_lengths", lm or None)

    @property
    def lm_rows(self) -> tuple[int, ...]:
        """The rows the LM head scores: ``lm_lengths`` when set, else the decoder's rows."""
        return self.lm_lengths if self.lm_lengths is not None else self.lengths

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    def labelled(self, lo: int = 0, hi: int | None = None) -> int:
        """Labelled positions of rows ``lo:hi`` (every position when ``prompt_len`` is unknown); of
        the LM head's rows when they differ from the decoder's."""
        p = self.prompt_len or 0
        rows = self.lengths[lo:hi] if self.lm_lengths is None else self.lm_lengths
        return sum(max(0, n - p) for n in rows)


@dataclass(frozen=True)
class Part:
    """A contiguous, in-order run of examples run as one micro-batch.

    ``row_range`` is set on row chunks of a single example (``(start, stop)`` of its rows); it is
    ``None`` when the part holds its examples' rows in full.
    ``estimate`` (scaled) and ``fits`` are as planned; the planner's scale may move afterwards,
    so ask :meth:`MemPlanner.fits` again when that matters.
    """

    examples: tuple[Example, ...]
    features: Features
    estimate: int
    fits: bool
    row_range: tuple[int, int] | None = None

    @property
    def indices(self) -> tuple[Any, ...]:
        return tuple(ex.index for ex in self.examples)

    @property
    def rows(self) -> int:
        return self.features.rows

    @property
    def padded_len(self) -> int:
        return self.features.padded_len


Batch = Union[Part, Example, Features, Sequence[Example]]


def _unit(ex: Example, lo: int = 0, hi: int | None = None) -> tuple[int, int, int, int, int]:
    """(rows, width, labelled, LM-head rows, LM-head width) of rows ``lo:hi`` of ``ex``."""
    rows = ex.lengths[lo:hi]
    lm = rows if ex.lm_lengths is None else ex.lm_lengths
    return len(rows), max(rows), ex.labelled(lo, hi), len(lm), max(lm)


def _combine(units: Iterable[tuple[int, ...]]) -> tuple[int, int, int, int, int]:
    """The units of several examples batched together: rows add up, widths pad to the longest."""
    rows = width = lab = lm_rows = lm_width = 0
    for r, w, lb, lr, lw in units:
        rows, width, lab, lm_rows, lm_width = rows + r, max(width, w), lab + lb, lm_rows + lr, max(lm_width, lw)
    return rows, width, lab, lm_rows, lm_width


# ----------------------------------------------------------------------------- the planner


class MemPlanner:
    """Plans micro-batches whose estimated activation memory fits ``target - static``.

    ``target_bytes`` is the device-memory target, ``static_bytes`` what the model, adapters and
    optimizer hold (:func:`static_bytes`, or a measurement after setup). The budget stays in real
    bytes; the calibrated ``scale`` multiplies the estimate (all but the constant workspace).

    Calibration (:meth:`observe`): each measured activation peak gives a ratio
    ``(measured - workspace) / (raw estimate - workspace)``. A ratio above the current scale
    raises the scale at once to ``ratio * (1 + margin)``; once ``observe_window`` ratios are
    known the scale follows their maximum times ``(1 + margin)`` down as well, never below
    ``min_scale``. A part that ran out of memory gives a lower bound on its peak, which can only
    raise the scale. Parts whose raw estimate is below ``noise_floor_bytes`` are ignored (on CUDA
    their peak is dominated by allocator and workspace noise; the CPU meter counts exactly, and
    the trainers set no floor there). :meth:`observe_static` keeps ``static_bytes`` at least what
    was measured in use before a part.

    ``min_rows`` is the smallest row chunk :meth:`split_rows` and :meth:`halve` may cut (2 keeps
    a chosen/rejected pair together).
    """

    def __init__(
        self,
        target_bytes: int,
        static_bytes: int,
        coef: MemCoef | None = None,
        *,
        model_config: Any,
        min_rows: int = 1,
        checkpointing: bool = True,
        streaming: bool = True,
        fused_lm_head: bool = False,
        lm_head_compact: bool = True,
        lm_head_tile: int = TRL_LM_HEAD_TILE_TOKENS,
        lm_head_tile_vocab: int = TRL_LM_HEAD_TILE_VOCAB,
        dtype_bytes: int = 4,
        attn_implementation: str = "sdpa",
        observe_window: int = 5,
        noise_floor_bytes: int = 256 * MIB,
        margin: float = 0.02,
        min_scale: float = 0.25,
        scale: float = 1.0,
    ) -> None:
        for name, value in (("target_bytes", target_bytes), ("static_bytes", static_bytes),
                            ("noise_floor_bytes", noise_floor_bytes)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        if min_rows < 1:
            raise ValueError(f"min_rows must be >= 1, got {min_rows}")
        if observe_window < 1:
            raise ValueError(f"observe_window must be >= 1, got {observe_window}")
        for name, value in (("margin", margin), ("min_scale", min_scale), ("scale", scale)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        self.target_bytes = int(target_bytes)
        self.static_bytes = int(static_bytes)
        self.coef = coef if coef is not None else MemCoef()
        self.dims = model_dims(model_config)
        self.min_rows = min_rows
        self.checkpointing = checkpointing
        self.streaming = streaming
        self.fused_lm_head = fused_lm_head
        self.lm_head_compact = lm_head_compact
        self.lm_head_tile = lm_head_tile
        self.lm_head_tile_vocab = lm_head_tile_vocab
        self.dtype_bytes = dtype_bytes
        self.attn_implementation = attn_implementation
        self.observe_window = observe_window
        self.noise_floor_bytes = int(noise_floor_bytes)
        self.margin = float(margin)
        self.min_scale = float(min_scale)
        self.scale = max(float(scale), self.min_scale)
        self.window: deque[float] = deque(maxlen=observe_window)
        self.counters = {"observed": 0, "ignored": 0, "raised": 0, "lowered": 0}

    # -- sizes ---------------------------------------------------------------------------

    def budget(self) -> int:
        """Bytes left for activations: ``max(0, target - static)`` (unscaled, real bytes)."""
        return max(0, self.target_bytes - self.static_bytes)

    def features_of(self, rows: int, padded_len: int, completion_tokens: int | None = None,
                    lm_rows: int | None = None, lm_width: int | None = None) -> Features:
        """Features of ``rows`` rows padded to ``padded_len`` under this planner's settings (the LM
        head scoring ``lm_rows`` rows of ``lm_width``, by default the same)."""
        return features(
            self.dims,
            rows=rows,
            padded_len=padded_len,
            lm_rows=lm_rows,
            lm_width=lm_width,
            completion_tokens=completion_tokens,
            streaming=self.streaming,
            checkpointing=self.checkpointing,
            fused_lm_head=self.fused_lm_head,
            lm_head_compact=self.lm_head_compact,
            lm_head_tile=self.lm_head_tile,
            lm_head_tile_vocab=self.lm_head_tile_vocab,
            dtype_bytes=self.dtype_bytes,
            attn_implementation=self.attn_implementation,
        )

    def features_for(self, x: Batch) -> Features:
        """The sizes the estimate of a part, an example, a list of examples or features is made of."""
        if isinstance(x, Features):
            return x
        if isinstance(x, Part):
            return x.features
        examples = [x] if isinstance(x, Example) else list(x)
        return self.features_of(*_combine(_unit(ex) for ex in examples))

    def estimate(self, x: Batch) -> int:
        """Scaled activation estimate of a part, an example, a list of examples or features."""
        return estimate(self.features_for(x), self.coef, self.scale)

    def fits(self, x: Batch) -> bool:
        return self.estimate(x) <= self.budget()

    def _part(self, examples: Sequence[Example], row_range: tuple[int, int] | None = None) -> Part:
        if row_range is None:
            f = self.features_for(examples)
        else:
            (ex,) = examples
            lo, hi = row_range
            f = self.features_of(*_unit(ex, lo, hi))
            if (lo, hi) == (0, ex.rows):
                row_range = None  # all rows: the whole example, as plan() would give it
        est = estimate(f, self.coef, self.scale)
        return Part(tuple(examples), f, est, est <= self.budget(), row_range)

    # -- planning ------------------------------------------------------------------------

    def _partition(self, units: Sequence[tuple[int, ...]]) -> list[tuple[int, int]]:
        """Cut ``units`` (:func:`_unit`: rows, max length, labelled tokens, LM-head rows and width)
        into contiguous fitting runs.

        Minimises the number of runs, then the padded tokens (rows * padded width summed over
        runs), by dynamic programming over cut points. A run fits when its estimate is within
        the budget; a unit that does not fit alone becomes a run of its own. Because the estimate
        is monotone, extending a run that no longer fits never helps, so each start stops at its
        first failure: the cost is O(units * longest run).
        """
        n = len(units)
        budget = self.budget()
        inf = (math.inf, math.inf)
        best: list[tuple[float, float]] = [(0, 0)] + [inf] * n
        cut = [0] * (n + 1)
        for j in range(n):
            if best[j] == inf:
                continue
            run = (0, 0, 0, 0, 0)
            for i in range(j, n):
                run = _combine((run, units[i]))
                rows, width = run[0], run[1]
                f = self.features_of(*run)
                if i > j and estimate(f, self.coef, self.scale) > budget:
                    break  # supersets of a run that does not fit do not fit either
                cost = (best[j][0] + 1, best[j][1] + rows * width)
                if cost < best[i + 1]:
                    best[i + 1], cut[i + 1] = cost, j
        runs = []
        i = n
        while i > 0:
            runs.append((cut[i], i))
            i = cut[i]
        return runs[::-1]

    def plan(self, batch: Sequence[Example]) -> list[Part]:
        """Contiguous, in-order parts of ``batch``; concatenated indices give the input order.

        Every part fits when it can; an example that alone does not fit is its own part with
        ``fits=False`` (the caller splits its rows or skips it). Each part is charged its own
        padded width (the longest row in it), so long and short examples are cut where that
        saves the most padding among the plans with the fewest parts.
        """
        examples = list(batch)
        units = [_unit(ex) for ex in examples]
        return [self._part(examples[a:b]) for a, b in self._partition(units)]

    def _row_units(self, lo: int, hi: int, min_rows: int) -> list[tuple[int, int]]:
        # groups of min_rows consecutive rows; a short tail joins the group before it
        bounds = [(a, min(a + min_rows, hi)) for a in range(lo, hi, min_rows)]
        if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_rows:
            bounds[-2:] = [(bounds[-2][0], hi)]
        return bounds

    def _single(self, x: Example | Part) -> tuple[Example, int, int]:
        if isinstance(x, Example):
            return x, 0, x.rows
        if len(x.examples) != 1:
            raise ValueError(f"expected a part of one example, got {len(x.examples)} examples")
        lo, hi = x.row_range or (0, x.examples[0].rows)
        return x.examples[0], lo, hi

    def split_rows(self, x: Example | Part, min_rows: int | None = None) -> list[Part]:
        """Row chunks of one example (for losses whose rows may be split), in row order.

        Chunks cover the rows exactly once, hold at least ``min_rows`` rows (the planner's by
        default) and fit when a ``min_rows`` group fits; a group that does not fit alone is a
        chunk marked ``fits=False``. An example that fits whole comes back as one chunk.
        """
        ex, lo, hi = self._single(x)
        m = self.min_rows if min_rows is None else min_rows
        if m < 1:
            raise ValueError(f"min_rows must be >= 1, got {m}")
        bounds = self._row_units(lo, hi, m)
        units = [_unit(ex, a, b) for a, b in bounds]
        return [self._part([ex], (bounds[a][0], bounds[b - 1][1])) for a, b in self._partition(units)]

    def halve(self, part: Part | Sequence[Example]) -> tuple[Part, Part] | None:
        """Split a part in two for a retry after an out-of-memory error.

        Several examples: the first ``n // 2`` and the rest. One example: its rows in two
        halves cut on a ``min_rows`` boundary. ``None`` when the part cannot be split further.
        """
        examples = list(part.examples) if isinstance(part, Part) else list(part)
        if len(examples) > 1:
            k = len(examples) // 2
            return self._part(examples[:k]), self._part(examples[k:])
        if not examples:
            return None
        ex, lo, hi = self._single(part) if isinstance(part, Part) else (examples[0], 0, examples[0].rows)
        m = self.min_rows
        if hi - lo < 2 * m:
            return None
        mid = lo + max(m, ((hi - lo) // 2) // m * m)
        return self._part([ex], (lo, mid)), self._part([ex], (mid, hi))

    def largest_batch(
        self, example_len: int, rows_per_example: int = 1, max_examples: int = 4096,
        prompt_len: int | None = None,
    ) -> int:
        """The most equal examples (``rows_per_example`` rows of ``example_len`` tokens) that fit.

        0 when a single example does not fit; at most ``max_examples``.
        """
        non_negative_int("example_len", example_len)
        if rows_per_example < 1:
            raise ValueError(f"rows_per_example must be >= 1, got {rows_per_example}")
        labelled = rows_per_example * max(0, example_len - (prompt_len or 0))

        def ok(n: int) -> bool:
            return self.fits(self.features_of(n * rows_per_example, example_len, n * labelled))

        lo, hi = 0, max(0, max_examples)  # ok(lo) holds (or lo == 0); find the last n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- calibration ---------------------------------------------------------------------

    def observe_static(self, in_use_bytes: float) -> None:
        """Device memory measured in use before a part: the budget never assumes less is held."""
        if math.isfinite(in_use_bytes) and in_use_bytes > self.static_bytes:
            self.static_bytes = int(in_use_bytes)

    def observe(self, x: Batch, measured_peak_bytes: float, lower_bound: bool = False) -> bool:
        """Calibrate ``scale`` from the measured activation peak of a part; True if used.

        ``measured_peak_bytes`` is the part's peak allocated device memory minus what was
        allocated before it (activations only, like the estimate). With ``lower_bound`` (a part
        that ran out of memory before its peak) it can only raise the scale.
        """
        if not math.isfinite(measured_peak_bytes) or measured_peak_bytes < 0:
            raise ValueError(f"measured_peak_bytes must be finite and >= 0, got {measured_peak_bytes!r}")
        f = self.features_for(x)
        parts = breakdown(f, self.coef)
        workspace = parts["workspace"]
        rest = activation_bytes(parts, f.checkpointing)
        if workspace + rest < self.noise_floor_bytes or rest <= 0:
            self.counters["ignored"] += 1
            return False
        ratio = max(0.0, measured_peak_bytes - workspace) / rest
        self.counters["observed"] += 1
        if lower_bound:
            if ratio > self.scale:
                self.scale = max(self.min_scale, ratio * (1 + self.margin))
                self.counters["raised"] += 1
            return True
        self.window.append(ratio)
        if ratio > self.scale:  # under-estimated: never wait, the next part could run out of memory
            self.scale = max(self.min_scale, ratio * (1 + self.margin))
            self.counters["raised"] += 1
        elif len(self.window) == self.observe_window:
            lowered = max(self.min_scale, max(self.window) * (1 + self.margin))
            if lowered < self.scale:
                self.scale = lowered
                self.counters["lowered"] += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable calibration state (scale, recent ratios, counters)."""
        return {"scale": self.scale, "window": list(self.window), "counters": dict(self.counters)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (e.g. on resume); unknown keys are refused."""
        unknown = set(state) - {"scale", "window", "counters"}
        if unknown:
            raise ValueError(f"unknown planner state keys: {sorted(unknown)}")
        scale = state.get("scale", self.scale)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale < 0:
            raise ValueError(f"planner state: bad scale {scale!r}")
        window = [float(r) for r in state.get("window", [])]
        if any(not math.isfinite(r) or r < 0 for r in window):
            raise ValueError("planner state: window ratios must be finite and >= 0")
        counters = {**{k: 0 for k in self.counters}, **{k: int(v) for k, v in state.get("counters", {}).items()}}
        self.scale = max(float(scale), self.min_scale)
        self.window = deque(window[-self.observe_window:], maxlen=self.observe_window)
        self.counters = counters

    def summary(self) -> dict[str, Any]:
        """Numbers worth logging once per run."""
        return {
            "target_bytes": self.target_bytes,
            "static_bytes": self.static_bytes,
            "budget_bytes": self.budget(),
            "scale": self.scale,
            "coef": self.coef.to_dict(),
            **{k: v for k, v in self.counters.items()},
        }

