"""What every generation loop does the same way around its model runs: take streams in
(validated, queued, refused when full or draining), find them by request id to cancel them,
drain and close, and hand ended streams out of the id index. The decoder-only engine
(serving.generation.engine) and the encoder-decoder one (serving.generation.seq2seq) differ
only in how a step runs."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Callable, Iterator, Sequence

from serving.errors import RETRY_AFTER_S, InvalidArgument, ResourceExhausted, Unavailable
from serving.generation.grammar import GrammarCompiler
from serving.generation.options import GenerateOptions
from serving.generation.output import GenerationStats, OutputProcessor, StreamOutput
from serving.generation.scheduler import Stream
from serving.sampling import Chunk, GenerationRequest


def check_tokens(request: GenerationRequest, vocab: int, tokenizer) -> None:
    """InvalidArgument for a token id outside the vocabulary (the prompt's, a logit bias's,
    an allowed one) or stop strings without a tokenizer to match them on."""
    bad = [t for t in (*request.prompt, *(t for t, _ in request.sampling.logit_bias),
                       *request.sampling.allowed_ids) if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if request.stop_strings and tokenizer is None:
        raise InvalidArgument("stop strings need a tokenizer (no tokenizer.json beside the "
                              "model): send stop ids instead")


class Handle:
    """What `submit` returns: cancel() frees the stream's slot at the next step."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def cancel(self) -> None:
        self._stream.cancelled.set()


class Admission:
    """The submit side of a generation loop. A subclass sets `options`, `tokenizer`,
    `grammars`, `stats` and `output` before `start()`, and gives `validate`, `occupancy`
    (streams running, streams waiting inside the loop) and `_loop`."""

    options: GenerateOptions
    tokenizer: object
    grammars: GrammarCompiler
    stats: GenerationStats
    output: OutputProcessor
    # the token ids the output is detokenized after (None: the prompt's, as a decoder-only
    # continues it; () for an encoder-decoder, whose output is a text of its own)
    detok_context: tuple[int, ...] | None = None

    def start(self) -> None:
        self._submitted: deque[Stream] = deque()
        self._by_id: dict[str, list[Stream]] = {}  # streams not ended, by request id (cancel)
        self._cv = threading.Condition()
        self._draining = False
        self._deadline: float | None = None
        self._thread = threading.Thread(target=self._loop, name="generate", daemon=True)
        self._thread.start()

    def validate(self, request: GenerationRequest) -> None:
        raise NotImplementedError

    def occupancy(self) -> tuple[int, int]:
        raise NotImplementedError

    def _loop(self) -> None:
        raise NotImplementedError

    def submit(self, request: GenerationRequest, on_chunk: Callable[[Chunk], None]) -> Handle:
        """Queue a stream; `on_chunk` is called (from the engine's thread) for every chunk,
        in order, the last one final. Raises InvalidArgument, ResourceExhausted or
        Unavailable."""
        return self.submit_all([(request, on_chunk)])[0]

    def submit_all(self, streams: Sequence[tuple[GenerationRequest, Callable[[Chunk], None]]]
                   ) -> list[Handle]:
        """Queue several streams (a request's samples) whole or not at all: every one is
        validated and room is found for all before any is queued, and the loop takes them
        in one step, so they share its runs from their first."""
        made = []
        for request, on_chunk in streams:
            self.validate(request)
            matcher = self.grammars.matcher(request.grammar) if request.grammar else None
            made.append(Stream(request, on_chunk, StreamOutput(request, self.tokenizer,
                                                               matcher, self.detok_context)))
        with self._cv:
            if self._draining:
                raise Unavailable("the server is shutting down: no new streams")
            o, (running, queued) = self.options, self.occupancy()
            queued += len(self._submitted)
            if queued + running + len(made) > o.max_streams + o.max_queue:
                raise ResourceExhausted(
                    f"the server is full: {running} streams running and {queued} queued "
                    f"(the queue holds {o.max_queue})", retry_after_s=RETRY_AFTER_S)
            for stream in made:
                self._submitted.append(stream)
                if stream.request.id:
                    self._by_id.setdefault(stream.request.id, []).append(stream)
            self.stats.on_streams(running, queued + len(made))
            self._cv.notify()
        return [Handle(stream) for stream in made]

    def generate(self, request: GenerationRequest) -> Iterator[Chunk]:
        """submit(), as an iterator of chunks (blocking); closing it cancels the stream."""
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

    def cancel(self, request_id: str) -> int:
        """Cancel every stream of this request id that has not ended (each ends with a final
        chunk, reason "cancelled", at the next step); how many there were."""
        with self._cv:
            streams = self._by_id.pop(request_id, [])
            for s in streams:
                s.cancelled.set()
            self._cv.notify()
        return len(streams)

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

    def _take_submitted(self, busy: Callable[[], bool]) -> list[Stream] | None:
        """Wait for work; the streams submitted since, or None when drained and idle (the
        loop ends)."""
        with self._cv:
            while not (busy() or self._submitted or self._draining):
                self._cv.wait()
            if self._draining and not (busy() or self._submitted):
                return None
            taken = list(self._submitted)
            self._submitted.clear()
            return taken

    def _send_all(self, s: Stream, sequences: list[tuple[int, ...]]) -> None:
        """A beam search's answer: its `returns` best sequences (OutputProcessor.answer)."""
        self.output.answer(s, sequences)
        self._forget(s)

    def _overdue(self) -> bool:
        return self._deadline is not None and time.perf_counter() >= self._deadline

    def _forget(self, s: Stream) -> None:
        """An ended stream out of the ids' index."""
        if s.request.id:
            with self._cv:
                left = [x for x in self._by_id.get(s.request.id, ()) if x is not s]
                if left:
                    self._by_id[s.request.id] = left
                else:
                    self._by_id.pop(s.request.id, None)

    def _end_reason(self, s: Stream, running: bool) -> tuple[str, str] | None:
        """Why a stream ends before its next step (cancelled, the grace period over, a
        shutdown before it started), or None."""
        if s.cancelled.is_set():
            return "cancelled", ("cancelled by the client" if running
                                 else "cancelled before it started")
        if self._overdue():
            return "shutdown", ("the server shut down before the stream finished (grace "
                                "period over)")
        return None
