"""Server-side generation for a decoder exported with its KV cache: requests, sampling, and
the scheduler that batches every active stream into one decode step (in-flight batching).
No grpc here: the servicer converts messages to `GenerationRequest`s and `Chunk`s back.

The cache lives here, per stream, as the graph's own `present` arrays. Each scheduler
iteration, between two model runs:
  1. streams that were cancelled (or whose client went away) leave, freeing their slot;
  2. queued streams join, up to `max_streams` and about `prefill_tokens` prompt tokens per
     iteration: each runs its prefill alone (batch 1, past 0), which gives its first token; a
     new stream therefore waits a decode step or a few, never for the running streams to
     finish;
  3. one decode step runs every active stream as one batch of one token each.

How rows with different cache lengths share a step: the past is LEFT-padded to a common
length P (the longest row, or its cache-length bucket with `pad_to="bucket"`) and the mask
is 0 on the padding, 1 on each row's own L_i entries and on the new token; position ids are
each row's own L_i. Left rather than right: the new token's key lands at index P of
`present` for every row, right after each row's real entries, so `present` (P + 1 long) is
already a left-padded past for the next step, and while no stream joins or leaves it is fed
back as it is, with one more mask column: no copy per step. A row's own cache is the
contiguous slice [P - L_i, P + 1) of it (a view), gathered into a new batch only when the
rows change. Right-padding would leave a gap between a row's past and its new entry, and
need a copy per row and layer every step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from serving.errors import InvalidArgument, ResourceExhausted, Unavailable
from serving.kv import DecoderSpec
from serving.sampling import Chunk, GenerationRequest, sample
from serving.tokenizer import IncrementalDecoder

log = logging.getLogger("serving")

# ------------------------------------------------------------------------------- options


def next_bucket(n: int, buckets: Sequence[int] = ()) -> int:
    """The smallest bucket >= n; past the largest, the next power of two (so the shapes a
    server sees stay few)."""
    for b in buckets:
        if b >= n:
            return int(b)
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class GenerateOptions:
    max_streams: int = 32  # streams decoded together; more wait in the queue
    max_queue: int = 256  # streams waiting; beyond, RESOURCE_EXHAUSTED
    max_tokens: int = 1024  # the most a request may ask for
    default_max_tokens: int = 16
    max_prompt: int | None = None  # default: the cache length less one token
    max_cache_len: int | None = None  # default: the model's positions (else 2048)
    # Prompt tokens prefilled between two decode steps (always at least one stream): a burst
    # of arrivals then stalls the running streams for a bounded time, not for every prefill.
    prefill_tokens: int = 256
    batch_buckets: tuple[int, ...] = ()  # default: the artifact's
    cache_buckets: tuple[int, ...] = ()  # default: powers of two from 16
    # "bucket": every step's batch and past padded to their buckets (the shapes a GPU
    # artifact was tuned at); "longest": the past only to the longest row when the batch is
    # formed, then each step's present is the next past as it is (any shape runs on a CPU,
    # and every copy and padded position costs time there); "auto": longest on CPU backends.
    pad_to: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_streams", "max_queue", "max_tokens", "default_max_tokens",
                     "prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("max_prompt", "max_cache_len"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, not {v}")
        if self.pad_to not in ("auto", "bucket", "longest"):
            raise ValueError(f"pad_to must be auto, bucket or longest, not {self.pad_to!r}")
        for name in ("batch_buckets", "cache_buckets"):
            v = getattr(self, name)
            if list(v) != sorted(set(v)) or any(b < 1 for b in v):
                raise ValueError(f"{name} must be increasing positive integers, not {list(v)}")


def _cache_buckets(limit: int, given: Sequence[int]) -> tuple[int, ...]:
    if given:
        return tuple(b for b in given if b < limit) + (limit,)
    out, b = [], 16
    while b < limit:
        out.append(b)
        b *= 2
    return tuple(out) + (limit,)


# ------------------------------------------------------------------- output helpers


class StopText:
    """Stop strings matched on streamed text across token boundaries: `feed` returns the
    text that may be released and whether a stop string was completed (the release then ends
    right before it). A tail that could still become a stop string is held back until the
    next piece decides it; `flush` releases it at the end."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held = stops, ""

    def feed(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[:min(hits)], True
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1))
                    if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def log_softmax_at(logits: np.ndarray, token: int) -> float:
    """log p(token) under the model's own distribution (raw logits, before any sampling
    transform), computed stably in float64."""
    x = logits.astype(np.float64)
    m = x.max()
    return float(x[token] - m - np.log(np.exp(x - m).sum()))


