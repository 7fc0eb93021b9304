"""What `tuner optimize` measures a model on, by workload: one small interface that the
pipeline (tuner.jobs.pipeline) calls without asking which kind of model it holds.

- `PlainWorkload`: one forward pass per request, b x s (an encoder, or a decoder exported
  without its cache);
- `DecoderWorkload` (tuner.jobs.decoder): a decoder exported with its KV cache, measured in
  two phases, prefill and decode, weighed by tokens.

A workload gives the traffic (requests, sequence grid, batch buckets), the phases (where
variants are compared, the feeds, the grid the winner is timed on, where the latencies go
in the manifest), the selection rule (a speedup per variant from the phases' timings), the
runners' wrapping (a widened cache is fed wider pasts) and its parts of the manifest and
the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from tuner.artifact.records import Manifest, shape_key
from tuner.errors import BadInput
from tuner.gate.feeds import make_feeds
from tuner.graph.role_names import ENCODER_ROLES
from tuner.graph.roles import InputSpec, batch_limit, seq_limit
from tuner.measure.bench import Measurements, Target
from tuner.measure.buckets import (Requests, batch_buckets, fit_bucket, default_seq_buckets,
                                   load_requests, seq_grid, uniform_requests)
from tuner.measure.stats import RatioCI

Shape = tuple[int, int]
DEFAULT_MAX_SEQ = 256  # without a requests file or --max-seq, and no position table found


@dataclass(frozen=True)
class Traffic:
    """The requests the buckets are chosen for, the sequence grid and the batch buckets."""

    requests: Requests
    seq_grid: tuple[int, ...]
    batch: tuple[int, ...]
    note: str | None = None


@dataclass(frozen=True)
class Phase:
    """One kind of call the workload makes. Variants are compared at `compare_at`; the winner
    is timed on batch buckets x `grid`, whose lengths are chosen for `requests`."""

    name: str  # "forward", "prefill", "decode"
    compare_at: tuple[Shape, ...]
    requests: Requests
    grid: tuple[int, ...]  # sequence lengths (or cache lengths) of the bucket grid
    feeds: Callable[[Shape], Mapping[str, np.ndarray]]
    key: Callable[[int, int], str] = shape_key  # a shape's key in the manifest's latency map
    latency_field: str = "latency"  # the Variant field its latencies go to
    bucket_field: str = "seq"  # the Buckets field its chosen lengths go to
    settings: Mapping[str, Any] = field(default_factory=dict)  # extra results-cache key parts


class Workload(Protocol):
    """The interface the pipeline uses; the first phase is the one whose shapes the
    per-shape speedups and the sequence buckets come from."""

    traffic: Traffic
    # whether the server generates from the selected graph, reading each step's last logits
    # alone (then the pipeline cuts its LM head to them: tuner.jobs.variants.build_kept)
    generates: bool

    def phases(self, selection: Sequence[Shape]) -> tuple[Phase, ...]: ...

    def wrap(self, targets: list[Target], paths: Mapping[str, Any]) -> list[Target]: ...

    def speedups(self, measured: Mapping[str, Measurements], names: Sequence[str],
                 phases: Sequence[Phase]) -> dict[str, RatioCI]: ...

    def manifest_parts(self, selected_path, selected: str, policy: str,
                       phases: Sequence[Phase]) -> dict[str, Any]: ...

    def phase_rows(self, manifest: Manifest) -> list | None: ...

    def report_section(self, manifest: Manifest) -> str: ...


def memo(make: Callable[[Shape], Mapping[str, np.ndarray]]) -> Callable[[Shape], Mapping]:
    """Feeds made once per shape: the same objects come back (a widened runner's scatter and
    a backend's binding are keyed on them)."""
    made: dict[Shape, Mapping[str, np.ndarray]] = {}

    def feeds(s: Shape) -> Mapping[str, np.ndarray]:
        if s not in made:
            made[s] = make(s)
        return made[s]
    return feeds


def selection_shapes(req: Requests, grid: Sequence[int], batch: Sequence[int]) -> list[Shape]:
    """Where variants are compared: the most common batch bucket at the bucket of the median
    length (one shape keeps a 12-layer model's comparison within a minute on 2 cores; the
    winner is then timed on the whole bucket grid)."""
    by_batch: dict[int, float] = {}
    for (b, _), w in req.weights.items():
        bb = fit_bucket(b, batch)
        by_batch[bb] = by_batch.get(bb, 0.0) + w
    b = max(by_batch, key=by_batch.get)
    seqs = sorted({fit_bucket(req.seq_quantile(q), grid) for q in (0.5,)})
    return [(b, s) for s in seqs]


# ---------------------------------------------------------------------------------------------
# The plain workload


def _traffic_wanted(cfg, positions: int | None) -> Traffic:
    if cfg.requests is not None:
        req = load_requests(cfg.requests)
        limit = cfg.max_seq or positions
        return Traffic(req, seq_grid(req, limit), batch_buckets(max(req.max_batch, 1)))
    note = None
    if cfg.max_seq:
        top = cfg.max_seq
        if positions and top > positions:
            raise BadInput(f"--max-seq {top} is longer than the model's {positions} positions")
    elif positions:
        top = min(positions, 512)
        if positions > 512:
            note = f"sequence buckets capped at 512 of the model's {positions} positions (--max-seq)"
    else:
        top = DEFAULT_MAX_SEQ
        note = f"no position table found: sequence buckets up to {top} (--max-seq to change)"
    grid = default_seq_buckets(top)
    if len(grid) > 8:
        grid = tuple(grid[i] for i in sorted({round(k * (len(grid) - 1) / 7) for k in range(8)}))
    return Traffic(uniform_requests(top), grid, batch_buckets(cfg.max_batch), note)


def plain_traffic(cfg, positions: int | None, specs: Sequence[InputSpec] = ()) -> Traffic:
    """The traffic of `cfg` (its requests file, or uniform lengths), limited to the shapes the
    model takes: a batch-1 export gets batch bucket [1], a fully static one its one length."""
    t = _traffic_wanted(cfg, positions)
    req, grid, batch = t.requests, t.seq_grid, t.batch
    b_fix, s_fix = batch_limit(specs), seq_limit(specs)
    notes = [t.note] if t.note else []
    if any(s.role in ENCODER_ROLES for s in specs):
        notes.append("an encoder-decoder's decoder: measured and served as a tensor model, "
                     "one forward pass at the buckets' shapes (the encoder's inputs as long "
                     "as the gate feeds them); its generation loop is the client's")
    if b_fix is not None:
        if tuple(batch) != (b_fix,):
            notes.append(f"the model takes batch {b_fix} only: batch buckets [{b_fix}]")
        batch = (b_fix,)
    if s_fix is not None:
        if tuple(grid) != (s_fix,):
            notes.append(f"the model takes sequence length {s_fix} only: sequence buckets "
                         f"[{s_fix}]")
        grid = (s_fix,)
    if b_fix is not None or s_fix is not None:
        weights: dict = {}
        for (b, s), w in req.weights.items():
            shape = (b_fix or b, s_fix or s)
            weights[shape] = weights.get(shape, 0.0) + w
        req = replace(req, weights=weights)
    return Traffic(req, tuple(grid), tuple(batch), "; ".join(notes) or None)


class PlainWorkload:
    """One forward pass per request; variants compared on the expected time per request."""

    generates = False  # a client reads every output the graph returns

    def __init__(self, cfg, specs: Sequence[InputSpec], vocab: int, positions: int | None):
        self.specs, self.vocab = list(specs), vocab
        self.traffic = plain_traffic(cfg, positions, specs)

    def phases(self, selection: Sequence[Shape]) -> tuple[Phase, ...]:
        t = self.traffic
        feeds = memo(lambda s: make_feeds(self.specs, self.vocab, [s], seed=1)[0])
        return (Phase("forward", tuple(selection), t.requests, t.seq_grid, feeds),)

    def wrap(self, targets: list[Target], paths: Mapping[str, Any]) -> list[Target]:
        return targets

    def speedups(self, measured: Mapping[str, Measurements], names: Sequence[str],
                 phases: Sequence[Phase]) -> dict[str, RatioCI]:
        forward = phases[0]
        weights = {s: 1.0 for s in forward.compare_at}
        return {n: measured[forward.name].speedup(n, weights) for n in names if n != "original"}

    def manifest_parts(self, selected_path, selected: str, policy: str,
                       phases: Sequence[Phase]) -> dict[str, Any]:
        return {"cache": None, "phases": None}

    def phase_rows(self, manifest: Manifest) -> list | None:
        return None

    def report_section(self, manifest: Manifest) -> str:
        return ""
