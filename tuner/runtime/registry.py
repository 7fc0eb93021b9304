"""Backends by name. Every backend loads a model file into a Runner (tuner.runtime.base).

    get_backend("ort-cpu").load(path, settings)          # always works
    resolve("auto")  -> (backends that can run here, one line per backend skipped and why)

GPU backends register here too; each says in `available()` why it cannot run on this machine
(no GPU, library missing), so asking for one explicitly is a clear BadInput (exit 2) and
`auto` skips it with a line in the report.
"""

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


def _ort_cpu_check() -> str | None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the package
        return f"onnxruntime is not importable ({e})"
    return None


def _ort_cpu_load(path: Path, settings: SessionSettings, shapes, cache_dir) -> Runner:
    from tuner.runtime.ort import OrtRunner, load_cpu

    return OrtRunner(load_cpu(path, settings), name="ort-cpu")


_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    _BACKENDS[backend.name] = backend


register(Backend("ort-cpu", "ONNX Runtime, CPU execution provider", _ort_cpu_check, _ort_cpu_load))


def names() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend called `name`; BadInput if unknown. Availability is checked on load."""
    if name not in _BACKENDS:
        raise BadInput(f"unknown backend {name!r}; choose one of: auto, {', '.join(_BACKENDS)}")
    return _BACKENDS[name]


def resolve(spec: str) -> tuple[list[Backend], list[str]]:
    """Backends for a `--backend` value: "auto" (all usable here), or comma-separated names,
    each of which must be usable. Returns the backends and the lines saying what was skipped."""
    if spec == "auto":
        usable, skipped = [], []
        for b in _BACKENDS.values():
            ok, reason = b.available()
            (usable.append(b) if ok else skipped.append(f"skipped backend {b.name}: {reason}"))
        return usable, skipped
    chosen = []
    for name in (s.strip() for s in spec.split(",") if s.strip()):
        b = get_backend(name)
        ok, reason = b.available()
        if not ok:
            raise BadInput(f"backend {name} cannot run here: {reason}")
        chosen.append(b)
    if not chosen:
        raise BadInput("no backend given")
    return chosen, []


# GPU backends (ort-cuda, ort-cuda-fp16, ort-trt, trt, trt-fp16) register themselves.
from tuner.runtime import gpu_backends  # noqa: E402,F401
