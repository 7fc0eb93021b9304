"""A step's rows -> feeds (tuner.gate.decode_step, the code the gate's rollouts run) -> one
model run -> the logits of each row's last position and the presents."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from serving.generation.cache import Cache, CacheManager, DecodeBatch
from tuner.gate.decode_step import empty_past, left_pad, row_cache, step_feeds
from tuner.graph.cache_record import CacheRecord


@dataclass(frozen=True)
class RunResult:
    logits: np.ndarray  # (rows, vocab): each row's last position, padded columns cut off
    caches: tuple[Cache, ...]  # prefill runs: each row's own cache after the run
    seconds: float


class StepRunner:
    """Runs decode batches and prefill chunks on `runner` (anything with `infer(feeds)`)."""

    def __init__(self, runner, record: CacheRecord, vocab: int,
                 on_run: Callable[[int, float], None] = lambda rows, seconds: None) -> None:
        self.runner, self.record, self.vocab, self.on_run = runner, record, vocab, on_run
        self.presents = record.past_to_present

    def _run(self, feeds, rows: int):
        began = time.perf_counter()
        out = self.runner.infer(feeds.arrays)
        seconds = time.perf_counter() - began
        self.on_run(rows, seconds)
        return out, seconds

    def decode(self, cache: CacheManager, batch: DecodeBatch) -> RunResult:
        """One token for every stream in the batch (free rows are padding); the batch's
        past becomes this step's present, as it is."""
        rows = [[s.tokens[-1]] if s is not None else None for s in batch.slots]
        feeds = step_feeds(self.record, rows, batch.mask, batch.arrays)
        out, seconds = self._run(feeds, sum(r is not None for r in rows))
        cache.advance(batch, feeds.mask, {p: out[q] for p, q in self.presents.items()})
        logits = out[self.record.logits][:, -1, : self.vocab]  # (B, vocab)
        return RunResult(logits, (), seconds)

    def prefill(self, cache: CacheManager, chunks: Sequence[tuple[object, int]]) -> RunResult:
        """Each (stream, n) feeds its next n uncomputed tokens against its own cache (empty,
        a prefix hit, or its earlier chunks), all in one batch."""
        streams = [s for s, _ in chunks]
        rows = [s.tokens[s.computed:s.computed + n] for s, n in chunks]
        longest = max(s.computed for s in streams)
        batch, past = cache.padded(len(streams), longest)
        if longest:
            arrays, mask = left_pad(self.record, [cache.own(s) for s in streams], batch, past)
        else:
            arrays, mask = empty_past(self.record, batch)
        feeds = step_feeds(self.record, rows, mask, arrays)
        out, seconds = self._run(feeds, len(streams))
        presents = {p: out[q] for p, q in self.presents.items()}
        caches = tuple(row_cache(self.record, presents, feeds.mask[i], i)
                       for i in range(len(streams)))
        logits = out[self.record.logits][: len(streams), -1, : self.vocab]  # (rows, vocab)
        return RunResult(logits, caches, seconds)
