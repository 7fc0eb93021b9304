"""From a step's logits to the chunks each stream's client gets: batched sampling (one argmax
for every greedy row; logit bias and penalties where asked), stop ids (masked out until
`min_tokens`) and bad words (masked where they would be completed), stop strings on the
output text and stop token sequences, incremental detokenizing, log-probs (with
alternatives and ranks where asked), the final chunk's reason, and the metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from serving.generation.grammar import GrammarError
from serving.sampling import (Beam, Chunk, GenerationRequest, adjust, held_back,
                              join_chunks, sample)
from serving.tokenizer import IncrementalDecoder

log = logging.getLogger("serving")


@dataclass(frozen=True)
class Scores:
    """What a stream asked to know of its sampled token, under the raw logits."""

    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None  # the k most likely (id, log-prob)
    rank: int | None = None  # how many ids score at least as high (1: the most likely)


@dataclass
class GenerationStats:
    """Counters the engine keeps (a metrics layer reads them; see serving.metrics)."""

    on_token: Callable[[float | None, float | None], None] = lambda ttft, itl: None
    on_prompt: Callable[[int], None] = lambda tokens: None  # a prompt done (its first token)
    on_step: Callable[[int, float], None] = lambda rows, seconds: None
    on_streams: Callable[[int, int], None] = lambda active, queued: None
    on_cache_usage: Callable[[float], None] = lambda share: None  # of the byte budget
    on_end: Callable[[str, float], None] = lambda reason, seconds: None
    # prompt tokens looked up in the prefix cache, and how many of them were found there
    on_prefix: Callable[[int, int], None] = lambda looked_up, hit: None
    on_preempt: Callable[[], None] = lambda: None
    # a speculative run: how many drafts it checked, and how many of them were accepted
    on_draft: Callable[[int, int], None] = lambda drafts, accepted: None


class StreamOutput:
    """What one stream has produced: its sampler, its text so far and how much was sent."""

    def __init__(self, request: GenerationRequest, tokenizer, matcher=None,
                 context: Sequence[int] | None = None) -> None:
        """`context`: the ids the output is decoded after (default: the prompt's)."""
        self.request = request
        self.matcher = matcher  # its grammar's (serving.generation.grammar), if it has one
        self.rng = np.random.default_rng(request.sampling.seed)
        self.context = request.prompt if context is None else context
        self.tokenizer = tokenizer
        self.detok = IncrementalDecoder(tokenizer, self.context) if tokenizer else None
        self.text = ""  # the output text decoded so far
        self.sent = 0  # characters of it sent
        self.generated = 0
        self.submitted = time.perf_counter()
        self.last_token_at: float | None = None
        # prompt_logprobs: prompt tokens 1.. scored so far, and whether they went out
        self.prompt_logprobs: list[float] = []
        self.prompt_top: list[tuple[tuple[int, float], ...]] = []
        self.prompt_sent = False
        self.pending: dict = {}  # Chunk fields the next chunk sent carries (a prompt probe)

    def text_of(self, ids: Sequence[int]) -> str | None:
        """Another sequence's text after the same context (a search's other beams)."""
        if self.tokenizer is None:
            return None
        detok = IncrementalDecoder(self.tokenizer, self.context)
        return "".join(detok.add(t) for t in ids) + detok.flush()

    def release(self, final: bool) -> tuple[str | None, str | None]:
        """(text to send now, the stop string that matched or None): up to the first stop
        string's match (through it with include_stop), else all but what may still become
        one (everything when `final`)."""
        if self.detok is None:
            return None, None
        stops = self.request.stop_strings
        # (held-back text means a match can only start in what was not sent)
        hits = [(i, s) for i, s in ((self.text.find(s, self.sent), s) for s in stops) if i >= 0]
        if hits:
            end, matched = min(hits, key=lambda hit: hit[0])
            end += len(matched) if self.request.include_stop else 0
        else:
            end, matched = len(self.text), None
            if not final:
                end -= held_back(self.text[self.sent:], stops)
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece, matched


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=-1, keepdims=True)
    return np.log(np.exp(x - top).sum(axis=-1)) + top[..., 0]


