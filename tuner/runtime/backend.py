"""A backend: a name, a check that says why it cannot run here, and a loader that builds a
Runner (tuner.runtime.base) from a model file. The list of backends is in registry.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from tuner.errors import BadInput
from tuner.runtime.base import Runner, SessionSettings

# load(model_path, settings, shapes, cache_dir) -> Runner. `shapes` are the (batch, seq)
# bucket shapes the runner will see (TensorRT builds one optimisation profile per bucket);
# `cache_dir` is where engines and timing caches may be kept (inside the artifact).
Loader = Callable[[Path, SessionSettings, Sequence[tuple[int, int]] | None, Path | None], Runner]


@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    check: Callable[[], str | None]  # None when usable here, else the reason it is not
    loader: Loader
    precision: str = "fp32"  # "fp16": outputs must be judged at fp16 tolerances

    def available(self) -> tuple[bool, str]:
        reason = self.check()
        return (reason is None, reason or "available")

    def load(self, model_path: str | Path, settings: SessionSettings = SessionSettings(),
             shapes: Sequence[tuple[int, int]] | None = None,
             cache_dir: Path | None = None) -> Runner:
        reason = self.check()
        if reason is not None:
            raise BadInput(f"backend {self.name} cannot run here: {reason}")
        return self.loader(Path(model_path), settings, shapes, cache_dir)
