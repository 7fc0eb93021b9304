"""optimize's plan stage: the candidates (tuner.plan.propose), ranked by the GEMM probe
through the results cache, pruned to the variant budget, with their fused forms; and the
retrain advice (`--advise`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tuner.artifact.records import Advice, Speedup
from tuner.measure.cache import ResultsCache, entry_key
from tuner.plan import propose as plan
from tuner.plan.advise import measure_advice
from tuner.plan.probe import backend_unavailable, probe
from tuner.plan.propose import Candidate

Say = Callable[[str], None]


@dataclass(frozen=True)
class Probe:
    """How the plan stage times GEMMs: the probe backend, its dtype and threads."""

    backend: str  # "ort-cpu" or "torch-cuda"
    dtype: str
    threads: int


@dataclass(frozen=True)
class Planned:
    kept: tuple[Candidate, ...]  # "original" first, then the padded candidates to build
    fused: tuple[Candidate, ...]  # each with its `base`, the variant it fuses
    advice: tuple[Advice, ...]
    notes: tuple[str, ...]


def probe_backend(backend_name: str) -> str:
    """torch-cuda when the variants are timed on a GPU backend and torch sees the GPU."""
    if backend_name != "ort-cpu" and backend_unavailable("torch-cuda") is None:
        return "torch-cuda"
    return "ort-cpu"


def probe_dtype(precision: str) -> str:
    """The GEMM probe's dtype for a backend of `precision`: fp32 backends are ranked on fp32
    timings, never on fp16 ones (which tensor cores make a different story)."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(precision, "fp32")


def speed(ci) -> Speedup:
    return Speedup(ci.ratio, ci.low, ci.high, ci.confidence)


def _cached_probe(cache: ResultsCache, key_parts, threads: int, backend: str = "ort-cpu",
                  dtype: str = "fp32"):
    """The GEMM probe through the results cache: a rerun plans the same candidates (and so
    finds its variants' timings in the cache) instead of re-probing into other noise."""
    rounds = 5

    def fn(gemms):
        key = entry_key(*key_parts, (0, 0), {"probe": [g.describe() + g.label for g in gemms],
                                              "threads": threads, "samples": "per-round",
                                              "dtype": dtype},
                        rounds, 1)
        hit = cache.get(key)
        if hit is not None and len(hit.samples_ms) == len(gemms) * rounds:
            flat = list(hit.samples_ms)
        else:  # per-round samples, so predictions carry their own noise (plan.predict)
            results = probe(gemms, backend, rounds=rounds, warmup=1, threads=threads,
                            dtype=dtype)
            flat = [t for r in results for t in r.samples_ms]
            cache.put_group({key: tuple(flat)}, "probe")
        return [flat[i * rounds:(i + 1) * rounds] for i in range(len(gemms))]
    return fn


def plan_variants(cfg, shape, facts, sel_shape: tuple[int, int], how: Probe,
                  results: ResultsCache, key_parts: tuple, say: Say) -> Planned:
    """The candidates to build: ranked by the probe (unless --no-probe), pruned to
    --max-variants, the best one or two also fused; and the advice when asked."""
    cands = plan.propose(shape, facts)
    notes: list[str] = []
    if len(cands) > 1 and cfg.probe:
        say(f"probing {len(cands) - 1} candidate dims with the model's GEMMs at "
            f"M = {sel_shape[0]}x{sel_shape[1]}")
        probe_fn = _cached_probe(results, key_parts, how.threads, how.backend, how.dtype)
        cands = plan.predict(shape, cands, sel_shape[0], sel_shape[1], probe_fn)
    elif len(cands) > 1:
        notes.append("GEMM probe skipped (--no-probe): candidates kept unranked")
    pad_room = cfg.max_variants - (2 if cfg.fuse and cfg.max_variants >= 3 else 1)
    kept, dropped = plan.prune(cands, pad_room + 1)
    notes += dropped
    fused = []
    if cfg.fuse and cfg.max_variants >= 2:
        fused.append(plan.with_fusion(kept[0]))
        if len(kept) > 1 and len(kept) + 2 <= cfg.max_variants:
            fused.append(plan.with_fusion(kept[1]))
    advice = _advise(cfg, shape, sel_shape, how, say) if cfg.advise else ()
    return Planned(tuple(kept), tuple(fused), advice, tuple(notes))


def _advise(cfg, shape, sel_shape, how: Probe, say: Say) -> tuple[Advice, ...]:
    say("measuring retrain advice (non-exact reshapes, GEMM level, random weights)")
    found = measure_advice(shape, sel_shape[0], sel_shape[1],
                           lambda g, rounds: probe(g, how.backend, rounds=rounds, warmup=1,
                                                   threads=how.threads, dtype=how.dtype),
                           rounds=cfg.rounds)
    return tuple(Advice(a.name, a.transforms, speed(a.speedup), a.note) for a in found)
