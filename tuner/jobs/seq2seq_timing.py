"""What `tuner optimize FOLDER` times: one request of an encoder-decoder as the server runs it
(serving.generation.seq2seq): the encoder on a cohort's sources, the first-step decoder on
the start token, then one with-past step per generated token, each fed the presents of the
step before and the first step's cross keys/values. The feeds come from the one home of
them (tuner.gate.seq2seq_steps), so a variant is timed on the runs it will be served with.

    traffic = seq2seq_traffic(requests, max_seq, streams, record)
    request = RequestTimer(record, runners, traffic)   # feeds made once, per variant
    ms = request()                                     # one request, its parts in .parts

Tokens are teacher-forced (random ids): a step's time does not depend on which token it
reads, and a fixed count of steps keeps every variant's request the same length."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.gate.seq2seq_steps import caches_after, decoder_feeds, source_feeds
from tuner.graph.seq2seq_record import Seq2SeqRecord
from tuner.jobs.decoder import DEFAULT_OUTPUT_TOKENS, token_requests

DEFAULT_SOURCE_TOKENS = 32  # a sentence: what a translation or summary request sends
PARTS = ("encoder", "first step", "later steps")


@dataclass(frozen=True)
class Seq2SeqTraffic:
    """The request every variant is timed on."""

    batch: int  # sources encoded and decoded together (the server's cohort: --streams)
    source: int | None  # source tokens; None: an audio encoder's one shape (bins, frames)
    output: int  # tokens generated: the first step, then output - 1 with-past steps
    note: str


def seq2seq_traffic(requests: Path | None, max_seq: int | None, streams: int,
                    record: Seq2SeqRecord) -> Seq2SeqTraffic:
    """The median source and mean output of a JSONL traffic file ({"prompt_tokens": 40,
    "output_tokens": 20} per request), else --max-seq (or DEFAULT_SOURCE_TOKENS) source
    tokens and DEFAULT_OUTPUT_TOKENS out; both held to the model's positions."""
    rows = token_requests(requests) if requests is not None else None
    if requests is not None and rows is None:
        raise BadInput(f"{requests.name}: an encoder-decoder's traffic is JSONL naming "
                       'prompt_tokens and output_tokens, e.g. {"prompt_tokens": 40, '
                       '"output_tokens": 20}')
    if rows:
        source = int(np.median([p for _, p, _ in rows]))
        output = int(round(float(np.mean([o for _, _, o in rows]))))
        note = f"{requests.name}: {len(rows)} requests, median source {source}, mean output {output}"
    else:
        source, output = max_seq or DEFAULT_SOURCE_TOKENS, DEFAULT_OUTPUT_TOKENS
        note = f"no requests file: {source} source tokens, {output} output tokens"
    if record.encoder.max_positions:
        source = min(source, record.encoder.max_positions)
    if record.max_positions:
        output = min(output, record.max_positions)
    audio = record.encoder.features is not None
    if audio:
        bins, frames = record.encoder.features
        note = note.split(":")[0] + f": audio features ({bins} x {frames}), {output} output tokens"
    return Seq2SeqTraffic(streams, None if audio else source, max(output, 1),
                          note + f", {streams} stream(s) at once")


class RequestTimer:
    """One variant's request: call it to run one (its milliseconds); `parts` holds each run's
    (encoder, first step, later steps) milliseconds, in call order."""

    def __init__(self, record: Seq2SeqRecord, runners: Sequence, traffic: Seq2SeqTraffic,
                 start: int = 0, seed: int = 0) -> None:
        self.record, (self.encoder, self.first, self.later) = record, runners
        rng = np.random.default_rng(seed)
        b, vocab = traffic.batch, record.vocab
        sources = ([rng.uniform(-1, 1, record.encoder.features) for _ in range(b)]
                   if traffic.source is None else
                   [rng.integers(min(4, vocab - 1), vocab, traffic.source) for _ in range(b)])
        self.feeds, self.mask = source_feeds(record, sources, pad=0)
        self.tokens = np.concatenate(
            [np.full((b, 1), start), rng.integers(0, vocab, (b, traffic.output - 1))], 1)
        self.parts: list[tuple[float, float, float]] = []

    def __call__(self) -> float:
        r = self.record
        t0 = _now()
        states = self.encoder.infer(self.feeds)[r.encoder.output]
        t1 = _now()
        out = self.first.infer(decoder_feeds(r.first, self.tokens[:, :1], self.mask, states))
        t2 = _now()
        own, cross = caches_after(r.later, out)
        for i in range(1, self.tokens.shape[1]):
            out = self.later.infer(decoder_feeds(r.later, self.tokens[:, i:i + 1], self.mask,
                                                 states, {**own, **cross}))
            own, cross = caches_after(r.later, out, cross)
        t3 = _now()
        self.parts.append((t1 - t0, t2 - t1, t3 - t2))
        return t3 - t0


def _now() -> float:
    return time.perf_counter() * 1e3
