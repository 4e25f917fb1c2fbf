"""Fitting the memory model to measured peaks: what ``scripts/calibrate_memory.py`` runs.

A :class:`Sample` is one part a trainer ran with its device memory measured (CUDA's counters, or
the CPU tensor meter, :mod:`deg_hf.memory.meter`): the part's :class:`~deg_hf.memory.coef.Features`
and its peak above the bytes in use when it began. :func:`record` collects them from a trainer;
:func:`fit` finds the non-negative coefficients (:class:`~deg_hf.memory.coef.MemCoef`) that
minimise the squared *relative* error of the unscaled estimate over the samples, so a small part
counts as much as a large one; :func:`accuracy` says how close an estimate came.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from deg_hf.memory.coef import LAYER_TERMS, LM_HEAD_TERMS, Features, MemCoef, estimate, sizes

__all__ = ["Sample", "record", "fit", "errors", "accuracy"]


@dataclass
class Sample:
    """One measured part: its sizes, its measured peak, and what the planner estimated then
    (with the scale it had before this part calibrated it)."""

    features: Features
    peak_bytes: int
    planned_bytes: int | None = None
    tags: dict = field(default_factory=dict)


def record(trainer, tags: dict | None = None) -> list[Sample]:
    """Measure every part ``trainer`` runs from now on (CPU: the tensor meter) and return the list
    its samples are appended to."""
    trainer.measure_device_memory()
    samples: list[Sample] = []
    trainer.deg_engine.samples = samples
    trainer.deg_engine.sample_tags = dict(tags or {})
    return samples


def errors(samples: Iterable[Sample], coef: MemCoef, scale: float = 1.0) -> list[float]:
    """``estimate / measured - 1`` per sample (negative: an under-estimate)."""
    return [estimate(s.features, coef, scale) / s.peak_bytes - 1 for s in samples if s.peak_bytes > 0]


def accuracy(errs: Sequence[float]) -> dict:
    """Median absolute error, worst under-estimate (most negative) and worst over-estimate."""
    if not errs:
        return {"n": 0, "median_abs_error": None, "worst_under": None, "worst_over": None}
    return {
        "n": len(errs),
        "median_abs_error": round(statistics.median(abs(e) for e in errs), 4),
        "worst_under": round(min(errs), 4),
        "worst_over": round(max(errs), 4),
    }


def fit(samples: Sequence[Sample], *, fixed: dict[str, float] | None = None, under: float | None = 0.05,
        under_rounds: int = 12, headroom: float = 0.0, rounds: int = 20) -> MemCoef:
    """Non-negative coefficients minimising ``sum((estimate / measured - 1) ** 2)`` over ``samples``.

    ``fixed`` pins coefficients (by name) to given values; the others are fitted, ``workspace``
    included. A coefficient whose size is zero in every sample cannot be seen by the data and
    keeps its default. The estimate counts the larger of the LM head's and a layer's working set
    under checkpointing (:func:`~deg_hf.memory.coef.activation_bytes`): the fit alternates
    between choosing, per sample, the branch the current coefficients make the larger and solving
    the non-negative least squares with the other branch's terms left out, for at most
    ``rounds`` rounds. Samples under-estimated by more than ``under`` (a fraction of their peak)
    then weigh twice as much in the next fit, for at most ``under_rounds`` fits. With
    ``headroom`` > 0, the fitted terms are then scaled up so that no
    sample is under-estimated by more than ``headroom`` (a fraction of its peak).
    """
    import torch

    samples = [s for s in samples if s.peak_bytes > 0]
    if not samples:
        raise ValueError("no measured sample to fit (every peak was 0)")
    default = MemCoef().to_dict()
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(default)
    if unknown:
        raise ValueError(f"unknown coefficients to fix: {sorted(unknown)}")
    table = [sizes(s.features) for s in samples]
    names = [n for n in default if n not in fixed and any(row[n] for row in table)]
    peaks = torch.tensor([float(s.peak_bytes) for s in samples], dtype=torch.float64)

    weights = torch.ones(len(samples), dtype=torch.float64)

    def solve(dropped: list[tuple[str, ...]]) -> dict[str, float]:
        rows = [{k: (0 if k in drop else v) for k, v in row.items()} for row, drop in zip(table, dropped)]
        a = torch.tensor([[row[n] for n in names] for row in rows], dtype=torch.float64)
        pinned = torch.tensor([sum(fixed[n] * row[n] for n in fixed) for row in rows], dtype=torch.float64)
        # relative error: divide every row by its measured peak (and weigh it)
        w = weights / peaks
        x = _nnls(a * w[:, None], (peaks - pinned) * w)
        return {**default, **fixed, **{n: float(v) for n, v in zip(names, x.tolist())}}

    def branches(values: dict[str, float]) -> list[tuple[str, ...]]:
        out = []
        for row, sample in zip(table, samples):
            if not sample.features.checkpointing:
                out.append(())
                continue
            head = sum(values[k] * row[k] for k in LM_HEAD_TERMS)
            layer = sum(values[k] * row[k] for k in LAYER_TERMS)
            out.append(LAYER_TERMS if head >= layer else LM_HEAD_TERMS)
        return out

    def alternate(values):
        best, best_err = values, _sq_error(samples, values, weights)
        seen = None
        for _ in range(rounds):
            dropped = branches(values)
            if dropped == seen:
                break
            seen = dropped
            values = solve(dropped)
            err = _sq_error(samples, values, weights)
            if err < best_err:
                best, best_err = values, err
        return best

    best = alternate(solve([()] * len(samples)))  # from a plain sum
    # an under-estimate is an out-of-memory error waiting to happen: weigh the samples under-estimated
    # by more than `under` more heavily, and fit again
    for _ in range(under_rounds if under is not None else 0):
        errs = errors(samples, MemCoef.from_dict(best))
        if min(errs) >= -under:
            break
        for i, e in enumerate(errs):
            if e < -under:
                weights[i] *= 2.0
        best = alternate(best)
    coef = MemCoef.from_dict(best)
    if headroom > 0:
        errs = errors(samples, coef)
        if min(errs) < -headroom:
            raise_by = max((1 - headroom) / (1 + e) for e in errs)
            coef = MemCoef.from_dict({n: (v if n == "workspace" or n in fixed else v * raise_by)
                                      for n, v in best.items()})
    return coef


def _sq_error(samples: Sequence[Sample], values: dict[str, float], weights) -> float:
    coef = MemCoef.from_dict(values)
    return sum(float(w) ** 2 * e * e for w, e in zip(weights, errors(samples, coef)))


def _nnls(a, b, tol: float = 1e-12, max_iter: int = 500):
    """Lawson and Hanson's active-set solution of ``min |a x - b|`` subject to ``x >= 0`` (torch)."""
    import torch

    n = a.shape[1]
    scale = a.abs().amax(dim=0).clamp(min=1e-300)  # columns to unit size: sizes span many decades
    a = a / scale
    passive = torch.zeros(n, dtype=torch.bool)
    x = torch.zeros(n, dtype=a.dtype)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = torch.where(~passive)[0][torch.argmax(w[~passive])]
        passive[j] = True
        while True:
            z = torch.zeros_like(x)
            z[passive] = torch.linalg.lstsq(a[:, passive], b[:, None]).solution[:, 0]
            if (z[passive] > tol).all():
                break
            blocking = passive & (z <= tol)
            alpha = torch.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
        x = z
        w = a.T @ (b - a @ x)
    return (x / scale).clamp(min=0)
