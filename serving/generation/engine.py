"""The generation engine: one thread that loops schedule -> run -> emit over every stream,
in-flight batching on a decoder exported with its KV cache. Each iteration, between two
model runs:
  1. streams that were cancelled (or whose client went away) end, freeing their cache;
  2. the scheduler plans the step (decode rows, prefill chunks, preemptions);
  3. one run decodes every decoding stream (a batch of one token each, the cache written
     in place; a stream decoding alone may feed drafts after its token, checked in the same
     run: speculation, serving.generation.speculate), one run feeds the prefill chunks (a
     prompt's last chunk gives its first token); the output processor samples and sends
     the chunks;
  4. the beam searches, where some run, take one step: their beams are a batch of their
     own (serving.generation.beam_decode).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Sequence

from serving.errors import ContextTooLong, InvalidArgument
from serving.generation.admission import Admission, check_tokens
from serving.generation.beam_decode import BeamRuns, refusal
from serving.generation.beams import BeamConfig
from serving.generation.cache import CacheManager
from serving.generation.grammar import GrammarCompiler
from serving.generation.options import (GenerateOptions, cache_budget, cache_buckets,
                                        next_bucket)
from serving.generation.output import GenerationStats, OutputProcessor
from serving.generation.runner import StepRunner
from serving.generation.scheduler import Scheduler, StepPlan, Stream
from serving.generation.speculate import propose
from serving.sampling import GenerationRequest
from tuner.gate.row_moves import MOVED, RowProbe
from tuner.gate.verify import Tolerance
from tuner.graph.cache_record import CacheRecord

log = logging.getLogger("serving")


def _rows_stay(probe: RowProbe, apart: bool = True) -> str | None:
    """Why rows of this graph may not share a run, found by running it, or None. `apart`
    False: rows whose numbers depend on their neighbours may share runs all the same
    (GenerateOptions.batch_variance); a moved row's wrong positions never may."""
    if not probe.rows_move():
        return MOVES
    if apart and not probe.rows_apart():
        return APART
    return None


MOVES = "this graph's positions follow its cache's length (a moved row's logits change)"
# Such a graph's numbers for a token depend on every token of its run, its own row's too: a
# prompt whose prefix came from the prefix cache and whose rest ran as a chunk generated
# other tokens than the same prompt run whole (the same request sent twice, dynamic int8
# Llama), so its prefixes are not reused either.
APART = ("a row's logits change beside another row (its activations quantized with one range "
         "per run, or a kernel that runs a batch of rows another way than one row)")
NO_DRAFTS = ("this graph's logits change when the entries of rejected drafts are masked out "
             "(a sliding window or biases by slot, positions from its cache's length, or "
             "activations quantized per run): no speculation")


