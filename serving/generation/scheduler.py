"""Which streams run in the next step, and how many tokens each feeds.

A stream's sequence is its prompt and the tokens generated so far; `computed` of them have
their keys/values in the cache. It is *prefilling* while more than one token is uncomputed
and *decoding* when only its last token is (that token is fed, the next one comes out).
Each step (vLLM v1's scheduler, on the graph's (batch, seq) shapes):
  1. every decoding stream feeds one token;
  2. the rest of the step's token budget (`prefill_tokens`) goes to prefill chunks, first
     of streams already running, then of waiting ones admitted up to `max_streams` (a
     prompt longer than what is left is prefilled over several steps, when the graph takes
     a chunk beside a past: chunked prefill). With `max_stall` set, while streams decode,
     the budget is also held to what `max_stall` of a decode run's time buys at the
     measured prefill cost per token (StepCosts), so a burst of prompts delays the decoding
     streams' next token by at most that share: inter-token latency stays under
     (1 + max_stall) decode runs (at a cost in throughput: off by default);
  3. the cache's byte budget holds every running stream's entries plus this step's new
     ones; past it, prefix-cache blocks are evicted, then the newest stream is PREEMPTED:
     its cache dropped, it waits again at the head of the queue and is recomputed (prompt
     and generated tokens prefilled again) when it is readmitted.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from serving.generation.speculate import Backoff
from serving.sampling import Chunk, GenerationRequest


class Stream:
    """One generation in flight. Mutated by the engine's thread only (but `cancelled`)."""

    def __init__(self, request: GenerationRequest, on_chunk: Callable[[Chunk], None],
                 output) -> None:
        self.request, self.on_chunk, self.output = request, on_chunk, output
        self.tokens: list[int] = list(request.prompt)  # prompt + generated
        self.computed = 0  # tokens whose keys/values are cached
        self.cache: dict[str, np.ndarray] | None = None  # its own cache, when not in the batch
        self.slot: int | None = None  # its row of the decode batch
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.preemptions = 0
        self.prefix_stored = False
        self.prefix_hit = 0  # prompt tokens found in the prefix cache
        self.prefix_counted = False
        self.lookups = Backoff()  # when prompt lookup may draft for it (speculation)
        self.done = False

    @property
    def decoding(self) -> bool:
        return self.computed == len(self.tokens) - 1

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.computed


