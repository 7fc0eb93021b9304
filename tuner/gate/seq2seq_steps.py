"""An encoder-decoder's steps (tuner.graph.seq2seq_record): the feeds of each of its three
graphs, the one home of them (the server's loop, serving.generation.seq2seq, and the check
below build them here), and the check a server runs before it generates: the cache path
(the first step, then the with-past decoder fed its own presents and the first step's cross
keys/values) gives the logits the first-step decoder gives run on the whole sequence at once.

The check proves the three graphs make one cache path (a with-past decoder from another
export, padded apart, or corrupted FAILS); it does not compare with an original: that is
`tuner verify SRC OUT`. Where the decoders quantize their activations per run, the cache path
cannot be exact as served: tuner.gate.seq2seq_quantized judges the same probe otherwise."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from tuner.gate.verify import Stats, Tolerance, VerifyResult
from tuner.graph.merged import FLAG
from tuner.graph.seq2seq_record import DecoderIO, Seq2SeqRecord

Arrays = Mapping[str, np.ndarray]


def source_feeds(record: Seq2SeqRecord, sources: Sequence, pad: int
                 ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The encoder's feeds for rows of sources, and the mask (B, S) the decoders take too
    (None for an audio encoder, which takes none). Token ids are right-padded with `pad`
    and masked out; features (bins, frames) are stacked."""
    enc = record.encoder
    if enc.features is not None:
        return {enc.source: np.stack(sources).astype(enc.source_dtype)}, None
    longest = max(len(s) for s in sources)
    ids = np.full((len(sources), longest), pad, dtype=enc.source_dtype)
    mask = np.zeros((len(sources), longest), dtype=enc.mask_dtype or "int64")
    for i, s in enumerate(sources):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    feeds = {enc.source: ids}
    if enc.mask is not None:
        feeds[enc.mask] = mask
    return feeds, mask


def decoder_feeds(io: DecoderIO, tokens: np.ndarray, mask: np.ndarray | None,
                  states: np.ndarray | None, caches: Arrays = {}) -> dict[str, np.ndarray]:
    """A decoder's feeds: token ids (B, n), the encoder's mask and states where `io` takes
    them, and (the with-past graph) its caches by input name."""
    feeds = {io.token_ids: np.asarray(tokens, dtype=io.ids_dtype)}
    if io.mask is not None:
        feeds[io.mask] = mask.astype(io.mask_dtype)
    if io.states is not None:
        feeds[io.states] = states
    return {**feeds, **caches}


