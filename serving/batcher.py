"""Dynamic batching into sequence buckets. No grpc here: requests are numpy feeds in,
numpy outputs out, through concurrent.futures.Future.

How a batch is made (one worker thread per model instance):
- the oldest waiting request decides the batch's key: its sequence bucket (the smallest
  bucket >= its length) and the shapes of its other inputs;
- the worker waits until requests with that key fill `max_batch` rows, or the oldest request
  has waited `max_queue_delay_s` (0: take whatever is queued now, as Triton does: under load
  requests pile up while the previous batch runs, so batching costs no idle time); with no
  delay, a request that finds the model idle and nobody queued runs at once in its caller's
  thread;
- sequence inputs are right-padded with zeros to the bucket (or, for CPU runtimes, only to
  the batch's longest request: BatchPolicy.pad_to_bucket); the attention mask's zeros make
  the padded positions invisible to attention, and right padding leaves a causal model's
  valid positions untouched. The batch runs once, and each request gets its own rows back,
  cut to its own length on every output axis that follows the sequence.
Requests longer than the largest bucket never get here: the engine rejects them.
Without an attention mask input nothing can be padded safely: then only requests of equal
length are batched together, at their own length.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from serving.errors import RETRY_AFTER_S, InvalidArgument, Unavailable
from tuner.measure.buckets import BeyondBuckets, fit_bucket

Feeds = Mapping[str, np.ndarray]
RunFn = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Layout:
    """Where the batch and sequence axes are in a model's tensors (axis 0 is the batch)."""

    seq_inputs: tuple[str, ...]  # inputs shaped (batch, seq, ...): padded on the right
    mask_input: str | None  # among seq_inputs; None: padding is not safe, so none is done
    output_seq_axes: Mapping[str, int | None]  # output -> the axis that follows the sequence
    # False: a request's outputs change when it is padded and joined with others (its
    # activations quantized with one range per run): then it is never padded or joined
    rows_apart: bool = True

    def __post_init__(self) -> None:
        if self.mask_input is not None and self.mask_input not in self.seq_inputs:
            raise ValueError(f"mask input {self.mask_input!r} must be one of the sequence "
                             f"inputs {list(self.seq_inputs)}")
        for name, axis in self.output_seq_axes.items():
            if axis is not None and axis < 1:
                raise ValueError(f"output {name!r}: the sequence axis must be >= 1 "
                                 f"(axis 0 is the batch), not {axis}")


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int  # rows a run may join from several requests (1: batching off)
    max_queue_delay_s: float
    seq_buckets: tuple[int, ...]  # strictly increasing
    max_queue: int = 4096  # waiting requests; beyond it new ones are refused (UNAVAILABLE)
    # True: pad to the bucket (the shapes the artifact was timed at; GPU kernels like aligned
    # shapes). False: pad only to the longest request of the batch (CPU runtimes take any
    # shape, and every padded token is work), so a request alone is not padded at all.
    pad_to_bucket: bool = True

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max batch must be >= 1, not {self.max_batch}")
        if not 0 <= self.max_queue_delay_s <= 10:
            raise ValueError(f"max queue delay must be in [0, 10] seconds, not "
                             f"{self.max_queue_delay_s}")
        b = list(self.seq_buckets)
        if not b or b != sorted(set(b)) or b[0] < 1:
            raise ValueError(f"sequence buckets must be increasing positive integers, not {b}")
        if self.max_queue < 1:
            raise ValueError("max queue must be >= 1")


@dataclass(frozen=True)
class Result:
    """One request's outputs and what it cost: seconds queued, seconds of the batch's run,
    the rows of the batch it ran in, and the bucket length it was padded to."""

    outputs: dict[str, np.ndarray]
    queue_s: float
    compute_s: float
    batch_rows: int
    padded_to: int


@dataclass
class _Request:
    feeds: Feeds
    rows: int
    length: int
    key: tuple
    enqueued: float
    # Made only for a request that waits for a worker (or is submitted): one that runs
    # inline in Batcher.run needs none, and building one costs as much as the rest of the
    # fast path when the caches are cold after a model run (see Batcher.run).
    future: Future | None = None


