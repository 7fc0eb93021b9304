"""Batch and sequence buckets from a request distribution.

A server pads each request up to the nearest bucket (and masks the padding), so one bucket
set trades padding waste (a 70-token request run at 128) against the cost of many buckets
(an engine or optimisation profile each on TensorRT, warm-up and memory everywhere). Given
latencies measured at a grid of candidate shapes, `choose` finds the sequence buckets that
minimise the expected latency per request (dynamic programming over the sorted grid), then
keeps the fewest buckets within `tolerance` of that optimum.

Request files (`--requests`):
- JSONL: one {"batch": 2, "seq": 17} object per line (batch defaults to 1);
- CSV with a header naming `seq` (and optionally `batch`) columns;
- JSON histogram: {"seq": {"17": 120, "64": 30}} (batch 1), optionally with
  {"batch": {"1": 9, "4": 1}} taken as independent of length.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from tuner.errors import BadInput

Shape = tuple[int, int]
MAX_FILE_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class Requests:
    """Traffic as weights per (batch, seq); weights need not sum to 1."""

    weights: Mapping[Shape, float]
    source: str
    count: int  # requests in the file (histogram: the sum of its counts)

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("no requests")
        for (b, s), w in self.weights.items():
            if b < 1 or s < 1 or not w > 0:
                raise ValueError(f"bad request entry batch={b} seq={s} weight={w}")

    @property
    def max_batch(self) -> int:
        return max(b for b, _ in self.weights)

    @property
    def max_seq(self) -> int:
        return max(s for _, s in self.weights)

    def seq_quantile(self, q: float) -> int:
        seqs = sorted({s for _, s in self.weights})
        w = np.array([sum(v for (_, s2), v in self.weights.items() if s2 == s) for s in seqs])
        c = np.cumsum(w) / w.sum()
        return seqs[int(np.searchsorted(c, q))]


def _positive_int(v: object, what: str, where: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise BadInput(f"{where}: {what} must be a positive integer, not {v!r}")
    try:
        n = int(v)
    except ValueError:
        raise BadInput(f"{where}: {what} must be a positive integer, not {v!r}") from None
    if n < 1:
        raise BadInput(f"{where}: {what} must be a positive integer, not {v!r}")
    return n


def _add(acc: dict[Shape, float], b: int, s: int, w: float = 1.0) -> None:
    acc[(b, s)] = acc.get((b, s), 0.0) + w


def _from_jsonl(text: str, name: str) -> dict[Shape, float]:
    acc: dict[Shape, float] = {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{name} line {i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{where}: not JSON ({e.msg})") from None
        except RecursionError:
            raise BadInput(f"{where}: JSON nested too deeply to read") from None
        if not isinstance(obj, dict) or "seq" not in obj:
            raise BadInput(f'{where}: expected an object like {{"batch": 1, "seq": 17}}')
        _add(acc, _positive_int(obj.get("batch", 1), "batch", where),
             _positive_int(obj["seq"], "seq", where))
    return acc


def _from_csv(text: str, name: str) -> dict[Shape, float]:
    rows = csv.DictReader(io.StringIO(text))
    fields = [f.strip() for f in rows.fieldnames or []]
    if "seq" not in fields:
        raise BadInput(f"{name}: a CSV of requests needs a header with a 'seq' column "
                       f"(and optionally 'batch'); found {fields}")
    acc: dict[Shape, float] = {}
    for i, row in enumerate(rows, 2):
        row = {k.strip(): v for k, v in row.items() if k is not None}
        where = f"{name} line {i}"
        _add(acc, _positive_int((row.get("batch") or "1").strip(), "batch", where),
             _positive_int((row.get("seq") or "").strip(), "seq", where))
    return acc


def _histogram(obj: object, key: str, name: str) -> dict[int, float]:
    if not isinstance(obj, dict) or not obj:
        raise BadInput(f'{name}: "{key}" must be a non-empty object of length -> count')
    out = {}
    for k, v in obj.items():
        n = _positive_int(k, key, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or math.isinf(v):
            raise BadInput(f"{name}: count for {key} {k} must be a number >= 0, not {v!r}")
        if v > 0:
            out[n] = float(v)
    if not out:
        raise BadInput(f'{name}: "{key}" has no positive counts')
    return out


def _from_histogram(obj: dict, name: str) -> tuple[dict[Shape, float], int]:
    seq = _histogram(obj.get("seq"), "seq", name)
    batch = _histogram(obj["batch"], "batch", name) if "batch" in obj else {1: 1.0}
    bt = sum(batch.values())
    acc = {(b, s): ws * wb / bt for s, ws in seq.items() for b, wb in batch.items()}
    return acc, int(round(sum(seq.values())))


def _from_json(text: str, name: str) -> tuple[dict[Shape, float], int | None]:
    """A histogram object, or JSONL in a file named .json (one object per line)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return _from_jsonl(text, name), None  # several lines, each its own object
    except RecursionError:
        raise BadInput(f"{name}: JSON nested too deeply to read") from None
    if isinstance(obj, dict) and isinstance(obj.get("seq"), dict):
        return _from_histogram(obj, name)
    if isinstance(obj, dict):
        return _from_jsonl(text, name), None  # a single {"batch": .., "seq": ..} request
    raise BadInput(f'{name}: expected a histogram {{"seq": {{"17": 120}}}} or one '
                   f'{{"batch": 1, "seq": 17}} object per line, not a JSON {type(obj).__name__}')


