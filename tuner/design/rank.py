"""Rank measured shapes by whole-model throughput, with intervals that say where the noise is.

tokens/s = batch x seq / median(L x layer time + LM head time). Each shape's speedup over the
baseline (the starting shape; without one, the slowest shape measured) is the median of paired
per-round ratios with a bootstrap interval (tuner.measure.bench.paired_ratio_ci). Neighbours in the
ranking are compared the same way: when their interval contains 1 the order between them is
noise (or under `margin`, 1% by default: a difference too small to design a model for), and
the row says so (`tied_with_next`); two runs are expected to agree on every order not marked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tuner.design.explain import explain
from tuner.design.measure import MeasureSettings, ShapeCost
from tuner.hardware.facts import DeviceFacts
from tuner.measure.stats import RatioCI, Stats, paired_ratio_ci, summarize

BaselineKind = Literal["start", "slowest"]


@dataclass(frozen=True)
class RankedShape:
    cost: ShapeCost
    total: Stats  # whole-model forward time per round, ms
    tokens_per_s: float
    speedup: RatioCI  # over the baseline (> 1: faster)
    tied_with_next: bool  # not faster than the next row beyond noise and the margin
    notes: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.cost.candidate.name

    @property
    def tflops(self) -> float:
        """Achieved TFLOP/s over the whole forward pass: shape efficiency, size aside."""
        return self.cost.flops / (self.total.median * 1e-3) / 1e12

    def to_json(self) -> dict[str, Any]:
        c = self.cost.candidate
        return {"name": c.name, "origin": c.origin, "shape": c.shape.to_json(),
                "params": c.params, "tokens_per_s": self.tokens_per_s, "tflops": self.tflops,
                "forward_ms": {"median": self.total.median, "q1": self.total.q1,
                               "q3": self.total.q3, "n": self.total.n,
                               "samples": [float(x) for x in self.cost.total_ms]},
                "speedup": {"ratio": self.speedup.ratio, "low": self.speedup.low,
                            "high": self.speedup.high, "confidence": self.speedup.confidence},
                "tied_with_next": self.tied_with_next, "notes": list(self.notes),
                "gemms": [g.to_json() for g in self.cost.gemms]}


@dataclass(frozen=True)
class Ranking:
    rows: tuple[RankedShape, ...]  # fastest first
    baseline: str
    baseline_kind: BaselineKind
    settings: MeasureSettings
    device: DeviceFacts

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a ranking needs at least one row")
        if self.baseline not in {r.name for r in self.rows}:
            raise ValueError(f"baseline {self.baseline!r} is not among the rows")

    def row(self, name: str) -> RankedShape:
        return next(r for r in self.rows if r.name == name)

    @property
    def best(self) -> RankedShape:
        return self.rows[0]

    def noisy_pairs(self) -> list[tuple[str, str]]:
        """Neighbouring rows whose order is within the noise."""
        return [(a.name, b.name) for a, b in zip(self.rows, self.rows[1:]) if a.tied_with_next]

    def to_json(self) -> dict[str, Any]:
        s = self.settings
        return {"device": self.device.name, "backend": s.backend, "batch": s.batch, "seq": s.seq,
                "rounds": s.rounds, "warmup": s.warmup, "threads": s.threads,
                "dtype": s.dtype if s.backend == "torch-cuda" else "fp32",
                "baseline": self.baseline, "baseline_kind": self.baseline_kind,
                "best": self.best.name, "noisy_pairs": [list(p) for p in self.noisy_pairs()],
                "shapes": [r.to_json() for r in self.rows]}


def rank(costs: list[ShapeCost], settings: MeasureSettings, device: DeviceFacts,
         confidence: float = 0.95, margin: float = 0.01) -> Ranking:
    """Fastest first. The baseline is the candidate of origin "start" if any, else the slowest."""
    if not costs:
        raise ValueError("nothing to rank")
    medians = {id(c): float(summarize(c.total_ms).median) for c in costs}
    ordered = sorted(costs, key=lambda c: medians[id(c)])
    starts = [c for c in costs if c.candidate.origin == "start"]
    base, kind = (starts[0], "start") if starts else (ordered[-1], "slowest")
    rows = []
    for i, c in enumerate(ordered):
        speedup = paired_ratio_ci(base.total_ms, c.total_ms, confidence=confidence)
        tied = False
        if i + 1 < len(ordered):  # is this row really faster than the next one?
            tied = not paired_ratio_ci(ordered[i + 1].total_ms, c.total_ms,
                                       confidence=confidence).above(1.0 + margin)
        rows.append(RankedShape(c, summarize(c.total_ms),
                                settings.tokens / (medians[id(c)] * 1e-3), speedup, tied,
                                explain(c, settings, device, base)))
    return Ranking(tuple(rows), base.candidate.name, kind, settings, device)