def log_softmax_at(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log_softmax(logits[i])[ids[i]] for each row (float64)."""
    x = logits.astype(np.float64)
    return x[np.arange(len(ids)), ids] - _logsumexp(x)


def top_logprobs(row: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely ids of one row of logits (vocab,), most likely first, each with its
    log_softmax value."""
    x = row.astype(np.float64)
    k = min(k, x.size)
    ids = np.argpartition(-x, k - 1)[:k]
    ids = ids[np.argsort(-x[ids], kind="stable")]
    lse = float(_logsumexp(x))
    return tuple((int(i), float(x[i]) - lse) for i in ids)


def banned(stream) -> list[int]:
    """The ids masked out of `stream`'s next sampling: its stop ids until `min_tokens`, and
    each bad word's last token where the sequence ends with the rest of the word."""
    r, tokens = stream.request, stream.tokens
    out = list(r.stop_ids) if r.stop_ids and stream.output.generated < r.min_tokens else []
    for word in r.bad_words:
        k = len(word) - 1  # tokens[-k:] below is the whole list when k is 0
        if k == 0 or (len(tokens) >= k and tuple(tokens[-k:]) == word[:-1]):
            out.append(word[-1])
    return out


def _ends_with_one(tokens: Sequence[int], sequences: Sequence[tuple[int, ...]]) -> bool:
    n = len(tokens)
    return any(n >= len(w) and tuple(tokens[n - len(w):]) == w for w in sequences)


class OutputProcessor:
    def __init__(self, stats: GenerationStats) -> None:
        self.stats = stats

    def sample(self, streams: Sequence, logits: np.ndarray
               ) -> tuple[list[int], list[Scores | None]]:
        """One token per stream from its row of `logits` (rows, vocab), and per stream the
        Scores it asked for (None where it asked for none)."""
        work = logits
        for i, s in enumerate(streams):
            sampling, matcher = s.request.sampling, s.output.matcher
            ids = [t for t in banned(s) if 0 <= t < logits.shape[1]
                   and (matcher is None or t not in matcher.eos)]  # a grammar ends itself
            if ids or sampling.adjusts or matcher is not None:
                if work is logits:  # the raw logits stay for the log-probs
                    work = logits.copy()
                if sampling.adjusts:
                    adjust(work[i], sampling, s.request.prompt,
                           s.tokens[len(s.request.prompt):])
                work[i, ids] = -np.inf
                if matcher is not None:
                    matcher.restrict(work[i])
        tokens = np.argmax(work, axis=1).tolist()  # every greedy row at once (first maximum)
        for i, s in enumerate(streams):
            if not s.request.sampling.greedy:
                tokens[i] = sample(work[i], s.request.sampling, s.output.rng)
        return tokens, self._scores(streams, logits, tokens)

    @staticmethod
    def _scores(streams: Sequence, logits: np.ndarray, tokens: list[int]
                ) -> list[Scores | None]:
        asked = [r.logprobs or r.top_logprobs or r.ranks for r in (s.request for s in streams)]
        if not any(asked):  # the usual case: nothing beyond the token, nothing computed
            return [None] * len(streams)
        logprobs = log_softmax_at(logits, np.asarray(tokens))
        out: list[Scores | None] = []
        for i, s in enumerate(streams):
            r = s.request
            out.append(None if not asked[i] else Scores(
                float(logprobs[i]) if r.logprobs else None,
                top_logprobs(logits[i], r.top_logprobs) if r.top_logprobs else None,
                int((logits[i] >= logits[i, tokens[i]]).sum()) if r.ranks else None))
        return out

    @staticmethod
    def score_prompt(stream, start: int, logits: np.ndarray) -> None:
        """A prefill chunk's logits (n, vocab) for tokens start..start + n - 1: position j
        scores token j + 1 of the prompt. A recomputed chunk (after a preemption) finds its
        positions scored already."""
        out, prompt, k = stream.output, stream.request.prompt, stream.request.prompt_logprobs
        first = len(out.prompt_logprobs) - start  # the first position not yet scored
        ids = np.asarray(prompt[start + 1 + first:start + 1 + len(logits)])
        if first < 0 or not len(ids):
            return
        rows = logits[first:first + len(ids)]
        out.prompt_logprobs += log_softmax_at(rows, ids).tolist()
        if k:
            out.prompt_top += [top_logprobs(row, k) for row in rows]

    def emit(self, stream, token: int, scores: Scores | None = None) -> None:
        """A new token of `stream`: the stream ends (stream.done) on a stop or its length."""
        out, request = stream.output, stream.request
        now = time.perf_counter()
        ttft = now - out.submitted if out.last_token_at is None else None
        if ttft is not None:
            self.stats.on_prompt(len(request.prompt))
        itl = None if out.last_token_at is None else now - out.last_token_at
        out.last_token_at = now
        if token in request.stop_ids and out.generated >= request.min_tokens:
            self.finish(stream, "stop")
            return
        try:
            complete = out.matcher is not None and out.matcher.advance(token)
        except GrammarError as e:
            self.finish(stream, "error", str(e))
            return
        if complete and token in out.matcher.eos:  # the end where the grammar allows it
            self.finish(stream, "stop")
            return
        stream.tokens.append(token)
        out.generated += 1
        self.stats.on_token(ttft, itl)
        if out.detok is not None:
            out.text += out.detok.add(token)
        stopped = (out.generated >= request.min_tokens
                   and _ends_with_one(stream.tokens, request.stop_sequences))
        last = out.generated >= request.max_tokens or complete or stopped
        if last and out.detok is not None:
            out.text += out.detok.flush()
        piece, matched = out.release(final=last)
        asked = {} if scores is None else dict(  # None: the stream asked for no scores
            logprobs=(scores.logprob,) if request.logprobs else None,
            top_logprobs=(scores.top,) if request.top_logprobs else None,
            ranks=(scores.rank,) if request.ranks else None)
        if matched is not None or last:
            self._end(stream, Chunk((token,), piece, True, "stop" if matched is not None or
                                    complete or stopped else "length", stop=matched, **asked))
        else:
            self._send(stream, Chunk((token,), piece, **asked))

    def answer(self, stream, sequences: Sequence[tuple[int, ...]]) -> None:
        """A beam search's answer: its best sequence, token by token as a stream sends
        them (it ends at an end token or the length); where it asked for more than one, the
        whole as one final chunk that carries them all (`Chunk.beams`)."""
        if len(sequences) == 1:
            self._emit_all(stream, sequences[0])
            return
        sent: list[Chunk] = []
        deliver, stream.on_chunk = stream.on_chunk, sent.append  # the pieces kept, joined
        try:
            self._emit_all(stream, sequences[0])
        finally:
            stream.on_chunk = deliver
        beams = tuple(self._beam(stream, s) for s in sequences)
        self._deliver(stream, replace(join_chunks(sent), beams=beams))

    def _emit_all(self, stream, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.emit(stream, token)
            if stream.done:
                return
        self.finish(stream, "length")

    @staticmethod
    def _beam(stream, sequence: tuple[int, ...]) -> Beam:
        """A returned sequence as a stream would have sent it: cut before an end token."""
        stops = stream.request.stop_ids
        ended = next((i for i, t in enumerate(sequence) if t in stops), None)
        ids = sequence if ended is None else sequence[:ended]
        return Beam(ids, stream.output.text_of(ids), "length" if ended is None else "stop")

    def finish(self, stream, reason: str, detail: str = "") -> None:
        """The final chunk without a new token (stop id, cancel, shutdown, error)."""
        if stream.done:
            return
        out = stream.output
        if out.detok is not None:
            out.text += out.detok.flush()
        piece, matched = out.release(final=True)
        r = stream.request
        self._end(stream, Chunk((), piece, True, "stop" if matched is not None else reason,
                                "" if matched is not None else detail, stop=matched,
                                logprobs=() if r.logprobs else None,
                                top_logprobs=() if r.top_logprobs else None,
                                ranks=() if r.ranks else None))

    def _end(self, stream, chunk: Chunk) -> None:
        stream.done = True
        self._send(stream, replace(chunk, cached=stream.prefix_hit))
        self.stats.on_end(chunk.reason or "", time.perf_counter() - stream.output.submitted)

    def _send(self, stream, chunk: Chunk) -> None:
        out, k = stream.output, stream.request.prompt_logprobs
        if k is not None and not out.prompt_sent and (
                len(out.prompt_logprobs) == len(stream.request.prompt) - 1):
            chunk = replace(chunk, prompt_logprobs=tuple(out.prompt_logprobs),
                            prompt_top_logprobs=tuple(out.prompt_top) if k else None)
            out.prompt_sent = True
        if out.pending:
            chunk, out.pending = replace(chunk, **out.pending), {}
        self._deliver(stream, chunk)

    @staticmethod
    def _deliver(stream, chunk: Chunk) -> None:
        try:
            stream.on_chunk(chunk)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the others
            log.exception("delivering a chunk failed; cancelling that stream")
            stream.cancelled.set()