def load_requests(path: str | os.PathLike) -> Requests:
    """Read a request file (JSONL, CSV or JSON histogram; see the module doc)."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such requests file")
    if p.stat().st_size > MAX_FILE_BYTES:
        raise BadInput(f"{p}: requests file larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise BadInput(f"{p}: requests file is not UTF-8 text") from None
    stripped = text.strip()
    if not stripped:
        raise BadInput(f"{p}: no requests in the file (it is empty)")
    count = None
    suffix = p.suffix.lower()
    # the suffix decides when it names a format, so that an empty or odd .jsonl is not
    # reported as a CSV without a header; otherwise the first character does
    if suffix in (".jsonl", ".ndjson"):
        acc = _from_jsonl(text, p.name)
    elif suffix == ".json" or stripped[0] in "{[":
        acc, count = _from_json(text, p.name)
    else:
        acc = _from_csv(text, p.name)
    if not acc:
        raise BadInput(f"{p}: no requests in the file")
    return Requests(acc, str(p), count if count is not None else int(sum(acc.values())))


def uniform_requests(max_seq: int, batch: int = 1) -> Requests:
    """The assumption without a file: lengths 1..max_seq equally likely, at batch 1."""
    return Requests({(batch, s): 1.0 for s in range(1, max_seq + 1)}, "default (uniform lengths)", 0)


# ---------------------------------------------------------------------------------------------
# Candidate grids


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to the first one >= max_batch."""
    out, b = [1], 1
    while b < max_batch:
        b *= 2
        out.append(b)
    return tuple(out)


def default_seq_buckets(max_seq: int, step: int = 64) -> tuple[int, ...]:
    """Multiples of `step` up to max_seq (max_seq itself included); short models get powers
    of two instead."""
    if max_seq <= step:
        return tuple(sorted({min(2 ** i, max_seq) for i in range(3, 31) if 2 ** (i - 1) < max_seq}))
    out = list(range(step, max_seq + 1, step))
    if out[-1] != max_seq:
        out.append(max_seq)
    return tuple(out)