def caches_after(io: DecoderIO, out: Arrays, cross: Arrays | None = None
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(own cache, cross keys/values) the with-past graph `io` takes next, from a run's
    outputs `out`; `cross`: those kept from the first step (None: this run is the first)."""
    own = {k: out[v] for k, v in io.own_past.items()}
    return own, {k: out[v] for k, v in io.cross_past.items()} if cross is None else dict(cross)


def probe(record: Seq2SeqRecord, start: int, steps: int, seed: int
          ) -> tuple[list[np.ndarray], np.ndarray]:
    """Two sources (token ids: one padded; features: random, in Whisper's range) and (2,
    steps + 1) decoder tokens: `start`, then random ones (teacher-forced: any ids do)."""
    rng = np.random.default_rng(seed)
    low, vocab = min(4, record.vocab - 1), record.vocab
    longest = min(9, record.encoder.max_positions or 9)
    sources = ([rng.uniform(-1, 1, record.encoder.features) for _ in range(2)]
               if record.encoder.features else
               [rng.integers(low, vocab, longest), rng.integers(low, vocab, max(1, longest - 4))])
    return sources, np.concatenate([np.full((2, 1), start), rng.integers(low, vocab, (2, steps))], 1)


def cache_path(record: Seq2SeqRecord, first, later, tokens: np.ndarray,
               mask: np.ndarray | None, states: np.ndarray
               ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The first-step decoder's logits for the whole of `tokens` (B, n + 1, vocab) at once,
    and each step's logits (B, 1, vocab) along the cache path: `first` on the first token,
    then `later` fed one token at a time with its own presents and the first step's cross
    keys/values."""
    whole = first.infer(decoder_feeds(record.first, tokens, mask, states))[record.first.logits]
    out = first.infer(decoder_feeds(record.first, tokens[:, :1], mask, states))
    stepped = [out[record.first.logits]]
    own, cross = caches_after(record.later, out)
    for i in range(1, tokens.shape[1]):
        out = later.infer(decoder_feeds(record.later, tokens[:, i:i + 1], mask, states,
                                        {**own, **cross}))
        stepped.append(out[record.later.logits])
        own, cross = caches_after(record.later, out, cross)
    return whole, stepped


def compare_steps(stats: Stats, name: str, whole: np.ndarray, stepped: list[np.ndarray],
                  tolerance) -> None:
    """Each step's logits against the whole sequence's at its position."""
    for i, logits in enumerate(stepped):
        stats.add(name, whole[:, i:i + 1], logits, tolerance)


def error_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def check_cache_path(record: Seq2SeqRecord, encoder, first, later,
                     tolerance: Tolerance = Tolerance(), start: int = 0, steps: int = 5,
                     seed: int = 0) -> VerifyResult:
    """Two sources (token ids: one padded; features: random, in Whisper's range) encoded, `steps` + 1 decoder tokens (`start`, then random
    ones: teacher-forced, any ids do) run whole through `first` and one at a time through
    the cache path; every step's logits compared. FAILS when nothing was compared."""
    sources, tokens = probe(record, start, steps, seed)
    stats, errors, name = Stats(), [], "cache-path logits"
    try:
        feeds, mask = source_feeds(record, sources, pad=0)
        states = encoder.infer(feeds)[record.encoder.output]
        compare_steps(stats, name, *cache_path(record, first, later, tokens, mask, states),
                      tolerance)
    except Exception as e:  # noqa: BLE001 - a graph that cannot run fails the check
        errors.append(error_line(e))
    floor = 2 * (steps + 1) * record.vocab  # every row's logits at every step
    return VerifyResult((stats.report(name, floor),), steps + 1, tolerance.label(),
                        tuple(errors), floor)


def check_branches(record: Seq2SeqRecord, encoder, first, later, merged,
                   merged_inputs: Sequence[str], flag: np.ndarray,
                   tolerance: Tolerance = Tolerance(), start: int = 0, steps: int = 3,
                   seed: int = 0) -> VerifyResult:
    """The two plain decoders made from a merged one (tuner.rewrite.unmerge.branch) against
    the merged file, step by step on the same feeds: the first step against it fed
    `use_cache_branch` False (the first step's own presents fed as the past the branch
    ignores), each later step against it fed True; every output of the plain graph
    compared. FAILS when nothing was compared."""
    sources, tokens = probe(record, start, steps, seed)
    stats: dict[str, Stats] = {}
    errors: list[str] = []
    wanted = set(merged_inputs)

    def compare(feeds: dict, plain_out: dict, extra: dict, on: np.ndarray) -> None:
        asked = {k: v for k, v in {**feeds, **extra, FLAG: on}.items() if k in wanted}
        reference = merged.infer(asked)
        for name, got in plain_out.items():
            stats.setdefault(name, Stats()).add(name, reference[name], got, tolerance)

    try:
        feeds, mask = source_feeds(record, sources, pad=0)
        states = encoder.infer(feeds)[record.encoder.output]
        step = decoder_feeds(record.first, tokens[:, :1], mask, states)
        out = first.infer(step)
        own, cross = caches_after(record.later, out)
        compare(step, out, {**own, **cross}, np.zeros_like(flag))
        for i in range(1, steps + 1):
            step = decoder_feeds(record.later, tokens[:, i:i + 1], mask, states,
                                 {**own, **cross})
            out = later.infer(step)
            compare(step, out, {record.first.states: states}, flag)
            own, cross = caches_after(record.later, out, cross)
    except Exception as e:  # noqa: BLE001 - a graph that cannot run fails the check
        errors.append(error_line(e))
    reports = tuple(s.report(name) for name, s in stats.items())
    floor = 2 * record.vocab  # (each output at least one row's worth)
    if not reports or not any(r.compared >= floor for r in reports):
        errors.append("nothing compared")
    return VerifyResult(reports, steps + 1, tolerance.label(), tuple(errors), 1)
