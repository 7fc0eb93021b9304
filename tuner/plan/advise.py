"""`--advise`: what a retrain would buy. Shape changes that are not exact (fewer, wider heads
so that h/a is a multiple of 64; h itself at a multiple of 64) cannot be applied to trained
weights, but their speed can be measured with random weights. Here that is done at the GEMM
level with the probe (the paper's own method): one layer's GEMMs plus the LM head, for the
original and each reshape, timed in the same interleaved rounds, so per-round whole-model
totals pair up and the speedup gets the same bootstrap interval as real variants.
Results are recorded as advice: `exact: false`, never selected, never served.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from tuner.graph.paddable import Transform
from tuner.hardware.facts import next_multiple
from tuner.measure.stats import RatioCI, paired_ratio_ci
from tuner.plan.probe import model_gemms


@dataclass(frozen=True)
class Reshape:
    name: str
    transforms: tuple[Transform, ...]
    shape: object  # the ModelShape with the new dims


def reshapes(shape) -> list[Reshape]:
    """The paper's advice for this shape: h/a at a multiple of 64 (fewer, wider heads), and h
    at a multiple of 64 (then heads of 64 or 128)."""
    h, a, d = shape.hidden_size, shape.num_heads, shape.head_dim
    out: list[Reshape] = []
    if not (h and a and d):
        return out
    if h % 64 == 0 and d % 64:
        for nd in (64, 128):
            na = h // nd
            if na >= 1 and h % nd == 0 and na != a:
                kv = max(1, min(na, na * shape.num_kv_heads // a))
                out.append(Reshape(f"heads-{na}x{nd}", (Transform("heads", a, na), Transform("head_dim", d, nd)),
                                   replace(shape, num_heads=na, num_kv_heads=kv, head_dim=nd)))
    if h % 64:
        nh = next_multiple(h, 64)
        nd = 64 if nh % 64 == 0 else d
        na = nh // nd
        out.append(Reshape(f"hidden-{nh}", (Transform("hidden", h, nh), Transform("heads", a, na),
                                            Transform("head_dim", d, nd)),
                           replace(shape, hidden_size=nh, num_heads=na,
                                   num_kv_heads=max(1, na * shape.num_kv_heads // a), head_dim=nd)))
    return out


@dataclass(frozen=True)
class Advice:
    name: str
    transforms: tuple[Transform, ...]
    speedup: RatioCI
    note: str


def measure_advice(shape, batch: int, seq: int, probe: Callable, rounds: int = 7) -> list[Advice]:
    """Time the original's GEMMs and each reshape's together; speedup from paired rounds.
    `probe(gemms, rounds)` returns tuner.plan.probe GemmResults (per-round samples_ms)."""

    options = reshapes(shape)
    if not options:
        return []
    lists = [model_gemms(shape, batch, seq)] + [model_gemms(r.shape, batch, seq) for r in options]
    results = probe([g for lst in lists for g in lst], rounds)
    totals, i = [], 0
    layers = max(shape.num_layers, 1)
    for lst in lists:
        rs = results[i:i + len(lst)]
        i += len(lst)
        totals.append(sum(np.asarray(r.samples_ms) * (1 if r.shape.label == "lm_head" else layers)
                          for r in rs))
    out = []
    for r, t in zip(options, totals[1:]):
        ci = paired_ratio_ci(totals[0], t)
        out.append(Advice(r.name, r.transforms, ci,
                          f"needs retraining; GEMM-level estimate at {batch}x{seq} "
                          f"(every layer's GEMMs and the LM head, random weights)"))
    return out