@dataclass
class StepCosts:
    """Moving averages of measured run times: a decode run, and prefill per token (a run's
    fixed cost included, so small chunks count dear, as they cost)."""

    decode_s: float | None = None
    prefill_token_s: float | None = None
    weight: float = 0.2  # of the newest observation

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new

    def observe_decode(self, seconds: float) -> None:
        self.decode_s = self._mix(self.decode_s, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.prefill_token_s = self._mix(self.prefill_token_s, seconds / tokens)

    def prefill_tokens_within(self, share: float) -> int | None:
        """How many prefill tokens cost `share` of a decode run (None: not measured yet)."""
        if self.decode_s is None or not self.prefill_token_s:
            return None
        return int(share * self.decode_s / self.prefill_token_s)


@dataclass(frozen=True)
class StepPlan:
    """One step: the decoding streams (one token each) and the prefill chunks (stream, how
    many of its uncomputed tokens), and the streams preempted to make room."""

    decode: tuple[Stream, ...]
    prefill: tuple[tuple[Stream, int], ...]
    preempted: tuple[Stream, ...] = ()

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    """Waiting and running streams. `cache` (serving.generation.cache.CacheManager) answers
    for bytes: `fits(tokens)`, `evict_prefix()`, `release(stream)`, `lookup_prefix(stream)`."""

    # Prefill tokens a step feeds at least, however dear. A chunk's run pays a fixed cost
    # (every weight read, about a decode run) whatever its length: at 16 tokens a chunk cost
    # 2.3 ms a token against 0.8 beyond 64 (Llama h 1024, 2 cores), and 32 prompts arriving
    # over 1 s waited 9.8 s for a first token at 91 tok/s; at 64, 4.5 s at 147 tok/s, the
    # decoding rows' inter-token p99 going from 1.5x to 3.2x their p50.
    MIN_CHUNK = 64

    def __init__(self, cache, max_streams: int, token_budget: int, takes_chunks: bool,
                 max_stall: float | None = None, chunks_share_runs: bool = True) -> None:
        self.cache, self.max_streams, self.token_budget = cache, max_streams, token_budget
        self.takes_chunks, self.max_stall = takes_chunks, max_stall
        self.chunks_share_runs = chunks_share_runs
        self.costs = StepCosts()
        self.waiting: deque[Stream] = deque()
        self.running: list[Stream] = []

    def add(self, stream: Stream) -> None:
        self.waiting.append(stream)

    def remove(self, stream: Stream) -> None:
        """A stream that ended (or was cancelled): out of either list, its cache freed."""
        if stream in self.running:
            self.running.remove(stream)
        elif stream in self.waiting:
            self.waiting.remove(stream)
        self.cache.release(stream)

    def held(self) -> int:
        """Cache entries the running streams hold."""
        return sum(s.computed for s in self.running)

    def schedule(self) -> StepPlan:
        preempted = self._make_room()
        decode = [s for s in self.running if s.decoding]
        held = sum(s.computed for s in self.running) + len(decode)
        budget = self._prefill_budget(len(decode))
        prefill: list[tuple[Stream, int]] = []

        def runs_alone_again(s: Stream) -> bool:  # a second chunk with a run of its own
            return (bool(decode) and not self.chunks_share_runs and s.computed > 0
                    and any(p.computed > 0 for p, _ in prefill))

        for s in [s for s in self.running if not s.decoding]:
            if self.takes_chunks:
                self.cache.lookup_prefix(s)  # blocks a stream ahead computed meanwhile
            n = self._chunk(s, budget, prefill)
            if n == 0 or runs_alone_again(s) or not self.cache.fits(held + n):
                break
            prefill.append((s, n))
            budget, held = budget - n, held + n
        while self.waiting and len(self.running) < self.max_streams and budget > 0:
            s = self.waiting[0]
            if s.cancelled.is_set():
                break  # the engine ends it before the next plan
            if self.takes_chunks:
                self.cache.lookup_prefix(s)  # a shared prefix: cached already
            n = self._chunk(s, budget, prefill)
            if runs_alone_again(s):
                self.cache.release(s)
                break
            while not self.cache.fits(held + s.computed + n) and self.cache.evict_prefix():
                pass  # running streams come before cached prefixes
            alone = not self.running
            if n == 0 or not (self.cache.fits(held + s.computed + n) or alone):
                self.cache.release(s)
                break
            self.waiting.popleft()
            self.running.append(s)
            prefill.append((s, n))
            budget, held = budget - n, held + s.computed + n
        return StepPlan(tuple(decode), tuple(prefill), tuple(preempted))

    def _prefill_budget(self, decoding: int) -> int:
        budget = self.token_budget - decoding
        if decoding and self.max_stall is not None:
            cap = self.costs.prefill_tokens_within(self.max_stall)
            if cap is not None:
                budget = min(budget, max(self.MIN_CHUNK, cap))
        return budget

    def _chunk(self, s: Stream, budget: int, planned: list) -> int:
        """How many uncomputed tokens `s` feeds now: all but what the budget leaves for
        later (chunks need a graph that takes seq > 1 beside a past; without, a stream is
        prefilled whole, from an empty cache, one at least per step)."""
        left = s.uncomputed
        if self.takes_chunks:
            return max(0, min(left, budget))
        return left if left <= budget or not planned else 0

    def _make_room(self) -> list[Stream]:
        """Evict prefix blocks, then preempt the newest streams, until every running
        stream's cache and this step's new tokens fit the byte budget."""
        preempted = []

        def need() -> int:
            return self.held() + len(self.running)

        while not self.cache.fits(need()):
            if self.cache.evict_prefix():
                continue
            if len(self.running) <= 1:
                break  # one stream alone always runs (validate() bounds its length)
            victim = self.running.pop()
            self.cache.release(victim)  # its cache dropped: recomputed when readmitted
            victim.preemptions += 1
            self.waiting.appendleft(victim)
            preempted.append(victim)
        return preempted
