"""Whisper's timestamp tokens: the rule its decoder generates them under, and the segments
they mark in its output.

After <|notimestamps|> in Whisper's vocabulary come the timestamps <|0.00|>, <|0.02|>, ...
<|30.00|>, one per 20 ms of the 30-s window. A decoder started without <|notimestamps|>
writes its text in segments, each between two of them:

    <|0.00|> Hello there.<|1.84|><|1.84|> How are you?<|3.10|> <end>

The rule below keeps the output in that form (transformers' WhisperTimeStampLogitsProcessor,
itself OpenAI's `ApplyTimestampRules`, tests/test_whisper_timestamps.py compares them on
random logits): timestamps in pairs except right before the end, never decreasing, a
timestamp first, and a timestamp wherever the timestamps together outweigh every text
token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class TimestampRule:
    """A Whisper model's timestamp tokens (generation_config.json)."""

    no_timestamps: int  # <|notimestamps|>: <|0.00|> is the id after it
    eos: int  # the end token: after a lone timestamp only it or a timestamp (or an id
    # above it: the special tokens) may follow
    max_initial: int | None = None  # max_initial_timestamp_index: the first timestamp's
    # latest step (50: 1 s)
    precision: float = 0.02  # seconds per step

    @property
    def begin(self) -> int:
        return self.no_timestamps + 1

    def seconds(self, token: int) -> float:
        return (token - self.begin) * self.precision


def _logsumexp(x: np.ndarray) -> float:
    top = x.max(initial=-np.inf)
    return float(top) if top == -np.inf else float(np.log(np.exp(x - top).sum()) + top)


def constrain(scores: np.ndarray, generated: Sequence[int], rule: TimestampRule) -> None:
    """One row of next-token scores (vocab,), set to -inf in place where the rule forbids,
    given what this row generated after its first tokens."""
    begin = rule.begin
    scores[rule.no_timestamps] = -np.inf
    last = len(generated) >= 1 and generated[-1] >= begin
    penultimate = len(generated) < 2 or generated[-2] >= begin
    if last:
        if penultimate:  # a pair just closed: text next
            scores[begin:] = -np.inf
        else:  # a lone timestamp: another (the pair) or the end
            scores[:rule.eos] = -np.inf
    stamps = [t for t in generated if t >= begin]
    if stamps:  # never decreasing; a closed segment's end is not repeated as a start alone
        floor = stamps[-1] if last and not penultimate else stamps[-1] + 1
        scores[begin:floor] = -np.inf
    if not generated:  # a timestamp first, and not later than max_initial
        scores[:begin] = -np.inf
        if rule.max_initial is not None:
            scores[begin + rule.max_initial + 1:] = -np.inf
    # the timestamps together outweigh every text token: log-softmax on both sides of
    # transformers' comparison subtracts the same total, so it is left out (and the exp runs
    # over the timestamps only)
    stamps_total = _logsumexp(scores[begin:].astype(np.float64))
    if stamps_total > -np.inf and stamps_total > scores[:begin].max(initial=-np.inf):
        scores[:begin] = -np.inf


@dataclass(frozen=True)
class Segment:
    """Text between two timestamps, in seconds of the whole audio."""

    start: float
    end: float
    ids: tuple[int, ...]  # its ids, the timestamps that bound it included (OpenAI's `tokens`)
    text_ids: tuple[int, ...]  # the ids of its text


def segments(ids: Sequence[int], rule: TimestampRule, offset: float = 0.0,
             duration: float | None = None) -> list[Segment]:
    """The segments of one window's output `ids` (end token removed), its audio starting at
    `offset` seconds and lasting `duration` (None: the window's 30 s): each segment's text
    from the timestamp before it to the one after; text after the last timestamp (cut short
    by a length limit) ends where the audio does. Times are held to [offset, offset +
    duration]; segments without text are left out."""
    window = duration if duration is not None else 30.0
    out: list[Segment] = []
    start, held, text = 0.0, [], False  # the open segment: its start, ids, whether it has text
    for token in ids:
        if token < rule.begin:
            held.append(token)
            text = True
        elif text:  # the timestamp that closes the segment (the next starts there too)
            out.append(_segment(start, rule.seconds(token), [*held, token], rule, offset,
                                window))
            start, held, text = rule.seconds(token), [], False
        else:  # the timestamp that opens the next
            start, held = rule.seconds(token), [token]
    if text:
        out.append(_segment(start, window, held, rule, offset, window))
    return out


def _segment(start: float, end: float, ids: list[int], rule: TimestampRule, offset: float,
             window: float) -> Segment:
    start, end = min(max(start, 0.0), window), min(max(end, 0.0), window)
    return Segment(offset + start, offset + max(start, end), tuple(ids),
                   tuple(t for t in ids if t < rule.begin))
