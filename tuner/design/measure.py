"""Whole-model forward cost of each candidate shape, from its real GEMMs on the device.

Every candidate's GEMMs (QKV, attention scores and context, output projection, FFN, and the
LM head) at M = batch x seq go into one interleaved probe (tuner.plan.probe), where shapes shared by
several candidates are timed once. Round r of every GEMM was timed in the same sweep, so a
candidate's round-r model time, L x (its layer GEMMs in round r) + its LM head in round r, is
paired with every other candidate's round-r time: tuner.measure.bench.paired_ratio_ci turns those
pairs into a speedup with an interval that a drifting machine load cannot fake.

What is left out, on purpose and said in the report: element-wise work (norms, activations,
softmax, rotary) and the embedding lookup; they scale with h and s alike across shapes of one
size, and the paper's ranking is a GEMM effect.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tuner.design.candidates import Candidate
from tuner.errors import BadInput
from tuner.plan.probe import BACKENDS, GemmResult, GemmShape, model_gemms, pool_elements, probe
from tuner.util.progress import Progress

# Bytes of operands the CPU probe may hold at once. ORT keeps a prepacked copy of each weight,
# so the process peaks near 3x this (125M searches: ~0.4 GiB of operands, 1.3-1.5 GB RSS).
CPU_MEMORY_LIMIT = 2 << 30


@dataclass(frozen=True)
class MeasureSettings:
    batch: int
    seq: int
    backend: str = "ort-cpu"
    rounds: int = 7
    warmup: int = 2
    threads: int = 0  # ORT intra-op threads (0: its default)
    dtype: str = "fp16"  # torch-cuda only

    def __post_init__(self) -> None:
        if self.batch < 1 or self.seq < 1:
            raise BadInput(f"batch and seq must be >= 1, got batch={self.batch}, seq={self.seq}")
        if self.rounds < 3:
            raise BadInput(f"at least 3 rounds are needed for an interval, got {self.rounds}")
        if self.threads < 0:  # the only one of the two a user sets (--threads)
            raise BadInput(f"--threads must be >= 0 (0: the runtime's default), not {self.threads}")
        if self.warmup < 0:
            raise BadInput(f"warmup must be >= 0, not {self.warmup}")
        if self.backend not in BACKENDS:
            raise BadInput(f"unknown probe backend {self.backend!r}; choose one of: "
                           f"{', '.join(BACKENDS)}")

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass(frozen=True)
class ShapeCost:
    """One candidate's measured forward cost; arrays are per round, in milliseconds."""

    candidate: Candidate
    gemms: tuple[GemmResult, ...]  # the layer's GEMMs, then the LM head
    layer_ms: tuple[float, ...]
    head_ms: tuple[float, ...]

    @property
    def total_ms(self) -> np.ndarray:
        """Per-round forward time of the whole model: L layers and the LM head."""
        layers = self.candidate.shape.num_layers
        return layers * np.asarray(self.layer_ms) + np.asarray(self.head_ms)

    @property
    def flops(self) -> int:
        """FLOPs of one forward pass's GEMMs: L layers and the LM head."""
        layers = self.candidate.shape.num_layers
        return sum(g.shape.flops * (1 if g.shape.label == "lm_head" else layers)
                   for g in self.gemms)

    def gemm_ms(self, g: GemmResult) -> float:
        """Median time the whole model spends in GEMM `g` (L times for a layer GEMM)."""
        return g.median_ms * (1 if g.shape.label == "lm_head" else self.candidate.shape.num_layers)

    def share(self, label: str) -> float:
        """Fraction of the model's GEMM time spent in the GEMMs labelled `label`."""
        total = sum(self.gemm_ms(g) for g in self.gemms)
        return sum(self.gemm_ms(g) for g in self.gemms if g.shape.label == label) / total


def operand_bytes(shapes: list[GemmShape], element_bytes: int) -> int:
    """Bytes of A, B and Y of every distinct GEMM: what the CPU probe holds at once."""
    seen = {s.key: s for s in shapes}
    return element_bytes * sum(s.batch * (s.m * s.k + s.k * s.n + s.m * s.n) for s in seen.values())


def _memory_check(shapes: list[GemmShape], settings: MeasureSettings) -> None:
    if settings.backend == "ort-cpu":
        limit, need = CPU_MEMORY_LIMIT, operand_bytes(shapes, 4)
    else:  # the GPU probe shares two buffers among all shapes (tuner.plan.probe.pool_elements)
        import torch

        limit = int(0.8 * torch.cuda.mem_get_info()[0])
        need = sum(pool_elements(shapes)) * (4 if settings.dtype == "fp32" else 2)
    if need > limit:
        raise BadInput(f"the GEMMs of these candidates at batch {settings.batch} x seq "
                       f"{settings.seq} need {need / 2**30:.1f} GiB of operands, over the "
                       f"{limit / 2**30:.1f} GiB this probe allows: lower --batch or --seq, measure "
                       f"fewer shapes (--max-candidates, --layers), or run it on a GPU")


def measure(candidates: list[Candidate], settings: MeasureSettings,
            progress: Progress | None = None) -> list[ShapeCost]:
    """Probe every candidate's GEMMs together; one ShapeCost per candidate, in order."""
    if not candidates:
        raise BadInput("no candidate shapes to measure")
    per_candidate = [model_gemms(c.shape, settings.batch, settings.seq) for c in candidates]
    flat = [g for gemms in per_candidate for g in gemms]
    _memory_check(flat, settings)
    results = probe(flat, settings.backend, settings.rounds, settings.warmup,
                    threads=settings.threads, dtype=settings.dtype, progress=progress)
    costs, i = [], 0
    for cand, gemms in zip(candidates, per_candidate):
        mine = results[i:i + len(gemms)]
        i += len(gemms)
        layer = np.sum([r.samples_ms for r in mine if r.shape.label != "lm_head"], axis=0)
        head = np.sum([r.samples_ms for r in mine if r.shape.label == "lm_head"], axis=0)
        if np.ndim(head) == 0:  # no LM head (not expected for decoders): a zero per round
            head = np.zeros_like(layer)
        costs.append(ShapeCost(cand, tuple(mine), tuple(map(float, layer)),
                               tuple(map(float, head))))
    return costs