class Batcher:
    """Groups submitted requests into batches and runs them with `run(feeds) -> outputs`.

    `on_batch(rows, requests, compute_s)` is called after each run (metrics)."""

    def __init__(self, run: RunFn, layout: Layout, policy: BatchPolicy,
                 on_batch: Callable[[int, int, float], None] | None = None,
                 workers: int = 1) -> None:
        self._run, self.layout, self.policy = run, layout, policy
        self._on_batch = on_batch
        self._queue: list[_Request] = []
        self._cond = threading.Condition()
        self._closed = False
        self._slots = threading.Semaphore(workers)  # model runs at a time
        self._threads = [threading.Thread(target=self._loop, name=f"batcher-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    # ----------------------------------------------------------------------------- public

    def bucket_for(self, length: int) -> int:
        """The padded length for a request of `length` tokens."""
        if self.layout.mask_input is None:
            return length
        try:
            return fit_bucket(length, self.policy.seq_buckets)  # the artifact's one rule
        except BeyondBuckets:
            raise InvalidArgument(f"sequence length {length} is longer than the largest bucket "
                                  f"{self.policy.seq_buckets[-1]}") from None

    def run(self, feeds: Feeds) -> Result:
        """Run one request (already validated) and wait for its Result.

        A request that finds the model idle, nobody queued and no delay asked for runs right
        here, in the caller's thread, with no Future: a batch of one is all the queue would
        have made of it, and at batch 1 every step counts (two thread hand-offs cost more
        than the model run of a small model; a Future and its lock alone cost ~45 us when
        the caches are cold, as they are after each run of a large model)."""
        request = self._request(feeds)
        if not self._enqueue_or_claim(request):
            return request.future.result()
        try:
            return self._execute([request])[0]
        finally:
            self._slots.release()

    def submit(self, feeds: Feeds) -> Future:
        """Queue one request (already validated); its Future resolves to a Result. Runs it
        at once in the caller's thread when `run` would."""
        request = self._request(feeds)
        if self._enqueue_or_claim(request):
            request.future = Future()
            try:
                if request.future.set_running_or_notify_cancel():
                    self._run_batch([request])
            finally:
                self._slots.release()
        return request.future

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, run every queued one, then stop the workers."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout)

    # ----------------------------------------------------------------------------- worker

    def _request(self, feeds: Feeds) -> _Request:
        rows, length = self._rows_and_length(feeds)
        key = (self.bucket_for(length),) + tuple(
            (n, a.shape[1:]) for n, a in sorted(feeds.items()) if n not in self.layout.seq_inputs)
        return _Request(feeds, rows, length, key, time.perf_counter())

    def _enqueue_or_claim(self, request: _Request) -> bool:
        """Queue the request (False), or, when it may run at once, take a model slot for the
        caller, who must run it and release the slot (True)."""
        with self._cond:
            if self._closed:
                raise Unavailable("the server is shutting down")
            if len(self._queue) >= self.policy.max_queue:
                raise Unavailable(f"the queue is full ({self.policy.max_queue} requests waiting)",
                                  retry_after_s=RETRY_AFTER_S)
            if (self.policy.max_queue_delay_s == 0 and not self._queue
                    and self._slots.acquire(blocking=False)):
                return True
            request.future = Future()
            self._queue.append(request)
            self._cond.notify()
            return False

    def _rows_and_length(self, feeds: Feeds) -> tuple[int, int]:
        first = next(iter(feeds.values()))
        rows = int(first.shape[0]) if first.ndim else 1
        seq = [feeds[n] for n in self.layout.seq_inputs if n in feeds]
        return rows, (int(seq[0].shape[1]) if seq else 0)

    def _take(self, key: tuple) -> tuple[list[_Request], int]:
        """The oldest request, then others of the same key while the rows fit `max_batch`
        (a request with more rows than that runs alone: the engine decides what it accepts)."""
        picked, rows = [], 0
        for r in self._queue:
            if r.key == key and (not picked or rows + r.rows <= self.policy.max_batch):
                picked.append(r)
                rows += r.rows
        return picked, rows

    def _wait_for_work(self) -> bool:
        """False once closed and drained."""
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            return bool(self._queue)

    def _next_batch(self) -> list[_Request]:
        """The batch to run now (empty if another worker took the queue meanwhile). Called
        holding a model slot: requests keep joining while the model is busy."""
        with self._cond:
            if not self._queue:
                return []
            first = self._queue[0]
            deadline = first.enqueued + self.policy.max_queue_delay_s
            while True:
                picked, rows = self._take(first.key)
                wait = deadline - time.perf_counter()
                if rows >= self.policy.max_batch or self._closed or wait <= 0:
                    break
                self._cond.wait(wait)
            chosen = {id(r) for r in picked}
            self._queue = [r for r in self._queue if id(r) not in chosen]
            return picked

    def _loop(self) -> None:
        while self._wait_for_work():
            with self._slots:
                batch = [r for r in self._next_batch() if r.future.set_running_or_notify_cancel()]
                if batch:
                    self._run_batch(batch)

    def _run_batch(self, batch: list[_Request]) -> None:
        """Run a batch and answer every request's Future, with its Result or the error."""
        try:
            results = self._execute(batch)
        except BaseException as e:  # noqa: BLE001 - every waiting client must get an answer
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(e)
            return
        for r, result in zip(batch, results):
            r.future.set_result(result)

    def _execute(self, batch: list[_Request]) -> list[Result]:
        """Pad and join the batch, run it once, and split the outputs back per request."""
        start = time.perf_counter()
        bucket = batch[0].key[0]
        if not self.policy.pad_to_bucket and self.layout.seq_inputs:
            bucket = max(r.length for r in batch)
        outputs = self._run(self._stack(batch, bucket))
        compute = time.perf_counter() - start
        rows = sum(r.rows for r in batch)
        results, offset = [], 0
        for r in batch:
            mine = self._split(outputs, offset, r, bucket)
            results.append(Result(mine, start - r.enqueued, compute, rows, bucket))
            offset += r.rows
        if self._on_batch is not None:
            self._on_batch(rows, len(batch), compute)
        return results

    def _stack(self, batch: list[_Request], bucket: int) -> dict[str, np.ndarray]:
        if len(batch) == 1 and batch[0].length == bucket:
            return dict(batch[0].feeds)  # nothing to pad or join: no copy
        return stack(self.layout, [r.feeds for r in batch], bucket)

    def _split(self, outputs: dict[str, np.ndarray], offset: int, r: _Request,
               bucket: int) -> dict[str, np.ndarray]:
        return split(self.layout, outputs, offset, r.rows, r.length, bucket)


def stack(layout: Layout, requests: list[Feeds], bucket: int) -> dict[str, np.ndarray]:
    """One batch of `requests`: sequence inputs right-padded with zeros to `bucket`, rows
    joined in order."""
    feeds = {}
    rows = sum(len(next(iter(r.values()))) for r in requests)
    for name, first in requests[0].items():
        if name in layout.seq_inputs:
            out = np.zeros((rows, bucket) + first.shape[2:], dtype=first.dtype)  # (B, S, ...)
            offset = 0
            for r in requests:
                a = r[name]
                out[offset:offset + len(a), :a.shape[1]] = a
                offset += len(a)
            feeds[name] = out
        else:
            feeds[name] = np.concatenate([r[name] for r in requests], axis=0)
    return feeds


def split(layout: Layout, outputs: dict[str, np.ndarray], offset: int, rows: int, length: int,
          bucket: int) -> dict[str, np.ndarray]:
    """A request's own rows of a batch's outputs, cut to its length on the sequence axes."""
    mine = {}
    for name, out in outputs.items():
        part = out[offset:offset + rows]
        axis = layout.output_seq_axes.get(name)
        if axis is not None and length != bucket:
            cut = [slice(None)] * part.ndim
            cut[axis] = slice(0, length)
            part = part[tuple(cut)]
        mine[name] = part
    return mine
