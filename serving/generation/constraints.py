"""What an encoder-decoder's generation config forbids or forces at a step, applied to a
step's logits as transformers' logits processors apply them: `suppress_tokens` (and a
one-token `bad_words_ids`) never, `begin_suppress_tokens` not first, `forced_bos_token_id`
the only first token, `no_repeat_ngram_size`, and, for a stream that asked for them,
Whisper's timestamp rule (serving/generation/timestamps.py), last, as it weighs what the
others left. The sampled rows' constraints and a beam search's (on log-probs) differ only
in how a forced token is kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from serving.generation.beams import BeamConfig, log_softmax
from serving.generation.output import banned
from serving.generation.timestamps import TimestampRule, constrain


@dataclass(frozen=True)
class DecoderConfig:
    """What config.json and generation_config.json say about the decoder's ids."""

    start: int  # decoder_start_token_id: the first step's input (a text source's)
    pad: int  # what a short source is padded with (masked out)
    suppress: tuple[int, ...] = ()  # never generated (Whisper's suppress_tokens, Marian's
    # one-token bad_words_ids: its pad)
    begin_suppress: tuple[int, ...] = ()  # not as the first token (begin_suppress_tokens)
    forced_first: int | None = None  # the only first token (forced_bos_token_id: mBART's
    # target language)
    beams: BeamConfig = BeamConfig(1)  # num_beams and its settings: greedy requests' default
    no_repeat_ngram: int = 0  # no_repeat_ngram_size: no n-gram of the decoder's ids twice
    timestamps: TimestampRule | None = None  # Whisper's timestamp tokens, which a request
    # for timestamps is generated under


def repeated_ngram_bans(ids: Sequence[int], n: int) -> list[int]:
    """The tokens that would complete an n-gram `ids` (the decoder's ids so far, its first
    tokens included) already holds, as transformers' NoRepeatNGramLogitsProcessor bans
    them: those that followed its last n - 1 ids where they stood before."""
    if n < 1 or len(ids) + 1 < n:
        return []
    tail = tuple(ids[len(ids) + 1 - n:]) if n > 1 else ()
    return [ids[i + n - 1] for i in range(len(ids) - n + 1)
            if tuple(ids[i:i + n - 1]) == tail]


class Constraints:
    def __init__(self, decoder: DecoderConfig, vocab: int) -> None:
        self.decoder, self.vocab = decoder, vocab

    def _fixed(self, first: bool) -> tuple[list[int], int | None]:
        """(the ids the generation config suppresses, the one it forces or None) at this
        step."""
        d = self.decoder
        bans = [t for t in (*d.suppress, *(d.begin_suppress if first else ()))
                if 0 <= t < self.vocab]
        forced = d.forced_first if first else None
        return bans, forced if forced is not None and 0 <= forced < self.vocab else None

    def _ngram_bans(self, scores: np.ndarray, decoded: Sequence[Sequence[int]]) -> None:
        n = self.decoder.no_repeat_ngram
        for row, ids in enumerate(decoded if n else ()):
            scores[row, repeated_ngram_bans(ids, n)] = -np.inf

    def sampled(self, logits: np.ndarray, first: bool, streams: Sequence,
                decoded: Callable[[object], Sequence[int]]) -> np.ndarray:
        """Sampled rows' logits (a copy where anything changes): the banned ids at -inf (and
        each row's repeated n-grams, `decoded(stream)` its decoder ids so far), only the
        forced one left; then a timestamped stream's rule."""
        bans, forced = self._fixed(first)
        stamped = [i for i, s in enumerate(streams) if s.request.timestamps]
        if not (bans or forced is not None or self.decoder.no_repeat_ngram or stamped):
            return logits
        logits = logits.copy()
        logits[:, bans] = -np.inf
        if self.decoder.no_repeat_ngram:
            self._ngram_bans(logits, [decoded(s) for s in streams])
        if forced is not None:
            keep = logits[:, forced].copy()
            logits[:] = -np.inf
            logits[:, forced] = keep
        for i in stamped:  # (its end token held back first, as transformers' min-length)
            s = streams[i]
            logits[i, [t for t in banned(s) if 0 <= t < self.vocab]] = -np.inf
            constrain(logits[i], s.tokens[len(s.request.prompt):], self.decoder.timestamps)
        return logits

    def beamed(self, logits: np.ndarray, first: bool, decoded: Sequence[Sequence[int]],
               held: Sequence[int] = ()) -> np.ndarray:
        """A beam search's log-probs: of the raw logits, then the constraints on them (-inf;
        the forced token 0; `held`, its end tokens before min_tokens, -inf; each beam's
        repeated n-grams, `decoded` its ids so far)."""
        scores = log_softmax(logits)
        bans, forced = self._fixed(first)
        scores[:, bans + [t for t in held if 0 <= t < self.vocab]] = -np.inf
        self._ngram_bans(scores, decoded)
        if forced is not None:
            scores[:] = -np.inf
            scores[:, forced] = 0.0
        return scores