def seq_grid(req: Requests, limit: int | None, max_points: int = 8) -> tuple[int, ...]:
    """Candidate sequence buckets for a distribution: multiples of 64, powers of two from 8,
    and quantiles of the lengths rounded up to 8, all up to the longest request (rounded up to
    8, but not past `limit`, the model's maximum). At most `max_points`, always the top."""
    top = req.max_seq
    if limit is not None and top > limit:
        raise BadInput(f"{req.source}: a request has seq {top}, longer than the model's "
                       f"maximum {limit} (its position table, or --max-seq)")
    cap = min(-(-top // 8) * 8, limit) if limit else -(-top // 8) * 8
    points = {cap}
    points |= {x for x in range(64, cap, 64)}
    points |= {2 ** i for i in range(3, 31) if 2 ** i < cap}
    points |= {min(cap, -(-req.seq_quantile(q) // 8) * 8) for q in (0.25, 0.5, 0.75, 0.9)}
    grid = sorted(points)
    if len(grid) > max_points:
        keep = np.unique(np.round(np.linspace(0, len(grid) - 1, max_points)).astype(int))
        grid = [grid[i] for i in keep]
    return tuple(grid)


# ---------------------------------------------------------------------------------------------
# Choice


@dataclass(frozen=True)
class BucketChoice:
    batch: tuple[int, ...]
    seq: tuple[int, ...]
    expected_ms: float  # per request, with these buckets
    pad_to_max_ms: float  # every request padded to the longest bucket
    no_buckets_ms: float  # every request at its own shape (interpolated between grid points)
    coverage: Mapping[int, float]  # seq bucket -> share of requests it serves


class BeyondBuckets(ValueError):
    """A length (or batch) past the largest bucket: it fits none."""


def fit_bucket(n: int, buckets: Sequence[int]) -> int:
    """The bucket a length (or batch) of `n` runs at: the smallest bucket >= n, `buckets`
    ascending. The one rule for optimize (which buckets serve which requests), the server's
    batcher and generation. Past the largest bucket nothing fits, and the answer is always
    the same: BeyondBuckets (a ValueError) naming both; the caller refuses the request
    (the server with INVALID_ARGUMENT). No rounding up to an untimed shape: the buckets are
    the shapes the artifact measured."""
    for b in buckets:
        if b >= n:
            return int(b)
    raise BeyondBuckets(f"{n} is beyond the largest bucket {buckets[-1] if buckets else '(none)'}")


def interpolate(lat: Mapping[Shape, float], b: int, s: int) -> float:
    """Latency at (b, s) by linear interpolation between measured grid points (clamped at the
    grid's ends): what a request would cost run at its own shape."""
    batches = sorted({x for x, _ in lat})

    def at_batch(bb: int) -> float:
        seqs = sorted(x for y, x in lat if y == bb)
        return float(np.interp(s, seqs, [lat[(bb, x)] for x in seqs]))

    if b in batches:
        return at_batch(b)
    return float(np.interp(b, batches, [at_batch(x) for x in batches]))


def choose(req: Requests, latency: Callable[[int, int], float] | Mapping[Shape, float],
           batch: Sequence[int], grid: Sequence[int], max_buckets: int = 4,
           tolerance: float = 0.02) -> BucketChoice:
    """The sequence buckets (a subset of `grid` covering the longest request) minimising the
    expected latency per request, `latency[(batch_bucket, seq_bucket)]` in ms; then the fewest
    buckets within `tolerance` of that minimum. Batch buckets are `batch` as given."""
    lat = latency if isinstance(latency, Mapping) else {(b, s): latency(b, s) for b in batch for s in grid}
    grid = sorted(grid)
    batch = sorted(batch)
    if req.max_seq > grid[-1] or req.max_batch > batch[-1]:
        raise ValueError("the grid must cover the longest request and the largest batch")
    total = sum(req.weights.values())
    items = [(fit_bucket(b, batch), s, w / total) for (b, s), w in req.weights.items()]
    n = len(grid)
    # seg[i][j]: cost of the requests with grid[i-1] < seq <= grid[j] served at grid[j]
    # (i == 0: from 0); best[m][j]: least cost covering seq <= grid[j] with m buckets, top grid[j].
    lo = [0] + list(grid)
    seg = [[sum(w * lat[(bb, grid[j])] for bb, s, w in items if lo[i] < s <= grid[j])
            for j in range(n)] for i in range(n)]
    inf = float("inf")
    best = [[inf] * n for _ in range(max_buckets + 1)]
    back = [[-1] * n for _ in range(max_buckets + 1)]
    for j in range(n):
        best[1][j] = seg[0][j]
    for m in range(2, max_buckets + 1):
        for j in range(n):
            for i in range(j):
                c = best[m - 1][i] + seg[i + 1][j]
                if c < best[m][j]:
                    best[m][j], back[m][j] = c, i
    ends = [j for j in range(n) if grid[j] >= req.max_seq]
    optimum = min(best[m][j] for m in range(1, max_buckets + 1) for j in ends)
    m, j = min(((m, j) for m in range(1, max_buckets + 1) for j in ends
                if best[m][j] <= optimum * (1 + tolerance)), key=lambda mj: (mj[0], best[mj[0]][mj[1]]))
    expected = best[m][j]
    chosen = []
    while j >= 0 and m >= 1:
        chosen.append(grid[j])
        j, m = back[m][j], m - 1
    seqs = tuple(sorted(chosen))
    cover: dict[int, float] = {s: 0.0 for s in seqs}
    for _, s, w in items:
        cover[fit_bucket(s, seqs)] += w
    # Batch buckets stay as given: beyond the clients' own batches, the server's batcher joins
    # requests into them.
    return BucketChoice(
        batch=tuple(batch), seq=seqs, expected_ms=float(expected),
        pad_to_max_ms=float(sum(w * lat[(bb, grid[-1])] for bb, _, w in items)),
        no_buckets_ms=float(sum(w * interpolate(lat, b, s)
                                for (b, s), w in ((k, v / total) for k, v in req.weights.items()))),
        coverage=cover)
