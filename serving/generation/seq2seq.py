"""Generation with an encoder-decoder (T5, BART, Marian as Optimum exports them:
tuner.graph.seq2seq_record): one thread, streams batched in cohorts.

A cohort is the streams admitted at one step. Its sources are encoded in one run (right-padded
to the longest, the encoder's mask zero past each row's end); the first-step decoder gives
every row its first token and the cross keys/values it keeps; every later step feeds the
cohort's last tokens and its caches to the with-past decoder. The with-past decoder takes no
mask of its own tokens, so rows of different lengths cannot share a run: every row of a
cohort is at the same step, and each cohort runs apart (one run each per step, new cohorts
formed while older ones decode). An ended row leaves its cohort at once (its rows of every
array dropped), so no run computes a finished stream. Where a row's numbers depend on the
other rows of its run (Seq2SeqRecord.rows_coupled: activations quantized per run), each
stream is a cohort of its own (its beams, rows of one search, stay together), unless
GenerateOptions.batch_variance.

    per cohort (B rows, sources up to S tokens, t tokens generated):
      encoder    ids (B, S), mask (B, S)                -> states (B, S, h)         once
      first      start ids (B, 1), states, mask         -> logits, self (B, H, 1, d), cross
      later      last ids (B, 1), mask, self (B, H, t, d), cross -> logits, self (B, H, t+1, d)
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from serving.errors import ContextTooLong, InvalidArgument
from serving.generation.admission import Admission, check_tokens
from serving.generation.beams import (BeamSearch, config_for, log_softmax, searchable,
                                      unsearchable)
from serving.generation.constraints import Constraints, DecoderConfig
from serving.generation.grammar import GrammarCompiler
from serving.generation.options import GenerateOptions
from serving.generation.output import GenerationStats, OutputProcessor
from serving.generation.scheduler import Stream
from serving.sampling import GenerationRequest
from tuner.gate.seq2seq_steps import caches_after, decoder_feeds, source_feeds
from tuner.graph.seq2seq_record import Seq2SeqRecord
from tuner.runtime.base import Runner

log = logging.getLogger("serving")

APART = ("its graphs quantize their activations with one range per run (ONNX Runtime's "
         "quantize_dynamic), so a row's numbers depend on the other rows of its run")


@dataclass(frozen=True)
class Seq2SeqRunners:
    """The three graphs' runners."""

    encoder: Runner
    first: Runner
    later: Runner

    def close(self) -> None:
        for runner in (self.encoder, self.first, self.later):
            runner.close()


class Cohort:
    """Streams at the same step, and the arrays their next run takes: one row per stream, k
    rows for a stream searched with k beams."""

    def __init__(self, streams: list[Stream]) -> None:
        self.streams = streams  # each row's stream
        self.next: list[int] = []  # each row's next input token
        self.beams: dict[Stream, BeamSearch] = {}  # the beam-searched streams' searches
        self.mask: np.ndarray | None = None  # (B, S): the encoder's
        self.states: np.ndarray | None = None  # (B, S, h), kept where later steps take it
        self.cross: dict[str, np.ndarray] = {}  # past input -> (B, H, S, d), fixed
        self.own: dict[str, np.ndarray] = {}  # past input -> (B, H, t, d), grows

    @property
    def members(self) -> list[Stream]:
        return list(dict.fromkeys(self.streams))

    def take(self, rows: list[int]) -> None:
        """These rows go on, in this order, a row taken twice where two beams continue it
        (every array stacks its rows on axis 0)."""
        self.streams = [self.streams[i] for i in rows]
        take = lambda a: None if a is None else a[rows]  # noqa: E731
        self.mask, self.states = take(self.mask), take(self.states)
        self.cross = {k: v[rows] for k, v in self.cross.items()}
        self.own = {k: v[rows] for k, v in self.own.items()}


