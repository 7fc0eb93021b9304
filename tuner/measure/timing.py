"""Interleaved timing: every round runs each callable once, in a fresh random order, so
drift on a busy machine hits all alike; fast calls are repeated within a sample.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np


def interleave_timed(timers: Sequence[Callable[[], float]], rounds: int,
                     on_step: Callable[[int, int], None] | None = None,
                     seed: int = 0) -> np.ndarray:
    """Call each timer once per round, in a fresh random order each round (seeded), so drift
    hits all alike and no timer always runs first or always follows the same other one (a
    fixed rotation A B C, B C A, ... keeps B behind A and inherits A's cache state). Each
    timer returns its own milliseconds (a GPU kernel is timed with CUDA events, not the
    host's clock). Returns shape (len(timers), rounds); `on_step(round, index)` is called
    after each timed call (progress bars)."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    rng = np.random.default_rng(seed)
    out = np.empty((len(timers), rounds), dtype=np.float64)
    for r in range(rounds):
        for i in rng.permutation(len(timers)):
            out[i, r] = timers[i]()
            if on_step is not None:
                on_step(r, int(i))
    return out


def _wall_ms(call: Callable[[], object]) -> Callable[[], float]:
    def timed() -> float:
        t0 = time.perf_counter()
        call()
        return (time.perf_counter() - t0) * 1e3
    return timed


def interleave(callables: Sequence[Callable[[], object]], rounds: int, warmup: int = 1,
               on_step: Callable[[int, int], None] | None = None, seed: int = 0) -> np.ndarray:
    """`interleave_timed` on the host's clock, after `warmup` untimed calls of each. Returns
    milliseconds, shape (len(callables), rounds)."""
    if rounds < 1 or warmup < 0:
        raise ValueError("rounds must be >= 1 and warmup >= 0")
    for _ in range(warmup):
        for f in callables:
            f()
    return interleave_timed([_wall_ms(f) for f in callables], rounds, on_step, seed)


def reps_for(once_ms: float, min_sample_ms: float, max_reps: int = 1000) -> int:
    """How many calls one sample takes so that it lasts about `min_sample_ms` (a 0.3 ms run
    alone is all timer noise and scheduler jitter), given one warm call's time."""
    return max(1, min(max_reps, int(np.ceil(min_sample_ms / max(once_ms, 1e-6)))))


def _calibrated(call: Callable[[], object], once_ms: float | None, min_sample_ms: float,
                max_reps: int = 1000):
    """`call` repeated `reps_for` times (`measure` divides the time back per call). `once_ms`
    is a warm run's time, if one was taken. Returns (callable, reps)."""
    if once_ms is None:
        t0 = time.perf_counter()
        call()
        once_ms = (time.perf_counter() - t0) * 1e3
    reps = reps_for(once_ms, min_sample_ms, max_reps)
    if reps == 1:
        return call, 1

    def repeated() -> None:
        for _ in range(reps):
            call()
    return repeated, reps
