"""Two sessions of one model on a CPU: every thread for a run that has the machine to itself,
one thread each for runs that overlap.

A small model's run parallelizes poorly across a CPU's cores (its operators are short, and
the threads meet at every one), while independent requests parallelize perfectly. On 2
cores, MiniLM-L6 with requests of 8-128 tokens: one two-thread session answered 75-116
requests/s with the requests one after another, one one-thread session 134-146 with two at a
time, and one two-thread session with two at a time 82-105 (three threads on two cores).
A lone request is fastest on every thread, a busy server fastest with one thread per run:
`OverlapRunner` gives each run the session that fits how many runs are in flight when it
starts. The second session holds its own copy of the weights, so this is only for models
small beside the machine's memory (`overlap_wanted`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable, Mapping

import numpy as np

from tuner.hardware.detect import affinity_cores, usable_cores
from tuner.runtime.base import Runner, SessionSettings

OVERLAP_MAX_BYTES = 1 << 30  # a model past this is served by one session (its weights once)


def cpu_threads(settings: SessionSettings) -> int:
    """The threads a session of `settings` runs on (0: the runtime's default, every core this
    process may keep busy)."""
    return settings.intra_op_threads or usable_cores()


def fit_threads(settings: SessionSettings, log: Callable[[str], None]) -> SessionSettings:
    """`settings` (an artifact's: what it was timed with) with no more threads than this
    process may keep busy: an artifact timed on 16 cores and served in a container limited to
    4 CPUs ran 16 threads throttled to 4 CPUs' time."""
    cores, asked = usable_cores(), settings.intra_op_threads
    if (asked or affinity_cores()) <= cores:
        return settings
    given = f"{asked} threads" if asked else "the runtime's default of a thread per core"
    log(f"running on {cores} thread{'s' * (cores > 1)}, not {given}: this process may keep "
        f"{cores} core{'s' * (cores > 1)} busy (its CPU affinity and cgroup quota; "
        "--threads sets it)")
    return dataclasses.replace(settings, intra_op_threads=cores)


def overlap_wanted(backend: str, settings: SessionSettings, model_bytes: int) -> bool:
    """Whether a server should run overlapping requests on a one-thread session beside its
    own: a CPU backend, more than one thread and a model under OVERLAP_MAX_BYTES. (Never
    asked for a decoder with a KV cache: its engine runs one model run at a time and wants
    every thread for it.)"""
    return (backend == "ort-cpu" and cpu_threads(settings) > 1
            and 0 < model_bytes <= OVERLAP_MAX_BYTES)


class OverlapRunner:
    """A Runner over `full` (every thread) and `single` (one thread): a run that starts while
    no other is running takes `full`, one that starts beside another takes `single`."""

    def __init__(self, full: Runner, single: Runner, workers: int) -> None:
        self.full, self.single = full, single
        self.workers = workers  # runs a server should let overlap: the full session's threads
        self.name = f"{full.name}, overlapping runs on one thread each"
        self._running = 0
        self._lock = threading.Lock()
        self.runs = {"full": 0, "single": 0}  # runs each session took (tests, the log)

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self._lock:
            self._running += 1
            kind = "full" if self._running == 1 else "single"
            self.runs[kind] += 1
        try:
            return (self.full if kind == "full" else self.single).infer(feeds)
        finally:
            with self._lock:
                self._running -= 1

    def close(self) -> None:
        self.full.close()
        self.single.close()
