"""Statistics of timings: summaries with spread, and speedups as paired-ratio intervals.

Rounds are paired: a speedup is computed from per-round ratios original/variant, which cancels
drift that hits a whole round; the interval is a percentile bootstrap over rounds. Plain
functions on arrays, so the benchmark, the GEMM probe, design and bench/ scripts share them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

Shape = tuple[int, int]  # (batch, seq)


@dataclass(frozen=True)
class Stats:
    """Summary of timings in milliseconds."""

    median: float
    q1: float
    q3: float
    p10: float
    p90: float
    mean: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_spread(self) -> float:
        """IQR / median: the noise level, 0.05 means the middle half spans 5% of the median."""
        return self.iqr / self.median if self.median > 0 else float("inf")


def summarize(samples: Sequence[float] | np.ndarray) -> Stats:
    x = np.asarray(samples, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError("summarize needs a non-empty 1-D array of timings")
    if not np.all(np.isfinite(x)):
        raise ValueError("timings must be finite")
    p10, q1, med, q3, p90 = np.percentile(x, [10, 25, 50, 75, 90])
    return Stats(float(med), float(q1), float(q3), float(p10), float(p90), float(x.mean()), int(x.size))


@dataclass(frozen=True)
class RatioCI:
    """Median of per-round ratios base/candidate (> 1: candidate faster) and its bootstrap
    interval [low, high] at `confidence`."""

    ratio: float
    low: float
    high: float
    confidence: float
    n: int

    def above(self, threshold: float) -> bool:
        return self.low > threshold


def paired_ratio_ci(base: Sequence[float] | np.ndarray, cand: Sequence[float] | np.ndarray,
                    confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> RatioCI:
    """Speedup of `cand` over `base` from paired rounds: ratio_i = base_i / cand_i; the point
    estimate is their median, the interval a percentile bootstrap of that median (rounds
    resampled with replacement). Deterministic for a given seed."""
    a = np.asarray(base, dtype=np.float64)
    b = np.asarray(cand, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired samples must be two 1-D arrays of one length, got {a.shape} and {b.shape}")
    if np.any(a <= 0) or np.any(b <= 0):
        raise ValueError("timings must be positive")
    if not 0 < confidence < 1:
        raise ValueError("confidence must be in (0, 1)")
    r = a / b
    point = float(np.median(r))
    if r.size == 1:
        return RatioCI(point, point, point, confidence, 1)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, r.size, size=(resamples, r.size))
    meds = np.median(r[idx], axis=1)
    alpha = (1 - confidence) / 2
    lo, hi = np.quantile(meds, [alpha, 1 - alpha])
    # the percentile interval of a median can, rarely, miss the sample median: widen to hold it
    return RatioCI(point, float(min(lo, point)), float(max(hi, point)), confidence, int(r.size))


def weighted_totals(samples_by_shape: Mapping[Shape, np.ndarray], weights: Mapping[Shape, float]) -> np.ndarray:
    """Per-round weighted sum over shapes: the expected time of one request in each round,
    when `weights` are the shares of requests at each shape. Arrays must share their length."""
    shapes = [s for s in samples_by_shape if weights.get(s, 0) > 0]
    if not shapes:
        raise ValueError("no shape has a positive weight")
    rounds = {len(samples_by_shape[s]) for s in shapes}
    if len(rounds) != 1:
        raise ValueError(f"shapes have different round counts {sorted(rounds)}")
    total = sum(weights[s] for s in shapes)
    return sum(np.asarray(samples_by_shape[s], np.float64) * (weights[s] / total) for s in shapes)
