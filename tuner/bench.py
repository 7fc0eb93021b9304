"""Honest timing: warm-up, interleaved rounds, medians with spread, paired speedup intervals.

A busy machine drifts (other processes, clocks, caches), so variants are never timed one
after the other: every round runs each variant once (A B C, then B C A, ...), and a variant's
speedup is computed from per-round *paired* ratios original/variant, which cancels drift that
hits a whole round. The interval is a percentile bootstrap over rounds. `select` keeps the
original unless a variant's whole interval lies above 1 + margin.

The statistics are plain functions on arrays (`summarize`, `paired_ratio_ci`,
`weighted_totals`) so other parts (bench/ scripts, the GEMM probe) reuse them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

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


def interleave(callables: Sequence[Callable[[], object]], rounds: int, warmup: int = 1,
               on_step: Callable[[int, int], None] | None = None, seed: int = 0) -> np.ndarray:
    """Time each callable once per round, in a fresh random order each round (seeded), so
    drift hits all alike and no callable always runs first or always follows the same other
    one (a fixed rotation A B C, B C A, ... keeps B behind A and inherits A's cache state).
    Returns milliseconds, shape (len(callables), rounds). `on_step(round, index)` is called
    after each timed call (progress bars)."""
    if rounds < 1 or warmup < 0:
        raise ValueError("rounds must be >= 1 and warmup >= 0")
    n = len(callables)
    for _ in range(warmup):
        for f in callables:
            f()
    rng = np.random.default_rng(seed)
    out = np.empty((n, rounds), dtype=np.float64)
    for r in range(rounds):
        for i in rng.permutation(n):
            t0 = time.perf_counter()
            callables[i]()
            out[i, r] = (time.perf_counter() - t0) * 1e3
            if on_step is not None:
                on_step(r, int(i))
    return out


@dataclass(frozen=True)
class Selection:
    name: str
    reason: str


MIN_PAIRS = 5  # fewer paired rounds than this cannot support a claim of a win


def select(speedups: Mapping[str, RatioCI], margin: float = 0.03,
           eligible: Callable[[str], bool] = lambda name: True,
           min_pairs: int = MIN_PAIRS) -> Selection:
    """The original unless some eligible variant's interval, from at least `min_pairs`
    paired rounds, lies wholly above 1 + margin; among those, the one with the highest lower
    bound (the surest win)."""
    if margin < 0:
        raise ValueError("margin must be >= 0")
    few = [n for n, ci in speedups.items() if n != "original" and ci.n < min_pairs]
    if few:
        return Selection("original", (
            f"too few paired rounds to tell ({min(speedups[n].n for n in few)} < {min_pairs}; "
            "use more --rounds): the original is kept"))
    winners = {n: ci for n, ci in speedups.items()
               if n != "original" and eligible(n) and ci.above(1 + margin)}
    if not winners:
        best = max(((n, ci) for n, ci in speedups.items() if n != "original" and eligible(n)),
                   key=lambda kv: kv[1].ratio, default=None)
        if best is None:
            return Selection("original", "no exact variant to compare: the original is kept")
        n, ci = best
        return Selection("original", (
            f"nothing was faster beyond noise: the best variant, {n}, measured "
            f"{ci.ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}] at {ci.confidence:.0%}, and a win needs "
            f"the whole interval above {1 + margin:.2f}x; the original is kept"))
    n, ci = max(winners.items(), key=lambda kv: (kv[1].low, kv[1].ratio))
    return Selection(n, (f"{n} is faster beyond noise: {ci.ratio:.3f}x "
                         f"[{ci.low:.3f}, {ci.high:.3f}] at {ci.confidence:.0%}, interval above "
                         f"{1 + margin:.2f}x"))


# ---------------------------------------------------------------------------------------------
# Timing runners over shapes, with the results cache


@dataclass(frozen=True)
class Target:
    """One variant to time: its runner and the sha256 of its graph (the cache key)."""

    name: str
    runner: object  # tuner.runtime.base.Runner
    graph_sha: str


@dataclass(frozen=True)
class Measurements:
    """Per-round samples (ms) by (variant, shape); rounds are paired within a shape."""

    samples: Mapping[tuple[str, Shape], np.ndarray]
    cached_shapes: tuple[Shape, ...]  # shapes taken from the cache, not re-measured

    def stats(self, name: str, shape: Shape) -> Stats:
        return summarize(self.samples[(name, shape)])

    def by_shape(self, name: str) -> dict[Shape, np.ndarray]:
        return {s: x for (n, s), x in self.samples.items() if n == name}

    def speedup_at(self, name: str, shape: Shape, base: str = "original", **kw) -> RatioCI:
        return paired_ratio_ci(self.samples[(base, shape)], self.samples[(name, shape)], **kw)

    def speedup(self, name: str, weights: Mapping[Shape, float], base: str = "original",
                **kw) -> RatioCI:
        """Speedup in expected time per request: per-round totals weighted by `weights`."""
        return paired_ratio_ci(weighted_totals(self.by_shape(base), weights),
                               weighted_totals(self.by_shape(name), weights), **kw)


class Progress:
    """What `measure` reports to; the no-op base. `rich_progress` draws a bar with an ETA."""

    def start(self, total: int) -> None: ...

    def advance(self, what: str) -> None: ...


def _calibrated(call: Callable[[], object], once_ms: float | None, min_sample_ms: float,
                max_reps: int = 1000):
    """`call` repeated so one sample lasts about `min_sample_ms` (a 0.3 ms run alone is all
    timer noise and scheduler jitter); `measure` divides the time back per call. `once_ms`
    is a warm run's time, if one was taken. Returns (callable, reps)."""
    if once_ms is None:
        t0 = time.perf_counter()
        call()
        once_ms = (time.perf_counter() - t0) * 1e3
    reps = max(1, min(max_reps, int(np.ceil(min_sample_ms / max(once_ms, 1e-6)))))
    if reps == 1:
        return call, 1

    def repeated() -> None:
        for _ in range(reps):
            call()
    return repeated, reps


def measure(targets: Sequence[Target], shapes: Sequence[Shape], feeds_for: Callable[[Shape], Mapping],
            rounds: int, warmup: int, cache, backend: str, device: str,
            settings: Mapping, progress: Progress = Progress(),
            min_sample_ms: float = 20.0) -> Measurements:
    """Time every target at every shape in interleaved rounds, one shape at a time. A shape
    whose entries are all in `cache` from one group is reused; otherwise every target is
    measured again at that shape, so that ratios always pair timings taken side by side.
    Samples are milliseconds per call; fast calls are repeated within a sample (see
    `_calibrated`)."""
    import uuid

    from tuner.cache import entry_key

    key_settings = {**settings, "min_sample_ms": min_sample_ms}
    keys = {(t.name, s): entry_key(t.graph_sha, backend, device, s, key_settings, rounds, warmup)
            for t in targets for s in shapes}
    samples: dict[tuple[str, Shape], np.ndarray] = {}
    todo, reused = [], []
    for s in shapes:
        entries = [cache.get(keys[(t.name, s)]) for t in targets]
        if all(e is not None for e in entries) and len({e.group for e in entries}) == 1:
            for t, e in zip(targets, entries):
                samples[(t.name, s)] = np.asarray(e.samples_ms)
            reused.append(s)
        else:
            todo.append(s)
    progress.start(len(todo) * len(targets) * (rounds + warmup))
    for s in todo:
        feeds = feeds_for(s)
        calls = [(lambda r=t.runner: r.infer(feeds)) for t in targets]
        last: list[float | None] = [None] * len(targets)
        for i, t in enumerate(targets):
            for _ in range(warmup):
                t0 = time.perf_counter()
                calls[i]()
                last[i] = (time.perf_counter() - t0) * 1e3
                progress.advance(f"warm-up {t.name} at {s[0]}x{s[1]}")
        timed = [_calibrated(c, once, min_sample_ms) for c, once in zip(calls, last)]
        out = interleave([c for c, _ in timed], rounds, warmup=0, on_step=lambda r, i, s=s: progress.advance(
            f"{targets[i].name} at {s[0]}x{s[1]}, round {r + 1}/{rounds}"))
        out /= np.array([[reps] for _, reps in timed], dtype=np.float64)
        group = uuid.uuid4().hex
        for i, t in enumerate(targets):
            samples[(t.name, s)] = out[i]
        cache.put_group({keys[(t.name, s)]: tuple(out[i]) for i, t in enumerate(targets)}, group)
    return Measurements(samples, tuple(reused))


class rich_progress(Progress):
    """A rich progress bar on stderr (what is measured, done/total, ETA); silent when
    `enabled` is false. Use as a context manager."""

    def __init__(self, enabled: bool = True, title: str = "measuring") -> None:
        self.enabled, self.title, self._bar, self._task = enabled, title, None, None

    def __enter__(self) -> "rich_progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar,
                                       TextColumn, TimeElapsedColumn, TimeRemainingColumn)

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                            console=Console(stderr=True), transient=False)
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def start(self, total: int) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task(self.title, total=max(total, 1))
            if total == 0:
                self._bar.update(self._task, completed=1, description=f"{self.title}: all cached")

    def advance(self, what: str) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=1, description=f"{self.title}: {what}")
