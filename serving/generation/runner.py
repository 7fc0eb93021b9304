"""A step's rows -> feeds (tuner.gate.decode_step, the code the gate's rollouts run) -> one
model run -> the logits of each row's last position and the presents."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from serving.generation.cache import Cache, CacheManager, DecodeBatch
from tuner.gate.decode_step import (empty_past, last_only, pad_rows, row_cache, seq_index,
                                    step_feeds)
from tuner.graph.cache_record import CacheRecord


PAD_SLACK = 1.125  # a prefill run's padded positions over its chunks' tokens, at most


@dataclass(frozen=True)
class RunResult:
    logits: np.ndarray  # (rows, vocab): each row's last position, padded columns cut off
    caches: tuple[Cache, ...]  # prefill runs: each row's own cache after the run
    seconds: float
    # prefill runs: per chunk, the logits (n, vocab) of each of its n tokens' positions where
    # the stream asked for its prompt's log-probs, else None
    chunk_logits: tuple[np.ndarray | None, ...] = ()


class StepRunner:
    """Runs decode batches and prefill chunks on `runner` (anything with `infer(feeds)`)."""

    def __init__(self, runner, record: CacheRecord, vocab: int,
                 on_run: Callable[[int, float], None] = lambda rows, seconds: None,
                 holes: bool | None = None) -> None:
        self.runner, self.record, self.vocab, self.on_run = runner, record, vocab, on_run
        self.presents = record.past_to_present
        # whether a chunk after a past may have masked slots before it (a run of longer
        # chunks): tuner.gate.row_moves.holes_stay, found by running; default: unless the
        # graph has a sliding window
        self.holes = record.window is None if holes is None else holes

    def _run(self, arrays, rows: int, into=None):
        began = time.perf_counter()
        out = self.runner.infer(arrays) if into is None else self.runner.infer_into(arrays, into)
        seconds = time.perf_counter() - began
        self.on_run(rows, seconds)
        return out, seconds

    def decode(self, cache: CacheManager, batch: DecodeBatch) -> RunResult:
        """One token for every stream in the batch (free rows are padding)."""
        rows = [[s.tokens[-1]] if s is not None else None for s in batch.slots]
        out, feeds, seconds = self._advance(cache, batch, rows)
        return RunResult(self._last_logits(out, feeds), (), seconds)

    def verify(self, cache: CacheManager, batch: DecodeBatch, stream,
               drafts: Sequence[int]) -> RunResult:
        """`decode`, with `stream` (the batch's one decoding row) fed its drafts after its
        last token (serving.generation.speculate). The logits are that row's at every fed
        position (1 + len(drafts), vocab): position j scores the token after draft j - 1
        (j = 0: after the last token). The row then holds an entry for every fed token;
        CacheManager.rewind drops those of drafts that were not accepted."""
        rows: list = [None] * len(batch.slots)
        rows[stream.slot] = [stream.tokens[-1], *drafts]
        out, feeds, seconds = self._advance(cache, batch, rows)
        # every position: logits_to_keep, where the graph takes it, is left at its default 0
        logits = out[self.record.logits]  # (B, S, vocab); the row's tokens fill its S slots
        return RunResult(logits[stream.slot, :feeds.seq, : self.vocab], (), seconds)

    def _advance(self, cache: CacheManager, batch: DecodeBatch, rows):
        """One run of the decode batch, `rows` its rows' new tokens (None: a free row): the
        batch's past becomes the step's present, as it is, or (shared buffers) the graph
        writes the new entries into the batch's buffers. (outputs, feeds, seconds)."""
        real = sum(r is not None for r in rows)
        feeds = step_feeds(self.record, rows, batch.mask, batch.arrays)
        if batch.capacity is None:
            out, seconds = self._run(feeds.arrays, real)
            cache.advance(batch, feeds.mask, {p: out[q] for p, q in self.presents.items()})
        elif getattr(self.runner, "writes_into", False):
            into = {q: batch.arrays[p] for p, q in self.presents.items()}
            out, seconds = self._run(feeds.arrays, real, into)
            cache.advance(batch, feeds.mask, None)
        else:  # a runner without IO binding: the past cut to its length, the present copied in
            out, seconds = self._run(self._cut(feeds.arrays, batch.past), real)
            span = seq_index(self.record, slice(None), slice(0, batch.past + feeds.seq))
            for p, q in self.presents.items():
                batch.arrays[p][span] = out[q]
            cache.advance(batch, feeds.mask, None)
        return out, feeds, seconds

    def _cut(self, arrays, past: int) -> dict:
        span = seq_index(self.record, slice(None), slice(0, past))
        return {n: (a[span] if n in self.presents else a) for n, a in arrays.items()}

    def _last_logits(self, out, feeds, rows: int | None = None) -> np.ndarray:
        """(rows, vocab): the first `rows` rows' (default all) last positions' logits."""
        logits = out[self.record.logits]  # (B, S or kept, vocab)
        if feeds.seq == 1:
            return logits[:rows, 0, : self.vocab]  # (B, vocab)
        slots = feeds.logit_slots[:rows]  # bucket padding rows may lie outside a cut's logits
        return logits[np.arange(len(slots)), slots, : self.vocab]  # (rows, vocab)

    def prefill(self, cache: CacheManager, chunks: Sequence[tuple[object, int]]) -> RunResult:
        """Each (stream, n) feeds its next n uncomputed tokens against its own cache (empty,
        a prefix hit, or its earlier chunks), in as few runs as the graph takes (`_groups`);
        the results come back in the order of `chunks`."""
        groups = self._groups(chunks)
        if len(groups) == 1:
            return self._prefill(cache, chunks)
        parts = [self._prefill(cache, g) for g in groups]
        order = [c for g in groups for c in g]
        index = [order.index(c) for c in chunks]  # each chunk's row among the parts'
        logits = np.concatenate([p.logits for p in parts])[index]
        caches = [c for p in parts for c in p.caches]
        chunk_logits = [c for p in parts for c in p.chunk_logits]
        return RunResult(logits, tuple(caches[i] for i in index), sum(p.seconds for p in parts),
                         tuple(chunk_logits[i] for i in index))

    def _groups(self, chunks: Sequence[tuple[object, int]]) -> list[list[tuple[object, int]]]:
        """The runs that feed `chunks`. GroupQueryAttention's graphs run seq > 1 beside a
        past at batch 1 only: there each chunk after a past runs alone. The others share
        runs with chunks of like length: a run is padded to its longest chunk, and a
        prompt's tokens are compute-bound, so padding costs what as many prompt tokens
        cost; a chunk joins a run while the padding stays within PAD_SLACK of the run's
        tokens (past that, another run's fixed cost, about one decode run, is cheaper:
        prompts of 157, 84 and 15 tokens in one run cost 728 ms, 1.8x their tokens').
        Where masked slots before a chunk change its logits (`holes` False: a sliding window
        counts them, ALiBi biases by slot), a chunk after a past shares a run only with
        chunks as long as it: a shorter one would have masked slots between its cache and
        its tokens."""
        if len(chunks) == 1 or all(n == 1 for _, n in chunks):
            return [list(chunks)]
        alone = self.record.rows_at_start
        groups: list[list[tuple[object, int]]] = []
        for c in sorted((c for c in chunks if not (alone and c[0].computed)), key=lambda c: -c[1]):
            g = groups[-1] if groups else None
            # a chunk after a past, shorter than the run's longest: masked slots before it
            hole = g is not None and not self.holes and c[0].computed > 0 and c[1] < g[0][1]
            if g is not None and not hole and (len(g) + 1) * g[0][1] <= PAD_SLACK * (
                    sum(n for _, n in g) + c[1]):
                g.append(c)
            else:
                groups.append([c])
        return groups + [[c] for c in chunks if alone and c[0].computed]

    def _prefill(self, cache: CacheManager, chunks: Sequence[tuple[object, int]]) -> RunResult:
        streams = [s for s, _ in chunks]
        rows = [s.tokens[s.computed:s.computed + n] for s, n in chunks]
        longest = max(s.computed for s in streams)
        batch, past = cache.padded(len(streams), longest)
        if longest:
            arrays, mask = pad_rows(self.record, [cache.own(s) for s in streams], batch, past)
        else:
            arrays, mask = empty_past(self.record, batch)
        feeds = step_feeds(self.record, rows, mask, arrays)
        if all(s.request.prompt_logprobs is None for s in streams):
            feeds = last_only(feeds, len(streams))  # the head on each row's last token
        out, seconds = self._run(feeds.arrays, len(streams))
        presents = {p: out[q] for p, q in self.presents.items()}
        caches = tuple(row_cache(self.record, presents, feeds.mask[i], i)
                       for i in range(len(streams)))
        return RunResult(self._last_logits(out, feeds, len(streams)), caches, seconds,
                         self._chunk_logits(out, feeds, chunks))

    def _chunk_logits(self, out, feeds, chunks) -> tuple[np.ndarray | None, ...]:
        """Row i's chunk of n tokens sits at slots last_i - n + 1 .. last_i (rows at the start
        or right-aligned alike). Views: the run's logits live as long as they do."""
        logits, last = out[self.record.logits], feeds.last  # (B, S, vocab), (B,)
        return tuple(
            logits[i, last[i] - n + 1:last[i] + 1, : self.vocab]  # (n, vocab)
            if s.request.prompt_logprobs is not None else None
            for i, (s, n) in enumerate(chunks))