class Generator(Admission):
    """Owns the scheduler, the cache and the one thread that runs the model."""

    def __init__(self, runner, record: CacheRecord, vocab: int,
                 options: GenerateOptions = GenerateOptions(), *,
                 max_positions: int | None = None, batch_buckets: Sequence[int] = (),
                 tokenizer=None, eos_ids: Sequence[int] = (),
                 stats: GenerationStats | None = None, pad_to: str = "longest",
                 search: BeamConfig = BeamConfig(1),
                 rows_tolerance: Tolerance = MOVED) -> None:
        if pad_to not in ("bucket", "longest"):
            raise ValueError(f"pad_to must be bucket or longest, not {pad_to!r}")
        if record.attention_mask is None:
            raise ValueError("generation needs an attention mask input (batch, past + seq)")
        record.past_to_present  # BadInput when a layer's cache is not returned
        self.batch_buckets = tuple(options.batch_buckets or batch_buckets)
        # why streams may not share runs (tuner.gate.row_moves), or None: then every stream
        # runs alone, never padded
        probe = RowProbe(runner, record, record.batch or next_bucket(1, self.batch_buckets),
                         rows_tolerance)  # runs the graph only when asked, each run once
        self.rows_stay = _rows_stay(probe, not options.batch_variance
                                    ) if options.max_streams > 1 else None
        if self.rows_stay:
            options, pad_to = replace(options, max_streams=1), "longest"
            if self.rows_stay == APART:
                options = replace(options, prefix_cache=False)
            log.warning(f"{self.rows_stay}: one stream runs at a time"
                        + (", no prefix reused" if self.rows_stay == APART else ""))
        self.record, self.vocab, self.options = record, vocab, options
        self.tokenizer, self.pad_to = tokenizer, pad_to
        self.grammars = GrammarCompiler(tokenizer, vocab, eos_ids)  # structured output
        self.stats = stats or GenerationStats()
        self.max_cache_len = options.max_cache_len or max_positions or 2048
        if max_positions is not None and self.max_cache_len > max_positions:
            raise ValueError(f"max cache length {self.max_cache_len} exceeds the model's "
                             f"{max_positions} positions")
        self.max_prompt = min(options.max_prompt or self.max_cache_len - 1,
                              self.max_cache_len - 1)
        self.cache_buckets = cache_buckets(self.max_cache_len, options.cache_buckets)
        self.budget = cache_budget(options)
        self.cache = CacheManager(record, self.budget.bytes, pad_to, self.batch_buckets,
                                  self.cache_buckets,
                                  options.prefix_block if options.prefix_cache else None,
                                  self.max_cache_len,
                                  shared=options.share_buffers and record.rows_at_start,
                                  max_rows=options.max_streams)
        # masked slots before a prompt chunk: found by running, where chunks may share runs
        holes = record.window is None and (options.max_streams == 1 or probe.holes_stay())
        if not holes:
            log.info("masked slots before a prompt chunk change its logits (a sliding window, "
                     "or biases by slot): a chunk after a past runs apart from longer chunks")
        self.step_runner = StepRunner(runner, record, vocab, self.stats.on_step, holes)
        self.scheduler = Scheduler(self.cache, options.max_streams, options.prefill_tokens,
                                   record.takes_chunks, options.max_stall,
                                   chunks_share_runs=not record.rows_at_start)
        self.output = OutputProcessor(self.stats)
        # beam searches: batches of their own, beside this one (serving.generation.beam_decode)
        # (`search`: the model's length penalty and early stopping, as its config names them)
        self.beams = BeamRuns(lambda feeds: self.runner.infer(feeds), record, vocab,
                              self.stats.on_step, search,
                              together=options.max_streams > 1 and self.rows_stay is None,
                              budget_tokens=self.cache.budget_tokens,
                              infer_into=self._infer_into if options.share_buffers else None)
        self.speculate = self._speculation(probe, options.speculate)
        self.start()

    @staticmethod
    def _speculation(probe: RowProbe, drafts: int) -> int:
        """Drafts per step (0: none): where dropping a rejected draft's entries is exact,
        found by running, as the rows' moves above."""
        if not drafts:
            return 0
        try:
            exact = probe.drafts_drop()
        except Exception as e:  # noqa: BLE001 - a backend that refuses the probe's shapes
            log.info(f"no speculation: the probe's run failed ({type(e).__name__}: {e})")
            return 0
        if not exact:
            log.info(NO_DRAFTS)
        return drafts if exact else 0

    def _infer_into(self, feeds: dict, into: dict) -> dict:
        """A run whose presents land in `into` (the graph's shared past buffers): bound to
        them where the runner writes into the caller's arrays, else copied in."""
        if getattr(self.runner, "writes_into", False):
            return self.runner.infer_into(feeds, into)
        out = self.runner.infer(feeds)
        for name, buffer in into.items():
            buffer[...] = out[name]
        return out

    @property
    def runner(self):
        """The model (anything with `infer(feeds)`); tests may slow it down."""
        return self.step_runner.runner

    @runner.setter
    def runner(self, value) -> None:
        self.step_runner.runner = value

    # ---------------------------------------------------------------------------- admission

    def validate(self, request: GenerationRequest) -> None:
        """InvalidArgument for a request this server can never run, saying which limit."""
        n, o = len(request.prompt), self.options
        numbers = (n, request.max_tokens, self.max_cache_len, self.max_prompt)
        if n > self.max_prompt:
            raise ContextTooLong(f"the prompt has {n} tokens; at most {self.max_prompt} are "
                                 "accepted", *numbers)
        if request.max_tokens > o.max_tokens:
            raise InvalidArgument(f"max_tokens {request.max_tokens} is over the limit "
                                  f"{o.max_tokens}")
        if n + request.max_tokens - 1 > self.max_cache_len:
            raise ContextTooLong(
                f"prompt ({n}) + max_tokens ({request.max_tokens}) - 1 = "
                f"{n + request.max_tokens - 1} cache entries exceed the maximum cache length "
                f"{self.max_cache_len} (the model's positions)", *numbers)
        if n + request.max_tokens > self.cache.budget_tokens:
            raise InvalidArgument(
                f"prompt ({n}) + max_tokens ({request.max_tokens}) cache entries exceed the "
                f"cache's byte budget ({self.budget.bytes} bytes: {self.cache.budget_tokens} "
                "entries); raise --kv-cache-bytes")
        check_tokens(request, self.vocab, self.tokenizer)
        why = refusal(request, self.record, self.cache.budget_tokens)
        if why:
            raise InvalidArgument(why)
        if request.timestamps or request.prompt_probe is not None:
            raise InvalidArgument("timestamps and prompt probes are an encoder-decoder's "
                                  "(Whisper's)")

    def room(self, prompt_tokens: int) -> int:
        """The most tokens a prompt of this length leaves room for in the cache."""
        return self.max_cache_len - prompt_tokens + 1

    def occupancy(self) -> tuple[int, int]:
        return self.active, len(self.scheduler.waiting) + len(self.beams.waiting)

    @property
    def active(self) -> int:
        return len(self.scheduler.running) + len(self.beams.running)

    # ---------------------------------------------------------------------------- the loop

    def _busy(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self.beams)

    def _loop(self) -> None:
        while True:
            taken = self._take_submitted(self._busy)
            if taken is None:
                return
            for stream in taken:
                if (stream.request.beams or 1) > 1:
                    self.beams.waiting.append(stream)
                else:
                    self.scheduler.add(stream)
            try:
                self._end_overdue()
                self._drop_cancelled()
                self._step(self.scheduler.schedule())
                self.beams.step(self._send_all)
            except Exception as e:  # noqa: BLE001 - the model failed: end every stream, go on
                log.exception("generation step failed")
                searched = [run.stream for run in self.beams.running]
                for s in list(self.scheduler.running) + searched:
                    self._end(s, "error", f"the model failed: {type(e).__name__}: {e}")
                self.cache.clear()
            self.stats.on_streams(*self.occupancy())
            self.stats.on_cache_usage(self.cache.usage(self.scheduler.held()))

    def _step(self, plan: StepPlan) -> None:
        for _ in plan.preempted:
            self.stats.on_preempt()
        if plan.decode:
            self._decode(plan.decode)
        if plan.prefill:
            result = self.step_runner.prefill(self.cache, plan.prefill)
            self.scheduler.costs.observe_prefill(sum(n for _, n in plan.prefill), result.seconds)
            done = []
            for i, ((s, n), cache) in enumerate(zip(plan.prefill, result.caches)):
                if result.chunk_logits and result.chunk_logits[i] is not None:
                    self.output.score_prompt(s, s.computed, result.chunk_logits[i])
                s.cache, s.computed = cache, s.computed + n
                prompt = len(s.request.prompt)
                if not s.prefix_counted and s.computed >= prompt and self.cache.prefix:
                    self.stats.on_prefix(prompt, s.prefix_hit)
                    s.prefix_counted = True
                if s.computed == len(s.tokens):  # the prompt's last chunk: a first token
                    done.append(i)
            # first tokens go out before the prompts' blocks are copied into the prefix
            # cache (a copy of every cached entry: ~6 ms of a 128-token prompt's TTFT); the
            # caches are the runs' own, so a stream that ends at its first token still
            # leaves its prefix for the streams behind it
            self._emit([plan.prefill[i][0] for i in done], result.logits[done])
            for (s, _), cache in zip(plan.prefill, result.caches):
                self.cache.store_prefix(s, cache)
        if not any(s.decoding for s in self.scheduler.running):
            self.cache.clear()  # nothing decodes: free the batch

    def _decode(self, streams: Sequence[Stream]) -> None:
        batch = self.cache.decode_batch(streams)
        drafts = self._drafts(streams, batch)
        if drafts:
            self._speculate(streams[0], batch, drafts)
            return
        result = self.step_runner.decode(self.cache, batch)
        self.scheduler.costs.observe_decode(result.seconds)
        self._emit(streams, result.logits[[s.slot for s in streams]])

    def _drafts(self, decode: Sequence[Stream], batch) -> list[int]:
        """Prompt lookup's drafts for a stream that decodes alone, as many as its length, the
        model's positions and the buffers leave room for. None beside other decoding rows:
        there a run is less memory-bound (8 rows cost 1.5x one) and every row would wait for
        the longest."""
        if not self.speculate or len(decode) != 1 or not decode[0].lookups.ready():
            return []
        if self.record.rows_at_start and len(batch.slots) > 1:
            return []  # GroupQueryAttention runs seq > 1 beside a past at batch 1 only
        s = decode[0]
        room = min(self.speculate,
                   s.request.max_tokens - s.output.generated - 1,  # the run's own token
                   self.max_cache_len - len(s.tokens))  # positions after the drafts'
        if batch.capacity is not None:  # shared buffers: the run's mask, past and new slots,
            # must fit them; the past can be wider than the row (drafts rewound, rows left)
            room = min(room, batch.capacity - batch.past - 1)
        if room < 1 or not self.cache.fits(self.scheduler.held() + 1 + room):
            return []
        return propose(s.tokens, room)

    def _speculate(self, s: Stream, batch, drafts: list[int]) -> None:
        """One run feeds `s`'s last token and its drafts; each position's token is sampled
        in turn as a decode step samples it (the stream's sampler, penalties, grammar and
        stops see the tokens before it) and the next position counts only while the token
        equals the draft it checks. The entries of the drafts after the first miss are
        dropped."""
        result = self.step_runner.verify(self.cache, batch, s, drafts)
        self.scheduler.costs.observe_decode(result.seconds)
        accepted = 0
        for j, logits in enumerate(result.logits):  # (vocab,) scoring the token after draft j-1
            self._emit([s], logits[None])
            if s.done or j == len(drafts) or s.tokens[-1] != drafts[j]:
                break
            accepted += 1
        self.stats.on_draft(len(drafts), accepted)
        s.lookups.observe(accepted)
        if not s.done:
            self.cache.rewind(s, s.computed)  # its last token and the drafts accepted

    def _emit(self, streams: Sequence[Stream], logits) -> None:
        if not streams:
            return
        tokens, scores = self.output.sample(streams, logits)
        for s, token, score in zip(streams, tokens, scores):
            s.computed = len(s.tokens)  # every fed token is cached now
            self.output.emit(s, token, score)
            if s.done:
                self._remove(s)

    def _end(self, s: Stream, reason: str, detail: str = "") -> None:
        self.output.finish(s, reason, detail)
        self._remove(s)

    def _remove(self, s: Stream) -> None:
        """An ended stream: out of the scheduler (its cache freed) or its beam search, and
        of the ids' index."""
        self.scheduler.remove(s)
        self.beams.remove(s)
        self._forget(s)

    def _end_overdue(self) -> None:
        if not self._overdue():
            return
        for s in list(self.scheduler.running) + list(self.scheduler.waiting) + self.beams.streams:
            self._end(s, "shutdown", "the server shut down before the stream finished "
                                     "(grace period over)")

    def _drop_cancelled(self) -> None:
        sched, beams = self.scheduler, self.beams
        for s in list(sched.running) + list(sched.waiting) + beams.streams:
            started = s in sched.running or any(run.stream is s for run in beams.running)
            if s.cancelled.is_set():
                self._end(s, "cancelled", "cancelled by the client" if started
                          else "cancelled before it started")
            elif self._draining and not started and s.computed == 0 and not s.preemptions:
                self._end(s, "shutdown", "the server shut down before the stream started")