class Seq2SeqGenerator(Admission):
    """The encoder-decoder's generation loop (see the module's docstring)."""

    detok_context = ()  # the output is a text of its own, not the source's continuation

    def __init__(self, runners: Seq2SeqRunners, record: Seq2SeqRecord, decoder: DecoderConfig,
                 options: GenerateOptions = GenerateOptions(), *, tokenizer=None,
                 eos_ids: Sequence[int] = (), stats: GenerationStats | None = None,
                 max_target: int | None = None) -> None:
        self.runners, self.record, self.decoder, self.options = runners, record, decoder, options
        self.vocab, self.tokenizer = record.vocab, tokenizer
        self.constraints = Constraints(decoder, self.vocab)
        self.grammars = GrammarCompiler(tokenizer, self.vocab, eos_ids)
        self.stats = stats or GenerationStats()
        self.output = OutputProcessor(self.stats)
        # the decoder's positions hold the start token and every token fed after it
        self.max_target = max_target or record.max_positions or 2048
        self.max_prompt = record.encoder.max_positions or options.max_prompt or 2048
        self.max_cache_len = self.max_target  # what the frontends report as the model's length
        self.cache_buckets: tuple[int, ...] = ()  # every shape as it comes (no buckets)
        self.batch_buckets: tuple[int, ...] = ()
        # a row's numbers depend on the other rows of its run (quantize_dynamic: one
        # activation range per run): each stream is then a cohort of its own, what it is
        # alone; a beam search's beams stay rows of one run, as in transformers' search
        self.rows_stay = (APART if record.rows_coupled and not options.batch_variance
                          else None)
        if self.rows_stay:
            log.warning(f"{self.rows_stay}: each stream runs in a cohort of its own")
        self.waiting: list[Stream] = []
        self.cohorts: list[Cohort] = []
        self.start()

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a text request may generate (its source takes no decoder
        position; the start token takes one)."""
        return self.max_target

    @property
    def active(self) -> int:
        return sum(len(c.members) for c in self.cohorts)

    def occupancy(self) -> tuple[int, int]:
        return self.active, len(self.waiting)

    def prefix(self, request: GenerationRequest) -> tuple[int, ...]:
        """The decoder's first tokens: the start token after a text source; after audio
        features, the request's prompt (Whisper's start, language and task tokens)."""
        return request.prompt if self.record.encoder.features else (self.decoder.start,)

    def validate(self, request: GenerationRequest) -> None:
        features = self.record.encoder.features
        source = request.encoder_input
        if features is None and source is not None:
            raise InvalidArgument("this encoder reads token ids, not features")
        if features is not None and (source is None or tuple(source.shape) != features):
            raise InvalidArgument(f"this encoder reads audio features of shape {features} "
                                  "(Whisper's log-mel spectrogram; the audio endpoints make "
                                  "it from a file)")
        n = len(request.prompt)  # (never 0: GenerationRequest refuses an empty prompt)
        if features is None and n > self.max_prompt:
            raise ContextTooLong(f"the source has {n} tokens; the encoder takes at most "
                                 f"{self.max_prompt}", n, request.max_tokens, self.max_prompt,
                                 self.max_prompt)
        limit = min(self.options.max_tokens, self.max_target - len(self.prefix(request)) + 1)
        if request.max_tokens > limit:
            raise InvalidArgument(f"max_tokens {request.max_tokens} is over the limit "
                                  f"{limit} (the decoder's positions)")
        check_tokens(request, self.vocab, self.tokenizer)
        if request.timestamps and self.decoder.timestamps is None:
            raise InvalidArgument("this model has no timestamp tokens (its generation config "
                                  "names no no_timestamps_token_id)")
        if request.prompt_probe is not None and not all(
                0 <= t < self.vocab for t in request.prompt_probe[1]):
            raise InvalidArgument(f"a probed id is outside the vocabulary (0..{self.vocab - 1})")
        self.beams_of(request)
        if request.prompt_logprobs is not None:
            raise InvalidArgument("prompt log-probs: the source is read by the encoder, which "
                                  "scores no token")

    def beams_of(self, request: GenerationRequest) -> int:
        """How many beams search for `request`: its own number, else the generation config's
        for a greedy request that asks nothing a beam search does not give (log-probs,
        grammars, penalties, sampling), else 1."""
        r, plain = request, searchable(request)
        if r.beams is None:
            return self.decoder.beams.beams if plain else 1
        if r.beams > 1 and not plain:
            raise InvalidArgument(unsearchable(r.beams))
        return r.beams

    # ---------------------------------------------------------------------------- the loop

    def _loop(self) -> None:
        while True:
            taken = self._take_submitted(lambda: bool(self.waiting or self.cohorts))
            if taken is None:
                return
            self.waiting += taken
            try:
                self._drop_ended()
                new = self._admit()
                for cohort in [c for c in self.cohorts if c is not new]:
                    self._later_step(cohort)
                self.cohorts = [c for c in self.cohorts if c.streams]
            except Exception as e:  # noqa: BLE001 - the model failed: end every stream, go on
                log.exception("generation step failed")
                for c in self.cohorts:
                    for s in c.members:
                        self._end(s, "error", f"the model failed: {type(e).__name__}: {e}")
                self.cohorts = []
            self.stats.on_streams(self.active, len(self.waiting))

    def _admit(self) -> Cohort | None:
        """A new cohort of the waiting streams the limit has room for: encoded, and its first
        tokens out."""
        room = self.options.max_streams - self.active
        if room <= 0 or not self.waiting or self._draining:
            return None
        # one cohort's first tokens are one run: as many as the first waiting stream's
        n = len(self.prefix(self.waiting[0].request))
        streams = [s for s in self.waiting if len(self.prefix(s.request)) == n][
            :1 if self.rows_stay else room]
        self.waiting = [s for s in self.waiting if s not in streams]
        cohort = Cohort(streams)
        self.cohorts.append(cohort)  # (a failing run below ends its streams with the rest)
        audio = self.record.encoder.features is not None
        feeds, cohort.mask = source_feeds(
            self.record, [s.request.encoder_input if audio else s.request.prompt
                          for s in streams], self.decoder.pad)
        cohort.states = self._run(self.runners.encoder, feeds)[self.record.encoder.output]
        first, later = self.record.first, self.record.later
        prefixes = np.asarray([self.prefix(s.request) for s in streams])
        out = self._run(self.runners.first,
                        decoder_feeds(first, prefixes, cohort.mask, cohort.states))
        cohort.own, cohort.cross = caches_after(later, out)
        self._probe(streams, out[first.logits])
        if later.states is None:
            cohort.states = None  # nothing after the first step reads them
        for s in streams:
            k = self.beams_of(s.request)
            if k > 1:
                cohort.beams[s] = BeamSearch(config_for(s.request, self.decoder.beams, k),
                                             s.request.stop_ids, s.request.max_tokens)
        self._emit(cohort, out[first.logits], first=True)
        return cohort

    def _probe(self, streams: list[Stream], logits: np.ndarray) -> None:
        """Each probing stream's log-probs at its probed prompt position (logits: (B, n,
        vocab), every first token's), sent with its first chunk."""
        for row, s in enumerate(streams):
            if s.request.prompt_probe is not None:
                at, ids = s.request.prompt_probe
                scores = log_softmax(logits[row:row + 1, at, :self.vocab])[0]
                s.output.pending["probe"] = tuple(float(scores[t]) for t in ids)

    def _later_step(self, cohort: Cohort) -> None:
        later = self.record.later
        tokens = np.asarray(cohort.next).reshape(-1, 1)
        out = self._run(self.runners.later,
                        decoder_feeds(later, tokens, cohort.mask, cohort.states,
                                      {**cohort.own, **cohort.cross}))
        cohort.own, cohort.cross = caches_after(later, out, cohort.cross)
        self._emit(cohort, out[later.logits])

    def _run(self, runner, feeds: Mapping[str, np.ndarray]) -> dict:
        began = time.perf_counter()
        out = runner.infer(feeds)
        self.stats.on_step(len(next(iter(feeds.values()))), time.perf_counter() - began)
        return out

    def _emit(self, cohort: Cohort, logits: np.ndarray, first: bool = False) -> None:
        """From the logits of each row's last position: each plain stream's next token
        (sampled, sent), each beam search's next step (its answer sent when it ends); the
        rows that go on, and their next tokens."""
        logits = logits[:, -1, :self.vocab]
        rows, tokens = [], []
        plain = [i for i, s in enumerate(cohort.streams) if s not in cohort.beams]
        if plain:
            streams = [cohort.streams[i] for i in plain]
            sampled, scores = self.output.sample(
                streams, self.constraints.sampled(logits[plain], first, streams, self._decoded))
            for i, s, token, score in zip(plain, streams, sampled, scores):
                self.output.emit(s, token, score)
                if s.done:
                    self._forget(s)
                else:
                    rows.append(i)
                    tokens.append(token)
        for s, search in list(cohort.beams.items()):
            mine = [i for i, x in enumerate(cohort.streams) if x is s]
            decoded = ([(*self.prefix(s.request), *row) for row in search.running.tolist()]
                       if self.decoder.no_repeat_ngram else [])  # (only the n-grams read it)
            held = s.request.stop_ids if search.generated < s.request.min_tokens else ()
            chosen = search.step(self.constraints.beamed(logits[mine], first, decoded, held))
            if search.done:
                del cohort.beams[s]
                self._send_all(s, search.top(s.request.returns))
            else:
                rows += [mine[c] for c in chosen]
                tokens += search.next_tokens
        cohort.take(rows)
        cohort.next = tokens

    def _decoded(self, s: Stream) -> tuple[int, ...]:
        """A plain stream's decoder ids so far: its first tokens, then what it generated."""
        return (*self.prefix(s.request), *s.tokens[len(s.request.prompt):])

    def _keep_going(self, cohort: Cohort) -> None:
        rows = [i for i, s in enumerate(cohort.streams) if not s.done]
        if len(rows) < len(cohort.streams):
            for s in [s for s in cohort.beams if s.done]:
                del cohort.beams[s]
            cohort.take(rows)
            cohort.next = [cohort.next[i] for i in rows] if cohort.next else []

    def _drop_ended(self) -> None:
        """Cancelled streams (and every stream once the grace period is over) end now; a
        waiting stream ends when the server drains."""
        for s in list(self.waiting):
            why = self._end_reason(s, running=False) or (
                ("shutdown", "the server shut down before the stream started")
                if self._draining else None)
            if why:
                self.waiting.remove(s)
                self._end(s, *why)
        for cohort in self.cohorts:
            for s in cohort.members:
                why = self._end_reason(s, running=True)
                if why:
                    self._end(s, *why)
            self._keep_going(cohort)
        self.cohorts = [c for c in self.cohorts if c.streams]

    def _end(self, s: Stream, reason: str, detail: str = "") -> None:
        self.output.finish(s, reason, detail)
        self._forget(s)
