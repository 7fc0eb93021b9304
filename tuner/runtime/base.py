"""The runner interface every backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np


@dataclass(frozen=True)
class SessionSettings:
    """Session options that change timings; recorded in the manifest beside every latency."""

    intra_op_threads: int = 0  # 0: the runtime's default (all physical cores)
    inter_op_threads: int = 1
    graph_optimization: str = "all"  # disable | basic | extended | all
    # Idle ORT sessions spin-wait on their thread pools and steal the cores of the session
    # being timed: interleaved benchmarks keep several alive, so spinning is off by default.
    # A server with one hot session may turn it on for a little latency.
    allow_spinning: bool = False

    def __post_init__(self) -> None:
        if self.graph_optimization not in ("disable", "basic", "extended", "all"):
            raise ValueError(f"graph_optimization must be disable|basic|extended|all, "
                             f"not {self.graph_optimization!r}")
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ValueError("thread counts must be >= 0")


class Runner(Protocol):
    """Runs one loaded model. `infer` takes and returns numpy arrays keyed by graph names;
    `close` releases the session (its weights and arenas) now rather than at garbage
    collection, so that a job holds one model at a time where it can."""

    name: str

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...
