"""Candidate variants from an inspected shape and the device's facts, pruned by a GEMM probe.

Rules only propose (docs/design.md): for each dimension that can be padded exactly (FFN width,
vocabulary, head dim) the next multiples of 8/16/32/64/128 within a growth budget, the
device's preferred multiple for all of them together, and for a gated FFN a few wider
multiples near 8/3*h (the SwiGLU advice: search nearby widths rather than take one). The GEMM
probe then times the model's own GEMMs (M = batch x seq) at the original and candidate sizes,
and candidates predicted slower than the original beyond `prune_below` are dropped before any
graph is built. The original is always a candidate; the whole search is bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from tuner.graph.paddable import BY_KIND, KINDS, Transform, unpadded_kinds
from tuner.hardware.facts import ORT_FUSED_HEAD_DIMS, DeviceFacts, next_multiple
from tuner.measure.stats import paired_ratio_ci
from tuner.plan.probe import model_gemms

MULTIPLES = (8, 16, 32, 64, 128)
# Growth budgets: padding costs FLOPs; beyond these the extra work cannot pay on any device.
MAX_GROWTH = {"ffn": 0.10, "vocab": 0.05, "head_dim": 0.60}
# The dimensions proposed here (head counts are padded on request only: `tuner pad --heads`).
PROPOSED = tuple(MAX_GROWTH)


@dataclass(frozen=True)
class Candidate:
    """One variant to build: exact pads (and/or a fusion pass), or a non-exact reshape
    measured only as advice (`exact=False`)."""

    name: str
    transforms: tuple[Transform, ...]
    exact: bool = True
    reason: str = ""
    predicted: float | None = None  # probe's predicted speedup over the original
    predicted_high: float | None = None  # upper end of its 95% interval (paired rounds)
    base: str | None = None  # a fused candidate: the name of the variant it fuses

    @property
    def pads(self) -> dict[str, int]:
        return {t.kind: t.new for t in self.transforms if t.kind in BY_KIND and t.new}

    @property
    def fused(self) -> bool:
        return any(t.kind == "fuse" for t in self.transforms)


def candidate_name(transforms: Sequence[Transform]) -> str:
    if not transforms:
        return "original"
    return "+".join(t.kind if t.new is None else f"{t.kind}-{t.new}" for t in transforms)


def _make(transforms: Sequence[Transform], reason: str, exact: bool = True) -> Candidate:
    ts = tuple(sorted(transforms, key=lambda t: KINDS.index(t.kind)))
    return Candidate(candidate_name(ts), ts, exact, reason)


def dim_options(kind: str, size: int, facts: DeviceFacts, gated: bool = False,
                hidden: int = 0) -> list[int]:
    """Padded sizes worth trying for one dimension, ascending, within its growth budget."""
    if size <= 0 or size % facts.best_multiple == 0:
        return []
    opts = {next_multiple(size, m) for m in MULTIPLES}
    if kind == "ffn" and gated and hidden:
        # SwiGLU: also the multiples of 64/128/256 just above the literal 8/3*h
        base = max(size, 8 * hidden // 3)
        opts |= {next_multiple(base, m) for m in (64, 128, 256)}
    if kind == "head_dim":
        # fused attention kernels exist for these head dims only (docs/design.md)
        opts |= {d for d in ORT_FUSED_HEAD_DIMS if d > size}
    limit = size * (1 + MAX_GROWTH[kind])
    return sorted(o for o in opts if size < o <= limit)


def propose(shape, facts: DeviceFacts, fuse: bool = False) -> list[Candidate]:
    """All candidates before pruning: the original, each dimension's options, the device's
    preferred multiple for every dimension at once, and (with `fuse`) fused forms."""
    out = [Candidate("original", (), True, "the model as given")]
    per_dim: dict[str, list[int]] = {}
    kinds = [k for k in PROPOSED if k not in unpadded_kinds(shape)]
    for kind, field in ((k, BY_KIND[k].field) for k in kinds):
        size = getattr(shape, field) or 0
        per_dim[kind] = dim_options(kind, size, facts, shape.ffn_gated, shape.hidden_size)
        for new in per_dim[kind]:
            out.append(_make([Transform(kind, size, new)],
                             f"{kind} {size} -> {new}, a multiple of {_alignment(new)}"))
    combo = []
    for kind, opts in per_dim.items():
        size = getattr(shape, BY_KIND[kind].field) or 0
        if opts and next_multiple(size, facts.best_multiple) in opts:
            combo.append(Transform(kind, size, next_multiple(size, facts.best_multiple)))
    if len(combo) > 1:
        out.append(_make(combo, f"every dimension at a multiple of {facts.best_multiple}"))
    if fuse:
        out.append(_make([Transform("fuse")], "ONNX Runtime's transformer fusions"))
    return _dedupe(out)


def _alignment(n: int) -> int:
    """The largest of 8..256 dividing n."""
    return max((m for m in (*MULTIPLES, 256) if n % m == 0), default=1)


def _dedupe(cands: list[Candidate]) -> list[Candidate]:
    seen, out = set(), []
    for c in cands:
        if c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out


def with_fusion(best: Candidate) -> Candidate:
    """The fused form of a padded candidate (pad first, then fuse)."""
    fused = _make([*best.transforms, Transform("fuse")], f"{best.name}, then fused")
    return replace(fused, base=best.name)


# A probe takes GEMM shapes and returns, per shape in order, its times in ms: one per
# interleaved round (round r of every shape belongs together), or a single number.
ProbeFn = Callable[[list], list]


def predict(shape, cands: Sequence[Candidate], batch: int, seq: int, probe_fn: ProbeFn) -> list[Candidate]:
    """Each candidate with `predicted` = the median over rounds of (time of the model's GEMMs,
    original) / (same, candidate), every layer's GEMMs and the LM head once, and
    `predicted_high`, the top of its bootstrap interval: pruning uses that, so a candidate is
    dropped only when the probe says it is slower beyond its own noise. Fusion is not predicted."""

    def gemms(c: Candidate):
        s = replace(shape, **{BY_KIND[k].field: v for k, v in c.pads.items()}) if c.pads else shape
        return model_gemms(s, batch, seq)

    base = gemms(cands[0] if cands and cands[0].name == "original" else Candidate("original", ()))
    lists = [base] + [gemms(c) for c in cands]
    samples = [np.atleast_1d(np.asarray(t, dtype=np.float64))
               for t in probe_fn([g for lst in lists for g in lst])]
    layers = max(shape.num_layers, 1)
    totals, i = [], 0  # whole-model GEMM time per round, per list
    for lst in lists:
        totals.append(sum(t * (1 if g.label == "lm_head" else layers)
                          for g, t in zip(lst, samples[i:i + len(lst)])))
        i += len(lst)
    out = []
    for c, t in zip(cands, totals[1:]):
        if c.fused:
            out.append(replace(c, predicted=None, predicted_high=None))
            continue
        ci = paired_ratio_ci(totals[0], t)
        out.append(replace(c, predicted=ci.ratio, predicted_high=ci.high))
    return out


def _rank(c: Candidate) -> tuple:
    """Best first: predicted speedup, then (unprobed) sizes at a multiple of 64."""
    aligned = all(t.new % 64 == 0 for t in c.transforms if t.new)
    return (-(c.predicted if c.predicted is not None else 1.0), not aligned)


def prune(cands: Sequence[Candidate], max_variants: int, prune_below: float = 0.97) -> tuple[list[Candidate], list[str]]:
    """Keep the original; drop candidates predicted slower than `prune_below`; of the
    one-dimension candidates keep the best per dimension (50264, 50272 and 50304 differ by
    noise on most devices; measuring all three costs more than it can tell); then the best
    up to `max_variants` in all. Returns (kept, one line per dropped)."""
    original = [c for c in cands if c.name == "original"]
    notes, keep, best_of = [], [], {}
    for c in (c for c in cands if c.name != "original"):
        high = c.predicted_high if c.predicted_high is not None else c.predicted
        if high is not None and high < prune_below:
            notes.append(f"pruned {c.name}: the GEMM probe predicts {c.predicted:.3f}x"
                         + (f" (95% interval up to {high:.3f}x)" if c.predicted_high is not None else ""))
        elif len(c.transforms) == 1 and c.transforms[0].kind in PROPOSED:
            kind = c.transforms[0].kind
            if kind not in best_of or _rank(c) < _rank(best_of[kind]):
                best_of[kind] = c
            keep.append(c)
        else:
            keep.append(c)
    for c in list(keep):
        single = len(c.transforms) == 1 and c.transforms[0].kind in PROPOSED
        if single and best_of[c.transforms[0].kind] is not c:
            keep.remove(c)
            best = best_of[c.transforms[0].kind]
            both = c.predicted is not None and best.predicted is not None
            notes.append(f"dropped {c.name}" + (f" (predicted {c.predicted:.3f}x)" if both else "")
                         + f": {best.name} ranks higher"
                         + (f" (predicted {best.predicted:.3f}x)" if both else ""))
    keep.sort(key=_rank)
    room = max(0, max_variants - len(original))
    for c in keep[room:]:
        notes.append(f"dropped {c.name}: over the limit of {max_variants} variants"
                     + (f" (predicted {c.predicted:.3f}x)" if c.predicted is not None else ""))
    return original + keep[:room], notes
