"""Whisper's temperature fallback and silence rule, per window of the audio API: OpenAI's
whisper package (transcribe.py, `decode_with_fallback` and its no-speech skip) and
transformers' WhisperForConditionalGeneration.generate (a temperature tuple with
compression_ratio_threshold, logprob_threshold, no_speech_threshold) decide alike:

- a try needs a redo when its text is too repetitive (compression ratio over 2.4) or the
  model was unsure of it (average log-prob under -1.0), unless it is silence: the
  probability of <|nospeech|> at the start token over 0.6 and the average log-prob under
  -1.0; the redo samples at the next temperature, and where every one fails the last try
  is kept;
- a kept window whose no-speech probability is over 0.6 and whose average log-prob is not
  over -1.0 is silence: its text is left out of the answer.

The windows of one request decode at once, each through its own tries: one greedy try
and one sample per temperature (transcribe()'s defaults; its command line's beam_size and
best_of of 5 are not done). A sampled try is seeded from its window's features and its
temperature, so the same audio gets the same answer. No HTTP here."""

from __future__ import annotations

import asyncio
import hashlib
import math
import zlib
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable, Sequence

import numpy as np

from serving.http.streams import ChunkStream
from serving.sampling import Chunk, GenerationRequest, join_chunks

# OpenAI's whisper (transcribe.py: transcribe()'s defaults and the CLI's
# --temperature_increment_on_fallback); transformers' generate takes the same values
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
INCREMENT = 0.2
COMPRESSION_RATIO_THRESHOLD = 2.4  # more: too repetitive
LOGPROB_THRESHOLD = -1.0  # less: too unsure
NO_SPEECH_THRESHOLD = 0.6  # more, with a log-prob under LOGPROB_THRESHOLD: silence


@dataclass(frozen=True)
class Scores:
    """A try's numbers, as whisper's DecodingResult has them (and verbose_json reports)."""

    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


def compression_ratio(text: str) -> float:
    """Whisper's measure of repetition: the text's UTF-8 bytes over their zlib-compressed
    bytes (0 for no text)."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def needs_fallback(s: Scores) -> bool:
    """Whether a try is redone at the next temperature (decode_with_fallback)."""
    failed = (s.compression_ratio > COMPRESSION_RATIO_THRESHOLD
              or s.avg_logprob < LOGPROB_THRESHOLD)
    silence = s.no_speech_prob > NO_SPEECH_THRESHOLD and s.avg_logprob < LOGPROB_THRESHOLD
    return failed and not silence


def is_silence(s: Scores) -> bool:
    """Whether a kept window's text is left out (transcribe's no-speech skip: a log-prob
    over the threshold keeps it whatever the no-speech probability)."""
    return s.no_speech_prob > NO_SPEECH_THRESHOLD and not s.avg_logprob > LOGPROB_THRESHOLD


def temperatures(asked: float, increment: float | None = INCREMENT) -> tuple[float, ...]:
    """The temperatures a window may be decoded at: one try for a temperature over 0 (as
    OpenAI's API, and whisper given one temperature) or without an increment (whisper's
    --temperature_increment_on_fallback None); else 0, then up by the increment to 1."""
    if asked > 0 or increment is None:
        return (asked,)
    return tuple(round(t, 6) for t in np.arange(0.0, 1.0 + 1e-6, increment))


def seed_of(features: np.ndarray, temperature: float) -> int:
    """A sampled try's seed: SHA-256 of its window's log-mel features (float32 bytes) and
    the temperature ("0.2"), its first 8 bytes."""
    digest = hashlib.sha256(np.ascontiguousarray(features, np.float32).tobytes())
    digest.update(f"{temperature:g}".encode())
    return int.from_bytes(digest.digest()[:8], "little")


def at(request: GenerationRequest, temperature: float) -> GenerationRequest:
    """`request` at `temperature`: greedy at 0, else sampled with its window's seed."""
    seed = None if temperature == 0 else seed_of(request.encoder_input, temperature)
    return replace(request, sampling=replace(request.sampling, temperature=temperature,
                                             seed=seed))


@dataclass(frozen=True)
class Window:
    """A window's kept try: its output without the end token, its scores, the temperature
    that made it and how many tries it took."""

    chunk: Chunk
    scores: Scores
    temperature: float
    tries: int

    @property
    def silent(self) -> bool:
        return is_silence(self.scores)


def scored(whole: Chunk, ends: frozenset[int], text: Callable[[Sequence[int]], str],
           temperature: float, tries: int) -> Window:
    """A try (its whole output: the end token, when one ended it, sent as a stop sequence
    with its log-prob) as a Window. The average log-prob is whisper's: every sampled
    token's, the end token's included, over the text tokens + 1 (so also when the length
    cut the try off)."""
    ended = bool(whole.ids) and whole.reason == "stop" and whole.ids[-1] in ends
    ids = whole.ids[:-1] if ended else whole.ids
    logprobs = whole.logprobs or ()
    scores = Scores(avg_logprob=sum(logprobs) / (len(ids) + 1),
                    compression_ratio=compression_ratio(text(ids)),
                    no_speech_prob=math.exp(whole.probe[0]) if whole.probe else 0.0)
    kept = replace(whole, ids=ids, text=None,
                   logprobs=tuple(logprobs[:len(ids)]) if whole.logprobs is not None else None)
    return Window(kept, scores, temperature, tries)


class Fallback:
    """Each window of one request decoded through its tries, the windows at once: the
    first tries are submitted here (an error is the request's), the later ones as the
    earlier fail. Iterate `in_order` for the windows as they are decided, in order, or
    await `all`; `close` cancels what still runs."""

    def __init__(self, engine, requests: Sequence[GenerationRequest],
                 temperatures: Sequence[float], ends: frozenset[int],
                 text: Callable[[Sequence[int]], str]) -> None:
        self._engine, self._temperatures = engine, tuple(temperatures)
        self._ends, self._text = ends, text
        firsts: list[ChunkStream] = []
        try:
            for r in requests:
                firsts.append(ChunkStream(engine, at(r, self._temperatures[0])))
        except Exception:
            for s in firsts:
                s.close()
            raise
        self._firsts = firsts
        self._tasks = [asyncio.ensure_future(self._window(r, s))
                       for r, s in zip(requests, firsts)]
        for task in self._tasks:  # (an error is raised once, by in_order: not logged)
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _window(self, request: GenerationRequest, stream: ChunkStream) -> Window:
        for i, t in enumerate(self._temperatures):
            if i:
                stream = ChunkStream(self._engine, at(request, t))
            whole = join_chunks(await stream.collect())
            if whole.reason not in ("length", "stop"):
                raise RuntimeError(whole.detail or f"generation ended: {whole.reason}")
            window = scored(whole, self._ends, self._text, t, i + 1)
            if not needs_fallback(window.scores):
                break
        return window

    async def in_order(self) -> AsyncIterator[Window]:
        try:
            for task in self._tasks:
                yield await task
        finally:
            self.close()

    async def all(self) -> list[Window]:
        return [w async for w in self.in_order()]

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for stream in self._firsts:  # (a task cancelled before it ran)
            stream.close()
