"""The audio API's timestamped answers, from each piece's whole output: OpenAI's
`verbose_json` (segments with their times, ids and scores), SRT and WebVTT subtitles
(written as OpenAI's whisper package writes them). No HTTP here."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

from serving.generation.timestamps import Segment, TimestampRule, segments
from serving.sampling import Chunk


@dataclass(frozen=True)
class Piece:
    """One window of the audio and its whole output."""

    chunk: Chunk  # every chunk of its stream joined (serving.sampling.join_chunks)
    offset: float  # where it starts in the audio, seconds
    duration: float  # seconds
    seek: int  # its first frame (Whisper's 100 per second: OpenAI's `seek`)


@dataclass(frozen=True)
class Timed:
    """A segment and its text."""

    piece: Piece
    segment: Segment
    text: str


def timed(pieces: Sequence[Piece], rule: TimestampRule,
          decode: Callable[[list[int]], str]) -> list[Timed]:
    """Every piece's segments, in order."""
    return [Timed(p, s, decode(list(s.text_ids)))
            for p in pieces for s in segments(p.chunk.ids, rule, p.offset, p.duration)]


def joined(text: str, piece: str) -> str:
    """`piece` as it follows `text`: a space between them unless one is there (Whisper's
    tokens carry their leading space; a tokenizer's decode of a piece may not)."""
    if not text or not piece or text[-1:].isspace() or piece[:1].isspace():
        return piece
    return " " + piece


def text_of(parts: Sequence[Timed]) -> str:
    text = ""
    for t in parts:
        text += joined(text, t.text)
    return text.strip()


def _compression_ratio(text: str) -> float:
    """OpenAI's measure of repetition: the text's bytes over its zlib-compressed bytes."""
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def _piece_scores(piece: Piece, decode: Callable[[list[int]], str], rule: TimestampRule
                  ) -> dict:
    """A piece's scores, which all its segments carry (as OpenAI's, one per window): the
    mean log-prob of its tokens, its text's compression ratio, and the probability of
    <|nospeech|> at the start token (the probe)."""
    c = piece.chunk
    logprobs = c.logprobs or ()
    return {"avg_logprob": sum(logprobs) / len(logprobs) if logprobs else 0.0,
            "compression_ratio": _compression_ratio(decode([t for t in c.ids
                                                            if t < rule.begin])),
            "no_speech_prob": math.exp(c.probe[0]) if c.probe else 0.0}


def verbose(parts: Sequence[Timed], pieces: Sequence[Piece], rule: TimestampRule,
            decode: Callable[[list[int]], str], *, task: str, language: str,
            seconds: float, temperature: float) -> dict:
    """OpenAI's verbose_json body (without usage)."""
    scores = {id(p): _piece_scores(p, decode, rule) for p in pieces}
    return {"task": task, "language": language, "duration": round(seconds, 3),
            "text": text_of(parts),
            "segments": [{"id": i, "seek": t.piece.seek, "start": round(t.segment.start, 3),
                          "end": round(t.segment.end, 3), "text": t.text,
                          "tokens": list(t.segment.ids), "temperature": temperature,
                          **scores[id(t.piece)]} for i, t in enumerate(parts)]}


def _clock(seconds: float, marker: str, hours: bool) -> str:
    ms = round(seconds * 1000)
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{f'{h:02d}:' if hours or h else ''}{m:02d}:{s:02d}{marker}{ms:03d}"


def _cue(t: Timed, marker: str, hours: bool) -> str:
    return (f"{_clock(t.segment.start, marker, hours)} --> "
            f"{_clock(t.segment.end, marker, hours)}\n{t.text.strip().replace('-->', '->')}\n")


def srt(parts: Sequence[Timed]) -> str:
    return "".join(f"{i}\n{_cue(t, ',', True)}\n" for i, t in enumerate(parts, 1))


def vtt(parts: Sequence[Timed]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_cue(t, '.', False)}\n" for t in parts)
