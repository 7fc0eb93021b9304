"""The benchmark: every variant timed at every shape in interleaved rounds, through the
results cache, so that speedups always pair timings taken side by side."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from tuner.measure.cache import entry_key
from tuner.measure.stats import RatioCI, Shape, Stats, paired_ratio_ci, summarize, weighted_totals
from tuner.measure.timing import _calibrated, interleave
from tuner.util.progress import Progress


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


def measure(targets: Sequence[Target], shapes: Sequence[Shape], feeds_for: Callable[[Shape], Mapping],
            rounds: int, warmup: int, cache, backend: str, device: str,
            settings: Mapping, progress: Progress = Progress(),
            min_sample_ms: float = 20.0) -> Measurements:
    """Time every target at every shape in interleaved rounds, one shape at a time. A shape
    whose entries are all in `cache` from one group is reused; otherwise every target is
    measured again at that shape, so that ratios always pair timings taken side by side.
    Samples are milliseconds per call; fast calls are repeated within a sample (see
    `_calibrated`)."""
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