# ------------------------------------------------------------------------------- streams


class _Stream:
    """One generation in flight. Mutated by the scheduler thread only (but `cancelled`)."""

    def __init__(self, request: GenerationRequest, on_chunk: Callable[[Chunk], None],
                 detokenizer) -> None:
        self.request, self.on_chunk, self.detok = request, on_chunk, detokenizer
        self.stop_text = StopText(request.stop_strings) if request.stop_strings else None
        self.rng = np.random.default_rng(request.sampling.seed)
        self.cache: list[np.ndarray] = []  # per past input: (1, kv_heads, length, d)
        self.length = 0  # cache entries
        self.last = 0  # the token fed to the next step
        self.generated = 0
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.last_token_at: float | None = None
        self.done = False


@dataclass(frozen=True)
class _Batch:
    """The rows of the last decode step and the next step's past for them: `present` as it
    came out, (B, kv_heads, P, d), and the mask (B, P) with 0 on each row's left padding."""

    rows: list[_Stream]
    past: dict[str, np.ndarray]
    mask: np.ndarray


class Handle:
    """What `submit` returns: cancel() frees the stream's slot at the next step."""

    def __init__(self, stream: _Stream) -> None:
        self._stream = stream

    def cancel(self) -> None:
        self._stream.cancelled.set()


@dataclass
class GenerationStats:
    """Counters the generator keeps (a metrics layer reads them; see serving.metrics)."""

    on_token: Callable[[float | None, float | None], None] = lambda ttft, itl: None
    on_step: Callable[[int, float], None] = lambda rows, seconds: None
    on_streams: Callable[[int, int], None] = lambda active, queued: None
    on_end: Callable[[str, float], None] = lambda reason, seconds: None


