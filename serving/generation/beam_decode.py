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

One search runs at a time, one step per engine iteration, between the batch's steps; its
cache is its own (k rows of prompt + max_tokens entries at most, which admission holds to the
byte budget by itself). The answer goes out when the search ends, token by token: a beam's
tokens are not final until then. A request for more than one of the best sequences
(`returns`) gets them all in one final chunk (serving.generation.output's `answer`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import numpy as np

from serving.generation.beams import (BeamConfig, BeamSearch, config_for, log_softmax,
                                      searchable, unsearchable)
from tuner.gate.decode_step import empty_past, last_only, step_feeds
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
    """One stream's search: its rows' caches, mask and next tokens between steps."""

    def __init__(self, stream, record: CacheRecord, vocab: int, model: BeamConfig) -> None:
        r = stream.request
        self.stream, self.record, self.vocab = stream, record, vocab
        self.search = BeamSearch(config_for(r, model, r.beams), frozenset(r.stop_ids),
                                 r.max_tokens)
        self.arrays, self.mask = empty_past(record, 1)  # (1, .., 0, ..), (1, 0)
        self.rows: list[list[int]] = [list(r.prompt)]  # each row's new tokens, next step

    def step(self, run: Callable[[dict, int], dict]) -> bool:
        """One run of every beam; True when the search is over (`search.best()`)."""
        rec, k = self.record, len(self.rows)
        feeds = last_only(step_feeds(rec, self.rows, self.mask, self.arrays))
        out = run(dict(feeds.arrays), k)
        logits = out[rec.logits][np.arange(k), feeds.logit_slots, : self.vocab]  # (k, V)
        scores = log_softmax(logits)  # float32, as transformers scores beams
        request = self.stream.request
        if self.search.generated < request.min_tokens and request.stop_ids:
            scores[:, list(request.stop_ids)] = -np.inf  # no end before min_tokens
        chosen = self.search.step(scores)
        if self.search.done:
            return True
        batch = rec.layout.index("b")
        self.arrays = {p: np.take(out[q], chosen, axis=batch)  # each beam its row's cache
                       for p, q in rec.past_to_present.items()}
        self.mask = feeds.mask[chosen]
        self.rows = [[t] for t in self.search.next_tokens]
        return False


class BeamRuns:
    """The searches waiting and the one running: the engine's thread calls `step` once per
    iteration, and `remove` for a stream that ended otherwise (cancelled, shut down)."""

    def __init__(self, infer: Callable[[dict], dict], record: CacheRecord, vocab: int,
                 on_run: Callable[[int, float], None], model: BeamConfig = BeamConfig(1)
                 ) -> None:
        self.infer, self.record, self.vocab, self.on_run = infer, record, vocab, on_run
        self.model = model  # the model's search settings (its generation config's)
        self.waiting: deque = deque()
        self.current: BeamRun | None = None

    @property
    def streams(self) -> list:
        return ([self.current.stream] if self.current else []) + list(self.waiting)

    def __bool__(self) -> bool:
        return self.current is not None or bool(self.waiting)

    def step(self, send_all: Callable[[object, list[tuple[int, ...]]], None]) -> None:
        """Start the next search if none runs, then one step of it; its answer out at its
        end (`send_all(stream, sequences)`: the request's `returns` best, best first)."""
        if self.current is None and self.waiting:
            self.current = BeamRun(self.waiting.popleft(), self.record, self.vocab,
                                   self.model)
        if self.current is not None:
            run = self.current
            if run.step(self._run):
                self.current = None
                send_all(run.stream, run.search.top(run.stream.request.returns))

    def remove(self, stream) -> None:
        if self.current is not None and self.current.stream is stream:
            self.current = None
        elif stream in self.waiting:
            self.waiting.remove(stream)

    def _run(self, feeds: dict, rows: int) -> dict:
        began = time.perf_counter()
        out = self.infer(feeds)
        self.on_run(rows, time.perf_counter() - began)
        return out
