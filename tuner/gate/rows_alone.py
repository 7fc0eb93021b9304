"""The check of a graph against an original that runs one row at a time: each feed's batch
run through the candidate, each of its rows through the original alone, the rows' outputs
stacked and compared (tuner.gate.verify: every output, masks honoured, fails closed).

A transformer computes every row of a batch from that row alone (its mask keeps padding out),
so the original on one row is the truth for that row of a batch, even where the original
itself cannot run the batch: torch's opset-23 export with one-row rotary caches
(tuner.rewrite.rotary_batch) is the case this exists for.

    result = check_rows_alone(load_original, load_candidate, feeds, specs, tolerance)
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from tuner.errors import BadInput
from tuner.gate.verify import Tolerance, VerifyResult, record_then_release, verify
from tuner.graph.io import quantizes_activations
from tuner.graph.roles import InputSpec, input_specs
from tuner.graph.rotary_caches import batch_one_rotaries
from tuner.runtime.base import Runner


class RowsAlone:
    """A Runner that runs `runner` on each row of a feed alone (the inputs split on their
    batch axes, `specs`) and stacks the rows' outputs on their first axis. An output whose
    first axis is not 1 at batch 1 has no rows to stack: ValueError (the gate reports it)."""

    name = "rows-alone"

    def __init__(self, runner: Runner, specs: Sequence[InputSpec]) -> None:
        self._runner = runner
        self._axes = {s.name: s.batch_axis for s in specs if s.batch_axis is not None}

    def close(self) -> None:
        self._runner.close()

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = _batch(feeds, self._axes)
        outs = [self._runner.infer(_row(feeds, self._axes, r)) for r in range(rows)]
        stacked = {}
        for name in outs[0]:
            parts = [np.asarray(o[name]) for o in outs]
            if any(p.ndim == 0 or p.shape[0] != 1 for p in parts):
                raise ValueError(f"output {name!r} has no batch axis first "
                                 f"(shape {parts[0].shape} at batch 1): its rows cannot be stacked")
            stacked[name] = np.concatenate(parts, axis=0)
        return stacked


def _batch(feeds: Mapping[str, np.ndarray], axes: Mapping[str, int]) -> int:
    sizes = {feeds[n].shape[a] for n, a in axes.items() if n in feeds and feeds[n].ndim > a}
    if len(sizes) != 1:
        raise ValueError(f"the inputs disagree on the batch: sizes {sorted(sizes)}")
    return sizes.pop()


def _row(feeds: Mapping[str, np.ndarray], axes: Mapping[str, int],
         r: int) -> dict[str, np.ndarray]:
    return {n: (np.ascontiguousarray(np.take(a, [r], axis=axes[n])) if n in axes and
                a.ndim > axes[n] else a) for n, a in feeds.items()}


def reference_for(model: ir.Model, load: Callable[[], Runner]
                  ) -> tuple[Callable[[], Runner], bool]:
    """`load`, or, where `model` runs one row at a time (tuner.graph.rotary_caches), a loader
    of it wrapped in RowsAlone; and whether it was wrapped. BadInput where such a graph also
    quantizes its activations per run (quantize_dynamic)."""
    if not batch_one_rotaries(model):
        return load, False
    if quantizes_activations(model):
        # a row alone is quantized over itself, in a batch over the batch: not comparable
        raise BadInput("the graph runs at batch 1 only (its RotaryEmbedding caches hold one "
                       "row) and quantizes its activations per run, so its rows alone cannot "
                       "check a batch: run `tuner rebatch` on it first (checked with its "
                       "activations in float), or `tuner optimize`, which does")
    specs = input_specs(model)
    return (lambda: RowsAlone(load(), specs)), True


def check_rows_alone(load_original: Callable[[], Runner], load_candidate: Callable[[], Runner],
                     feeds: Sequence[Mapping[str, np.ndarray]], specs: Sequence[InputSpec],
                     tolerance: Tolerance = Tolerance()) -> VerifyResult:
    """`load_candidate()`'s outputs on `feeds` against `load_original()` run row by row; one
    session at a time (the original's answers are recorded and it is released first)."""
    reference = record_then_release(lambda: RowsAlone(load_original(), specs), feeds)
    candidate = load_candidate()
    try:
        return verify(reference, candidate, feeds, tolerance, specs)
    finally:
        candidate.close()
