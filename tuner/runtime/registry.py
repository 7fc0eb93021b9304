"""Backends by name. Every backend loads a model file into a Runner (tuner.runtime.base).

    get_backend("ort-cpu").load(path, settings)          # always works
    resolve("auto")  -> (backends that can run here, one line per backend skipped and why)

The list is explicit (CPU, then gpu_backends.GPU_BACKENDS); each backend says in `available()` why it cannot run on this machine
(no GPU, library missing), so asking for one explicitly is a clear BadInput (exit 2) and
`auto` skips it with a line in the report.
"""

from __future__ import annotations

from tuner.errors import BadInput
from tuner.runtime.backend import Backend
from tuner.runtime.gpu_backends import GPU_BACKENDS
from tuner.runtime.ort import CPU_BACKEND

# Every backend, in the order `auto` tries them: the CPU first (it always works), then the
# GPU ones, each of which says in its check why it cannot run on this machine.
_BACKENDS: dict[str, Backend] = {b.name: b for b in (CPU_BACKEND, *GPU_BACKENDS)}


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
