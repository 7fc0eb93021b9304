"""The audio API's timestamped answers, from each piece's kept output: OpenAI's
`verbose_json` (segments with their times, ids, scores and the temperature that made them),
SRT and WebVTT subtitles (written as OpenAI's whisper package writes them). No HTTP here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

from serving.generation.timestamps import Segment, TimestampRule, segments
from serving.http.fallback import Scores
from serving.sampling import Chunk


@dataclass(frozen=True)
class Piece:
    """One window of the audio and its kept output (serving.http.fallback.Window)."""

    chunk: Chunk  # its ids (without the end token), joined
    offset: float  # where it starts in the audio, seconds
    duration: float  # seconds
    seek: int  # its first frame (Whisper's 100 per second: OpenAI's `seek`)
    scores: Scores  # the window's, which all its segments carry (as OpenAI's)
    temperature: float  # the one its kept try was made at


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


def verbose(parts: Sequence[Timed], *, task: str, language: str, seconds: float) -> dict:
    """OpenAI's verbose_json body (without usage)."""
    return {"task": task, "language": language, "duration": round(seconds, 3),
            "text": text_of(parts),
            "segments": [{"id": i, "seek": t.piece.seek, "start": round(t.segment.start, 3),
                          "end": round(t.segment.end, 3), "text": t.text,
                          "tokens": list(t.segment.ids), "temperature": t.piece.temperature,
                          **asdict(t.piece.scores)} for i, t in enumerate(parts)]}


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
