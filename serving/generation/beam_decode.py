"""Beam search on a decoder with its KV cache (TensorRT-LLM's `beam_width`, our `beams`), as
transformers' generate searches (serving/generation/beams.py holds the search itself), with
the request's length penalty and early stopping where it names them, else the model's (its
generation config's, serving.text_config), else transformers' defaults (1.0, False).

A searched request runs beside the in-flight batch, not in it: its k beams are rows of one
search that are reordered every step (a beam that continues another takes that row's cache),
which the batch's rows, written in place, never are. So each search is a batch of its own:

    step 1: the prompt at batch 1, empty past        -> logits (1, V), present (1, .., P, ..)
    then:   the k beams' last tokens, their caches  -> logits (k, V), present (k, .., P+1, ..)
    after each: BeamSearch.step picks the rows that go on; the present's rows are gathered so

Searches take one step per engine iteration, between the batch's steps: every running
search's beams in one run (rows of one batch of their own, where the graph's rows may move;
else one search at a time), then a new search's prompt in a run of its own, after which its
beams join that batch. Their caches are their own: a search's k rows of prompt + max_tokens
entries, which admission holds to the byte budget by itself, and the running searches' rows,
each as long as the longest of them, to it together. The answer goes out when the search
ends, token by token: a beam's tokens are not final until then. A request for more than one
of the best sequences (`returns`) gets them all in one final chunk
(serving.generation.output's `answer`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from serving.generation.beams import (BeamConfig, BeamSearch, config_for, log_softmax,
                                      searchable, unsearchable)
from tuner.gate.decode_step import empty_past, last_only, lazy_zeros, seq_index, step_feeds
from tuner.graph.cache_record import CacheRecord

MAX_BEAMS = 16  # the widest search a request may ask for


def refusal(request, record: CacheRecord, budget_tokens: int) -> str | None:
    """Why a decoder cannot search `request` with its beams, or None (one beam: no search)."""
    k = request.beams or 1
    if k == 1:
        return None
    if k > MAX_BEAMS:
        return f"beam_width {k} is not supported: 1 to {MAX_BEAMS}"
    if not searchable(request):
        return unsearchable(k)
    if record.batch is not None:
        return f"this graph's batch is fixed to {record.batch}: no beam search"
    entries = k * (len(request.prompt) + request.max_tokens)
    if entries > budget_tokens:
        return (f"{k} beams of prompt ({len(request.prompt)}) + max_tokens "
                f"({request.max_tokens}) cache entries exceed the cache's byte budget "
                f"({budget_tokens} entries); raise --kv-cache-bytes")
    return None


class BeamRun:
    """One stream's search: its beams' next tokens between steps (their caches are rows of
    BeamRuns' batch)."""

    def __init__(self, stream, model: BeamConfig) -> None:
        r = stream.request
        self.stream = stream
        self.search = BeamSearch(config_for(r, model, r.beams), frozenset(r.stop_ids),
                                 r.max_tokens)
        self.rows: list[list[int]] = [list(r.prompt)]  # each row's new tokens, next step

    def take(self, logits: np.ndarray) -> list[int] | None:
        """One search step from its rows' `logits` (k, V): the rows the next beams continue
        (their caches to gather), or None when the search is over (`search.top`)."""
        scores = log_softmax(logits)  # float32, as transformers scores beams
        request = self.stream.request
        if self.search.generated < request.min_tokens and request.stop_ids:
            scores[:, list(request.stop_ids)] = -np.inf  # no end before min_tokens
        chosen = self.search.step(scores)
        if self.search.done:
            return None
        self.rows = [[t] for t in self.search.next_tokens]
        return chosen


def _widen(record: CacheRecord, arrays: dict[str, np.ndarray], mask: np.ndarray, past: int
           ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Caches and mask widened to `past` slots: masked ones before the entries (after them,
    where the graph keeps a row's entries at the start), as a row joining a batch is."""
    extra = past - int(mask.shape[1])
    if extra == 0:
        return arrays, mask
    at = (0, extra) if record.rows_at_start else (extra, 0)
    widths = [(0, 0)] * 4
    widths[record.layout.index("s")] = at
    return {n: np.pad(a, widths) for n, a in arrays.items()}, np.pad(mask, ((0, 0), at))


class BeamRuns:
    """The searches waiting, starting and running: the engine's thread calls `step` once per
    iteration, and `remove` for a stream that ended otherwise (cancelled, shut down).

    The running searches' beams are rows of one batch (`arrays`, `mask`), in the order of
    `group`, each step gathered into the rows of the beams that go on; a search that ends
    leaves it at that gather, one that starts joins it after its prompt's run, widened to the
    longer past as the in-flight batch widens a row. Several searches share the batch only
    where the graph's rows may move (`together`: the engine's row-move probe passed), and
    their rows, each as long as the longest search's prompt + max_tokens, hold at most
    `budget_tokens` entries together; otherwise one search runs at a time. Where the graph
    shares its past and present buffer (GroupQueryAttention: rows at the start) and the
    runner writes into the caller's arrays (`infer_into`), the rows live in buffers of every
    search's full length, the graph writes each step's entries into them, and a gather
    copies only the rows whose beam continues another row."""

    def __init__(self, infer: Callable[[dict], dict], record: CacheRecord, vocab: int,
                 on_run: Callable[[int, float], None], model: BeamConfig = BeamConfig(1),
                 together: bool = False, budget_tokens: int = 0,
                 infer_into: Callable[[dict, dict], dict] | None = None) -> None:
        self.infer, self.record, self.vocab, self.on_run = infer, record, vocab, on_run
        self.model = model  # the model's search settings (its generation config's)
        self.together, self.budget_tokens = together, budget_tokens
        self.infer_into = infer_into if record.rows_at_start and record.layout[0] == "b" \
            else None  # (rows of a buffer must stay C-contiguous views)
        self.waiting: deque = deque()
        self.fresh: list[BeamRun] = []  # started, their prompts not run yet
        self.group: list[BeamRun] = []  # decoding: their rows in the batch, in this order
        self.arrays, self.mask = empty_past(record, 0)
        self.buffers: dict[str, np.ndarray] = {}  # shared: (rows, .., capacity, ..) a past

    @property
    def running(self) -> list[BeamRun]:
        return self.group + self.fresh

    @property
    def streams(self) -> list:
        return [run.stream for run in self.running] + list(self.waiting)

    def __bool__(self) -> bool:
        return bool(self.group or self.fresh or self.waiting)

    def step(self, send_all: Callable[[object, list[tuple[int, ...]]], None]) -> None:
        """Start the searches there is room for; the running ones take one step in one run,
        then one new search's prompt runs (alone: a prompt's length is its own) and its
        beams join the batch. A search's answer goes out at its end (`send_all(stream,
        sequences)`: the request's `returns` best, best first)."""
        while self.waiting and self._room(self.waiting[0].request):
            self.fresh.append(BeamRun(self.waiting.popleft(), self.model))
        rec = self.record
        if self.group:
            into = None if self.infer_into is None else {
                q: self.arrays[p] for p, q in rec.past_to_present.items()}
            out, feeds, kept = self._run(self.group, self.arrays, self.mask, into, send_all)
            if into is None:
                self.arrays, self.mask = self._trim(*self._gathered(out, feeds.mask, kept))
            else:
                self._keep(kept, feeds.mask)
        if self.fresh:
            run = self.fresh.pop(0)
            out, feeds, kept = self._run([run], *empty_past(rec, 1), None, send_all)
            if not run.search.done:
                self._join(run, *self._gathered(out, feeds.mask, kept))

    def _room(self, request) -> bool:
        """Whether `request`'s search may start now: alone always (admission held it to the
        budget), beside others where they may share runs and every row, widened to the
        longest search's prompt + max_tokens, still fits the budget."""
        if not self.running:
            return True
        asked = [run.stream.request for run in self.running] + [request]
        rows = sum(r.beams for r in asked)
        return self.together and rows * max(len(r.prompt) + r.max_tokens for r in asked) \
            <= self.budget_tokens

    def _run(self, runs: list[BeamRun], arrays: dict, mask: np.ndarray, into, send_all):
        """One run of `runs`' rows against `arrays` / `mask` (the presents written `into`
        those buffers, where given); each search steps, the ended ones answer and leave.
        (outputs, feeds, the rows the beams that go on continue)."""
        rec = self.record
        rows = [row for run in runs for row in run.rows]
        feeds = last_only(step_feeds(rec, rows, mask, arrays))
        began = time.perf_counter()
        out = self.infer(dict(feeds.arrays)) if into is None else \
            self.infer_into(dict(feeds.arrays), into)
        self.on_run(len(rows), time.perf_counter() - began)
        logits = out[rec.logits][np.arange(len(rows)), feeds.logit_slots, : self.vocab]
        kept, at = [], 0
        for run in list(runs):
            k = len(run.rows)
            chosen = run.take(logits[at:at + k])  # its k rows' logits (k, V)
            if chosen is None:
                self._drop(run)
                send_all(run.stream, run.search.top(run.stream.request.returns))
            else:
                kept += [at + c for c in chosen]
            at += k
        return out, feeds, kept

    def _gathered(self, out: dict, mask: np.ndarray, kept: list[int]
                  ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The presents' rows `kept` (each beam its parent row's cache), and their mask."""
        batch = self.record.layout.index("b")
        return ({p: np.take(out[q], kept, axis=batch)
                 for p, q in self.record.past_to_present.items()}, mask[kept])

    def _keep(self, kept: list[int], mask: np.ndarray) -> None:
        """Shared buffers: row i takes row kept[i]'s entries in place, where that is another
        row (read out first: a row may be both); the first len(kept) rows are the batch."""
        rec, mask = self.record, mask[kept]
        used = int(mask.sum(1).max()) if len(kept) else 0  # rows at the start: [0, used)
        moved = [i for i, k in enumerate(kept) if k != i]
        if moved and used:
            span = slice(0, used)
            for buf in self.buffers.values():
                buf[seq_index(rec, moved, span)] = buf[seq_index(rec, [kept[i] for i in moved],
                                                                 span)]
        if not kept:
            self.buffers = {}  # no search runs: their memory goes
        self.arrays = {p: buf[:len(kept)] for p, buf in self.buffers.items()} if kept else \
            empty_past(rec, 0)[0]
        self.mask = mask[:, :used]

    def _join(self, run: BeamRun, arrays: dict, mask: np.ndarray) -> None:
        """A search whose prompt ran: its beams' caches become the batch's last rows."""
        if self.infer_into is not None:
            self._join_buffers(run, arrays, mask)
        elif self.group:
            past = max(int(self.mask.shape[1]), int(mask.shape[1]))
            old, old_mask = _widen(self.record, self.arrays, self.mask, past)
            new, new_mask = _widen(self.record, arrays, mask, past)
            batch = self.record.layout.index("b")
            self.arrays = {n: np.concatenate([old[n], new[n]], axis=batch) for n in old}
            self.mask = np.concatenate([old_mask, new_mask])
        else:
            self.arrays, self.mask = arrays, mask
        self.group.append(run)

    def _join_buffers(self, run: BeamRun, arrays: dict, mask: np.ndarray) -> None:
        """Shared buffers: the new rows written after the batch's, in buffers as long as
        every running search's prompt + max_tokens (grown, the old rows copied, when not)."""
        rec, rows, k = self.record, int(self.mask.shape[0]), int(mask.shape[0])
        length = max(len(r.stream.request.prompt) + r.stream.request.max_tokens
                     for r in [*self.group, run])
        held = self.buffers.get(rec.past[0])
        if held is None or held.shape[0] < rows + k or held.shape[rec.layout.index("s")] < length:
            grown = {p: lazy_zeros(rec.past_shape(rows + k, length, p),
                                   rec.dtypes.get(p, rec.dtype)) for p in rec.past}
            old = seq_index(rec, slice(0, rows), slice(0, int(self.mask.shape[1])))
            for p in rec.past:
                if self.buffers:
                    grown[p][old] = self.buffers[p][old]
            self.buffers = grown
        new = seq_index(rec, slice(rows, rows + k), slice(0, int(mask.shape[1])))
        for p in rec.past:
            self.buffers[p][new] = arrays[p]
        past = max(int(self.mask.shape[1]), int(mask.shape[1]))
        self.mask = np.concatenate([_widen(rec, {}, self.mask, past)[1],
                                    _widen(rec, {}, mask, past)[1]])
        self.arrays = {p: buf[:rows + k] for p, buf in self.buffers.items()}

    def _trim(self, arrays: dict, mask: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Drop the slots no row keeps (a longer search that ended had widened them)."""
        used = np.flatnonzero(mask.any(axis=0))
        span = slice(int(used[0]), int(used[-1]) + 1) if used.size else slice(0, 0)
        if span.stop - span.start == mask.shape[1]:
            return arrays, mask
        index: list = [slice(None)] * 4
        index[self.record.layout.index("s")] = span
        return {n: a[tuple(index)] for n, a in arrays.items()}, mask[:, span]

    def _drop(self, run: BeamRun) -> None:
        """A search that ended out of the running ones (its rows leave the batch in the
        gather that follows)."""
        if run in self.fresh:
            self.fresh.remove(run)
        elif run in self.group:
            self.group.remove(run)

    def remove(self, stream) -> None:
        """A stream that ended otherwise: out of the queue, or its rows out of the batch."""
        if stream in self.waiting:
            self.waiting.remove(stream)
        for run in [r for r in self.fresh if r.stream is stream]:
            self.fresh.remove(run)
        at = 0
        for run in list(self.group):
            k = len(run.rows)
            if run.stream is stream:
                keep = [*range(at), *range(at + k, int(self.mask.shape[0]))]
                self.group.remove(run)
                if self.infer_into is not None:
                    self._keep(keep, self.mask)
                else:
                    batch = self.record.layout.index("b")
                    self.arrays = {n: np.take(a, keep, axis=batch)
                                   for n, a in self.arrays.items()}
                    self.mask = self.mask[keep]
                return
            at += k