class Generator:
    """Owns the KV caches and the one scheduler thread that runs the model."""

    def __init__(self, runner, spec: DecoderSpec, options: GenerateOptions = GenerateOptions(),
                 *, max_positions: int | None = None, batch_buckets: Sequence[int] = (),
                 tokenizer=None, stats: GenerationStats | None = None,
                 pad_to: str = "longest") -> None:
        self.runner, self.spec, self.options = runner, spec, options
        self.tokenizer = tokenizer
        self.stats = stats or GenerationStats()
        self.max_cache_len = options.max_cache_len or max_positions or 2048
        if max_positions is not None and self.max_cache_len > max_positions:
            raise ValueError(f"max cache length {self.max_cache_len} exceeds the model's "
                             f"{max_positions} positions")
        self.max_prompt = min(options.max_prompt or self.max_cache_len - 1,
                              self.max_cache_len - 1)
        self.batch_buckets = tuple(options.batch_buckets or batch_buckets)
        self.cache_buckets = _cache_buckets(self.max_cache_len, options.cache_buckets)
        self._dtype = np.dtype(spec.cache_dtype)
        if pad_to not in ("bucket", "longest"):
            raise ValueError(f"pad_to must be bucket or longest, not {pad_to!r}")
        self.pad_to = pad_to
        self._batch: _Batch | None = None  # the last decode step's rows and present
        self._pending: deque[_Stream] = deque()
        self._active: list[_Stream] = []
        self._cv = threading.Condition()
        self._draining = False
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._loop, name="generate", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------------------- admission

    def validate(self, request: GenerationRequest) -> None:
        """InvalidArgument for a request this server can never run, saying which limit."""
        n, o = len(request.prompt), self.options
        if n > self.max_prompt:
            raise InvalidArgument(f"the prompt has {n} tokens; at most {self.max_prompt} are "
                                  "accepted")
        if request.max_tokens > o.max_tokens:
            raise InvalidArgument(f"max_tokens {request.max_tokens} is over the limit "
                                  f"{o.max_tokens}")
        if n + request.max_tokens - 1 > self.max_cache_len:
            raise InvalidArgument(
                f"prompt ({n}) + max_tokens ({request.max_tokens}) - 1 = "
                f"{n + request.max_tokens - 1} cache entries exceed the maximum cache length "
                f"{self.max_cache_len} (the model's positions)")
        if request.stop_strings and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer (no tokenizer.json in this "
                                  "artifact): send stop token ids instead")
        bad = [t for t in request.prompt if not 0 <= t < self.spec.vocab]
        if bad:
            raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.spec.vocab})")

    def submit(self, request: GenerationRequest, on_chunk: Callable[[Chunk], None]) -> Handle:
        """Queue a stream; `on_chunk` is called (from the scheduler thread) for every chunk,
        the last one final. Raises InvalidArgument, ResourceExhausted or Unavailable."""
        self.validate(request)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDecoder(self.tokenizer, request.prompt)
        stream = _Stream(request, on_chunk, detok)
        with self._cv:
            if self._draining:
                raise Unavailable("the server is shutting down: no new streams")
            # full when every slot is taken and the queue too (a stream still in _pending
            # while a slot is free only waits for the next iteration to admit it)
            o = self.options
            if len(self._pending) + len(self._active) >= o.max_streams + o.max_queue:
                raise ResourceExhausted(
                    f"the server is full: {len(self._active)} streams running and "
                    f"{len(self._pending)} queued (the queue holds {self.options.max_queue})")
            self._pending.append(stream)
            self.stats.on_streams(len(self._active), len(self._pending))
            self._cv.notify()
        return Handle(stream)

    def generate(self, request: GenerationRequest) -> Iterator[Chunk]:
        """submit(), as an iterator of chunks (blocking); closing it cancels the stream."""
        import queue

        chunks: queue.Queue[Chunk] = queue.Queue()
        handle = self.submit(request, chunks.put)
        try:
            while True:
                chunk = chunks.get()
                yield chunk
                if chunk.final:
                    return
        finally:
            handle.cancel()

    def drain(self, grace_s: float) -> None:
        """No new streams; those running get `grace_s` to finish, then end with a final chunk
        saying so (reason "shutdown"). Returns at once; close() waits."""
        with self._cv:
            self._draining = True
            self._deadline = time.perf_counter() + grace_s
            self._cv.notify()

    def close(self, grace_s: float = 0.0) -> None:
        if not self._draining:
            self.drain(grace_s)
        self._thread.join()

    @property
    def active(self) -> int:
        return len(self._active)

    # ---------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._pending or self._active or self._draining):
                    self._cv.wait()
                if self._draining and not (self._pending or self._active):
                    return
                joining = self._admit()
                self._active.extend(joining)  # counted as active from here on
            try:
                self._end_overdue()
                self._drop_cancelled()
                for stream in joining:
                    if not stream.done:
                        self._prefill(stream)
                self._active = [s for s in self._active if not s.done]
                if self._active:
                    self._decode_step(self._active)
                    self._active = [s for s in self._active if not s.done]
                if not self._active:
                    self._batch = None  # nothing to continue: free the last present
            except Exception as e:  # noqa: BLE001 - the model failed: end every stream, go on
                log.exception("generation step failed")
                for s in self._active:
                    self._finish(s, "error", f"the model failed: {type(e).__name__}: {e}")
                self._active, self._batch = [], None
            self.stats.on_streams(len(self._active), len(self._pending))

    def _admit(self) -> list[_Stream]:
        """Queued streams that fit into the free slots (called under the lock)."""
        joining, budget = [], self.options.prefill_tokens
        while self._pending and len(self._active) + len(joining) < self.options.max_streams:
            if joining and len(self._pending[0].request.prompt) > budget:
                break  # the next one prefills after the next decode step
            s = self._pending.popleft()
            if s.cancelled.is_set():
                self._finish(s, "cancelled", "cancelled before it started")
            elif self._draining:
                self._finish(s, "shutdown", "the server shut down before the stream started")
            else:
                joining.append(s)
                budget -= len(s.request.prompt)
        return joining

    def _end_overdue(self) -> None:
        if self._deadline is None or time.perf_counter() < self._deadline:
            return
        with self._cv:
            overdue, self._pending = list(self._pending), deque()
        for s in self._active + overdue:
            self._finish(s, "shutdown", "the server shut down before the stream finished "
                                        "(grace period over)")
        self._active = []

    def _drop_cancelled(self) -> None:
        for s in self._active:
            if s.cancelled.is_set():
                self._finish(s, "cancelled", "cancelled by the client")
        self._active = [s for s in self._active if not s.done]

    # ---------------------------------------------------------------------------- model runs

    def _empty_past(self, rows: int) -> dict[str, np.ndarray]:
        return {name: np.zeros((rows, h, 0, d), self._dtype)  # (B, kv_heads, 0, d)
                for name, (h, d) in zip(self.spec.past, self.spec.cache_dims)}

    def _prefill(self, s: _Stream) -> None:
        """The prompt alone, unpadded (batch 1, past 0): its first token and its cache."""
        sp, n = self.spec, len(s.request.prompt)
        feeds = {sp.tokens: np.array([s.request.prompt], np.int64),  # (1, n)
                 sp.mask: np.ones((1, n), np.int64), **self._empty_past(1)}
        if sp.positions:
            feeds[sp.positions] = np.arange(n, dtype=np.int64)[None]  # (1, n)
        start = time.perf_counter()
        out = self.runner.infer(feeds)
        self.stats.on_step(1, time.perf_counter() - start)
        s.cache = [out[name] for name in sp.present]  # (1, kv_heads, n, d)
        s.length = n
        self._emit(s, out[sp.logits][0, -1, : sp.vocab])

    def _decode_step(self, rows: list[_Stream]) -> None:
        """One token for every active stream, as one batch (see the module docstring)."""
        sp, n = self.spec, len(rows)
        batch = self._batch
        if batch is None or batch.rows != rows or self.pad_to == "bucket":
            batch = self._gather(rows)
        size = batch.mask.shape[0]
        feeds = {sp.tokens: np.zeros((size, 1), np.int64),  # (B, 1)
                 # every row sees its new token (padding rows too): (B, P + 1)
                 sp.mask: np.concatenate([batch.mask, np.ones((size, 1), np.int64)], axis=1),
                 **batch.past}
        positions = np.zeros((size, 1), np.int64)  # (B, 1)
        for i, s in enumerate(rows):
            feeds[sp.tokens][i, 0] = s.last
            positions[i, 0] = s.length
        if sp.positions:
            feeds[sp.positions] = positions
        began = time.perf_counter()
        out = self.runner.infer(feeds)
        self.stats.on_step(n, time.perf_counter() - began)
        # `present` (B, kv_heads, P + 1, d) is the next step's past as it is, while the rows
        # stay the same: no copy per step (each row keeps its left padding).
        self._batch = _Batch(list(rows), {name: out[pres] for name, pres in
                                          zip(sp.past, sp.present)}, feeds[sp.mask])
        logits = out[sp.logits][:, -1, : sp.vocab]  # (B, vocab)
        for i, s in enumerate(rows):
            s.length += 1
            self._emit(s, logits[i])

    def _gather(self, rows: list[_Stream]) -> "_Batch":
        """A new batch from each row's own cache: left-padded to the longest (or to its
        cache bucket), the mask 0 on the padding; rows padded to a batch bucket in bucket
        mode (padding rows: zeros, masked out)."""
        sp, n = self.spec, len(rows)
        longest = max(s.length for s in rows)
        bucketed = self.pad_to == "bucket"
        size = next_bucket(n, self.batch_buckets) if bucketed else n  # B
        past = next_bucket(longest, self.cache_buckets) if bucketed else longest  # P
        caches = [self._row_cache(s) for s in rows]
        mask = np.zeros((size, past), np.int64)  # (B, P)
        arrays = {}
        for j, (name, (h, d)) in enumerate(zip(sp.past, sp.cache_dims)):
            buf = np.zeros((size, h, past, d), self._dtype)  # (B, kv_heads, P, d)
            for i, s in enumerate(rows):
                buf[i, :, past - s.length:] = caches[i][j][0]  # left padding: ends at P
            arrays[name] = buf
        for i, s in enumerate(rows):
            mask[i, past - s.length:] = 1
            s.cache = []  # the batch holds it now
        return _Batch(list(rows), arrays, mask)

    def _row_cache(self, s: _Stream) -> list[np.ndarray]:
        """A stream's cache, (1, kv_heads, L, d) per past input: its prefill's, or its row
        of the last batch (a view)."""
        b = self._batch
        if b is not None:
            for i, other in enumerate(b.rows):
                if other is s:
                    past = b.mask.shape[1]
                    return [b.past[name][i:i + 1, :, past - s.length:] for name in self.spec.past]
        return s.cache

    # ------------------------------------------------------------------------------ output

    def _emit(self, s: _Stream, logits: np.ndarray) -> None:
        r = s.request
        drawn = logits
        if s.generated < r.min_tokens and r.stop_ids:  # too early to stop: mask the stops
            drawn = logits.copy()
            drawn[[t for t in r.stop_ids if 0 <= t < drawn.size]] = -np.inf
        token = sample(drawn, r.sampling, s.rng)
        logprob = (log_softmax_at(logits, token),) if r.logprobs else None
        now = time.perf_counter()
        ttft = now - s.submitted if s.last_token_at is None else None
        itl = None if s.last_token_at is None else now - s.last_token_at
        s.last_token_at = now
        if token in s.request.stop_ids:
            self._finish(s, "stop")
            return
        s.last, s.generated = token, s.generated + 1
        self.stats.on_token(ttft, itl)
        text = s.detok.add(token) if s.detok is not None else None
        last = s.generated >= s.request.max_tokens
        if last and s.detok is not None:
            text += s.detok.flush()
        if s.stop_text is not None:
            text, hit = s.stop_text.feed(text)
            if hit:
                self._send(s, Chunk((token,), text, True, "stop", logprobs=logprob))
                s.done = True
                self.stats.on_end("stop", now - s.submitted)
                return
            if last:
                text += s.stop_text.flush()
        if last:
            self._send(s, Chunk((token,), text, True, "length", logprobs=logprob))
            s.done = True
            self.stats.on_end("length", now - s.submitted)
        else:
            self._send(s, Chunk((token,), text, logprobs=logprob))

    def _finish(self, s: _Stream, reason: str, detail: str = "") -> None:
        """The final chunk without a new token (stop, cancel, shutdown, error)."""
        if s.done:
            return
        s.done = True
        text = s.detok.flush() if s.detok is not None else None
        if s.stop_text is not None:
            text = s.stop_text.feed(text)[0] + s.stop_text.flush()
        self._send(s, Chunk((), text, True, reason, detail, () if s.request.logprobs else None))
        self.stats.on_end(reason, time.perf_counter() - s.submitted)

    def _send(self, s: _Stream, chunk: Chunk) -> None:
        try:
            s.on_chunk(chunk)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the others
            log.exception("delivering a chunk failed; cancelling that stream")
            s.cancelled.set()
