"""What a generation request asks for (prompt, limits, sampling) and what comes back (chunks),
and how one token is drawn from one row of logits. Plain data and numpy: no grpc, no model.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from serving.errors import InvalidArgument

FINISH_REASONS = ("length", "stop", "cancelled", "shutdown", "error")
MAX_TOP_LOGPROBS = 20  # the most alternatives a position reports (OpenAI's limit for chat's
# top_logprobs; vLLM's default max_logprobs)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 (the default) or top_k 1 is greedy; otherwise softmax(logits / t),
    cut to the top k, to the smallest set holding top_p of the mass, and to the ids at least
    min_p times as likely as the likeliest, then to the locally typical ones (typical_p). A
    seed makes it reproducible (one generator per stream, so other streams cannot change the
    draws).
    Before either, the logits are adjusted (`adjust`) as vLLM's sampler and transformers'
    logits processors do, in their order: the bias first, then the penalties."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int | None = None
    # ids seen in the prompt or the output: a positive logit divided by it, a negative one
    # multiplied (transformers', vLLM's and TensorRT-LLM's repetition penalty; 1: none)
    repetition_penalty: float = 1.0
    penalty_last_n: int = 0  # > 0: the repetition penalty looks at the last n ids of prompt
    # + output only (Ollama's repeat_last_n); 0: at all of them
    presence_penalty: float = 0.0  # subtracted once from every id the OUTPUT holds (OpenAI's)
    frequency_penalty: float = 0.0  # subtracted per time the output holds the id (OpenAI's)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (id, bias) added to the logits (OpenAI's)
    min_p: float = 0.0  # keep the ids at least min_p times as likely as the likeliest
    # (vLLM's and transformers' min_p, after top_k and top_p as transformers orders them)
    allowed_ids: tuple[int, ...] = ()  # vLLM's allowed_token_ids: only these are ever
    # sampled (every other logit -inf before the bias and penalties); () allows every id
    typical_p: float = 1.0  # locally typical sampling (TGI's typical_p, transformers'
    # TypicalLogitsWarper, last as transformers orders them): the ids whose surprise is
    # nearest the distribution's entropy, until they hold typical_p of the mass; 1: none

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidArgument(f"temperature must be a finite number >= 0, not "
                                  f"{self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, not {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in (0, 1], not {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidArgument(f"min_p must be in [0, 1], not {self.min_p}")
        if not 0 < self.typical_p <= 1:
            raise InvalidArgument(f"typical_p must be in (0, 1], not {self.typical_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidArgument(f"seed must be in [0, 2^64), not {self.seed}")
        if self.penalty_last_n < 0:
            raise InvalidArgument(f"penalty_last_n must be >= 0, not {self.penalty_last_n}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidArgument(f"repetition_penalty must be a finite number > 0, not "
                                  f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise InvalidArgument(f"{name} must be a finite number, not "
                                      f"{getattr(self, name)}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids) or any(t < 0 for t in ids):
            raise InvalidArgument("logit_bias must name each token id (>= 0) once")
        if not all(math.isfinite(b) for _, b in self.logit_bias):
            raise InvalidArgument("a logit_bias value must be a finite number")
        if any(t < 0 for t in self.allowed_ids):
            raise InvalidArgument("allowed token ids must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def adjusts(self) -> bool:
        """Whether `adjust` changes anything (most requests: no copy of their logits)."""
        return bool(self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.allowed_ids)


def sample_seed(seed: int | None, i: int) -> int | None:
    """The seed of sample i of a request's several (OpenAI's n and best_of, TGI's best_of,
    the vLLM backend's n): seed + i, so that each is what a request of that seed alone gives; the
    first keeps the request's own (None: each unseeded)."""
    return seed if seed is None or i == 0 else (seed + i) % 2**64


def allowed_ids(ids: Sequence[int] | None) -> tuple[int, ...]:
    """vLLM's `allowed_token_ids` as Sampling.allowed_ids: None allows every id; an empty
    list is an error there (it would allow none) and here."""
    if ids is None:
        return ()
    if not ids:
        raise InvalidArgument("'allowed_token_ids' must not be empty")
    return tuple(sorted(set(ids)))


GRAMMAR_KINDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Grammar:
    """Structured output: the output must match `source`, read as `kind` says: "json" a JSON
    schema (as JSON text; '{"type": "object"}' for any object: OpenAI's JSON mode),
    "regex" a regular expression, "choice" a JSON list of the strings allowed, "grammar" a
    Lark grammar (llguidance's dialect) or an EBNF one (GBNF / xgrammar: `root ::= ...`).
    Compiled and applied by serving.generation.grammar. `thinking`: a reasoning model's
    family (serving.generation.grammar.THINKING): the reply thinks freely first, and the
    grammar holds what follows its `</think>`."""

    kind: str
    source: str
    thinking: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidArgument(f"a structured output is one of {list(GRAMMAR_KINDS)}, not "
                                  f"{self.kind!r}")

    @classmethod
    def of(cls, kind: str, value) -> "Grammar":
        """From a client's value: a schema or a choice as JSON or as the object itself."""
        if kind in ("json", "choice") and not isinstance(value, str):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f"the {kind} of a structured output must be a non-empty "
                                  "string")
        return cls(kind, value)

    @classmethod
    def from_vllm(cls, spec) -> "Grammar":
        """vLLM's structured-output options (`structured_outputs`, formerly
        `guided_decoding`): one of json (a schema), regex, choice, grammar, or json_object
        true."""
        if not isinstance(spec, dict):
            raise InvalidArgument("structured output options must be an object with one of "
                                  "json, regex, choice, grammar, json_object")
        given = {k: v for k, v in spec.items() if v not in (None, False)}
        if spec.get("json_object") is True:
            given = {**{k: v for k, v in given.items() if k != "json_object"},
                     "json": {"type": "object"}}
        unknown = set(given) - set(GRAMMAR_KINDS)
        if unknown or len(given) != 1:
            raise InvalidArgument("structured output options take exactly one of json, regex, "
                                  f"choice, grammar, json_object; got {sorted(spec)}")
        ((kind, value),) = given.items()
        return cls.of(kind, value)


@dataclass(frozen=True)
class GenerationRequest:
    prompt: tuple[int, ...]
    max_tokens: int = 16
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()  # generating one ends the stream (not sent)
    id: str = ""
    min_tokens: int = 0  # until this many tokens were generated, stop_ids are masked out of
    # sampling (their logits set to -inf)
    stop_strings: tuple[str, ...] = ()  # needs a tokenizer (else InvalidArgument); matched on
    # the detokenized OUTPUT text (never the prompt), across token boundaries; the stream ends
    # with reason "stop"; the text sent ends right before the match (the stop string is not
    # sent); text that may be the start of a stop string is held back until it is decided
    include_stop: bool = False  # the matched stop string ends the text sent (vLLM's
    # include_stop_str_in_output) instead of being cut off
    logprobs: bool = False  # each chunk carries, per id, log_softmax(raw logits)[id] (the
    # model's own distribution, before temperature/top-k/p)
    top_logprobs: int = 0  # each chunk carries, per id, the k most likely ids of that
    # position with their log-probs (of the raw logits, most likely first)
    ranks: bool = False  # each chunk carries, per id, its rank under the raw logits: how many
    # ids score at least as high (1 for the most likely; vLLM's rank)
    prompt_logprobs: int | None = None  # None: nothing of the prompt; k: the first chunk
    # carries every prompt token's log-prob after the first (under the logits of the
    # position before it) and, where k > 0, the k most likely ids there (vLLM's
    # prompt_logprobs, OpenAI's `echo` with `logprobs`): the whole prompt is computed, never
    # taken from the prefix cache
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never generated
    # (TensorRT-LLM's bad words): where the sequence (prompt + output) ends with all but a
    # bad word's last token, that token's logit is -inf for this step (a one-token word is
    # never sampled)
    grammar: Grammar | None = None  # structured output: every token keeps the output a
    # prefix of a match; the stream ends ("stop") when the match is complete
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # TensorRT-LLM's stop words as ids:
    # the stream ends ("stop") on the token that completes one (prompt + output ending with
    # it, as TensorRT-LLM matches them; not before min_tokens); unlike a stop id, its
    # tokens are sent
    encoder_input: np.ndarray | None = field(default=None, compare=False, repr=False)
    # an encoder-decoder's source where it is not token ids (Whisper's log-mel features,
    # (bins, frames)); `prompt` then holds the decoder's first tokens
    beams: int | None = None  # beam search's width (TensorRT-LLM's beam_width); None: the
    # model's default (an encoder-decoder's generation config), 1 for a decoder
    length_penalty: float | None = None  # a search's own settings (TensorRT-LLM's
    early_stopping: bool | None = None  # len_penalty, early_stopping); None: the model's
    # (an encoder-decoder's generation config), else transformers' defaults (1.0, False)
    returns: int = 1  # how many of a search's best sequences the answer carries (at most
    # `beams`: TensorRT-LLM's num_return_sequences, every beam unless it says; OpenAI's n
    # with vLLM's use_beam_search; transformers' num_return_sequences)
    timestamps: bool = False  # Whisper's timestamp tokens generated under their rule
    # (serving.generation.timestamps); `prompt` then ends without <|notimestamps|>
    prompt_probe: tuple[int, tuple[int, ...]] | None = None  # (position, ids): the first
    # chunk carries the log-probs of `ids` under the logits at that position of the prompt
    # (Whisper's no-speech probability: <|nospeech|> where <|startoftranscript|> stands);
    # both of an encoder-decoder only

    def __post_init__(self) -> None:
        if not self.prompt:
            raise InvalidArgument("the prompt is empty: send at least one token")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, not {self.max_tokens}")
        if self.min_tokens < 0:
            raise InvalidArgument(f"min_tokens must be >= 0, not {self.min_tokens}")
        if any(not s for s in self.stop_strings):
            raise InvalidArgument("a stop string must not be empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                                  f"not {self.top_logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                                  f"not {self.prompt_logprobs}")
        if any(not w for w in self.bad_words):
            raise InvalidArgument("a bad word must hold at least one token")
        if any(not w for w in self.stop_sequences):
            raise InvalidArgument("a stop word must hold at least one token")
        if self.prompt_probe is not None and not 0 <= self.prompt_probe[0] < len(self.prompt):
            raise InvalidArgument(f"the probed position {self.prompt_probe[0]} is not in the "
                                  f"prompt ({len(self.prompt)} tokens)")
        if self.beams is not None and self.beams < 1:
            raise InvalidArgument(f"beams must be >= 1, not {self.beams}")
        if self.length_penalty is not None and not math.isfinite(self.length_penalty):
            raise InvalidArgument(f"the length penalty must be finite, not {self.length_penalty}")
        if not 1 <= self.returns <= max(1, self.beams or 1):
            raise InvalidArgument(f"{self.returns} sequences asked of a search of "
                                  f"{self.beams or 1} beams: at most one per beam")


@dataclass(frozen=True)
class Beam:
    """One of the sequences a beam search answers with: its new token ids (the end token it
    ended at left out, as a stream leaves it out), their text, and why it ended."""

    ids: tuple[int, ...]
    text: str | None
    reason: str  # "stop" (at an end token) or "length"


@dataclass(frozen=True)
class Chunk:
    """One response of a stream: new token ids (and their text, with a tokenizer); the last
    one has `final` and says why the stream ended."""

    ids: tuple[int, ...]
    text: str | None
    final: bool = False
    reason: str | None = None  # one of FINISH_REASONS on the final chunk
    detail: str = ""  # a sentence for the client when the reason is not "length"/"stop"
    stop: str | None = None  # on the final chunk: the stop string that ended the stream
    # (None when an end token, a grammar's end or max_tokens did)
    cached: int | None = None  # on the final chunk: the prompt tokens that were taken from
    # the prefix cache, not computed
    logprobs: tuple[float, ...] | None = None  # one per id when the request asked
    # one per id when the request asked for top_logprobs: ((id, log-prob), ...) of that position
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    ranks: tuple[int, ...] | None = None  # one per id when the request asked for ranks
    # the first chunk of a request that asked for prompt_logprobs: prompt tokens 1.. each
    # with its log-prob and (k > 0) the k most likely (id, log-prob) at its position
    prompt_logprobs: tuple[float, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    probe: tuple[float, ...] | None = None  # the first chunk of a request with a
    # prompt_probe: one log-prob per probed id
    beams: tuple[Beam, ...] | None = None  # the final chunk of a search asked for more than
    # one sequence (`returns`): each, the best first (the chunk's own ids are the first's)
    # when the engine made it (time.perf_counter): a frontend that reads chunks later, all
    # at once when its thread was late, still times the tokens as they were made
    at: float = field(default_factory=time.perf_counter, compare=False)


def _joined(chunks: Sequence[Chunk], name: str) -> tuple | None:
    if all(getattr(c, name) is None for c in chunks):
        return None
    return tuple(x for c in chunks for x in (getattr(c, name) or ()))


def held_back(tail: str, marks: Sequence[str]) -> int:
    """Characters at the end of `tail` that are the start of one of `marks` (text to hold
    back while it may still become a stop string, or a tool call's opening tag)."""
    for n in range(min(len(tail), max((len(m) for m in marks), default=0) - 1), 0, -1):
        if any(m.startswith(tail[-n:]) for m in marks):
            return n
    return 0


def join_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """A whole stream as one final chunk (an answer that is not streamed)."""
    texts = [c.text for c in chunks if c.text is not None]
    last = chunks[-1]
    first = next((c for c in chunks if c.prompt_logprobs is not None), last)
    return Chunk(tuple(t for c in chunks for t in c.ids), "".join(texts) if texts else None,
                 True, last.reason, last.detail, stop=last.stop, cached=last.cached,
                 logprobs=_joined(chunks, "logprobs"),
                 top_logprobs=_joined(chunks, "top_logprobs"), ranks=_joined(chunks, "ranks"),
                 prompt_logprobs=first.prompt_logprobs,
                 prompt_top_logprobs=first.prompt_top_logprobs,
                 probe=next((c.probe for c in chunks if c.probe is not None), None),
                 beams=last.beams)


def best_chunks(wholes: list[Chunk], n: int, best: int) -> list[Chunk]:
    """Of each prompt's `best` candidates (in order, each a whole stream), the n with the
    highest log-probability per token, as OpenAI's best_of and TGI's pick them (an empty one
    scores 0); ties keep the order."""
    def per_token(c: Chunk) -> float:
        return sum(c.logprobs or ()) / len(c.ids) if c.ids else 0.0

    if best == n:
        return wholes
    return [c for at in range(0, len(wholes), best)
            for c in sorted(wholes[at:at + best], key=lambda c: -per_token(c))[:n]]


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """One token from one row of logits (vocab,)."""
    if s.greedy:
        return int(np.argmax(logits))  # first maximum, as torch.argmax in transformers
    p = distribution(logits, s)
    return int(rng.choice(p.size, p=p))


def distribution(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """(vocab,) float64: what a sampled row draws from, every cut made and renormalized."""
    x = logits.astype(np.float64) / s.temperature
    if 0 < s.top_k < x.size:
        kth = np.partition(x, -s.top_k)[-s.top_k]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), s.top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    if s.min_p > 0:
        p = np.where(p >= s.min_p * p.max(), p, 0.0)
        p /= p.sum()
    if s.typical_p < 1:
        p = _typical(p, s.typical_p)
    return p


def _typical(p: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling (Meister et al. 2022, transformers' TypicalLogitsWarper):
    order the ids by how far their surprise -log p lies from the entropy, keep them in that
    order until they hold `mass` of the probability (the one that crosses it included, and
    every id as near as it), renormalize. Ids already cut (p 0) stay cut."""
    live = p > 0
    surprise = -np.log(np.where(live, p, 1.0))
    entropy = float(np.sum(p[live] * surprise[live]))
    shifted = np.where(live, np.abs(surprise - entropy), np.inf)
    order = np.argsort(shifted, kind="stable")
    last = min(int(np.sum(np.cumsum(p[order]) < mass)), p.size - 1)
    q = np.where(shifted <= shifted[order[last]], p, 0.0)
    return q / q.sum()


def adjust(row: np.ndarray, s: Sampling, prompt: Sequence[int], output: Sequence[int]) -> None:
    """`row` (vocab,), in place: every id but the allowed ones -inf, + logit_bias, then the
    repetition penalty over the ids of prompt + output (the last penalty_last_n of them
    when set), then - frequency x count - presence over the output's ids (vLLM's
    allowed-ids mask and apply_penalties; transformers' SequenceBias then
    RepetitionPenalty processors)."""
    if s.allowed_ids:
        keep = row[list(s.allowed_ids)]
        row[:] = -np.inf
        row[list(s.allowed_ids)] = keep
    if s.logit_bias:
        ids, bias = zip(*s.logit_bias)
        row[list(ids)] += np.asarray(bias, row.dtype)
    if s.repetition_penalty != 1:
        seq = (*prompt, *output)
        seen = np.unique(np.fromiter(seq[-s.penalty_last_n:] if s.penalty_last_n else seq,
                                     np.int64))
        x, r = row[seen], row.dtype.type(s.repetition_penalty)  # in the row's precision
        row[seen] = np.where(x > 0, x / r, x * r)
    if (s.presence_penalty or s.frequency_penalty) and len(output):
        ids, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
        row[ids] -= (s.frequency_penalty * counts + s.presence_penalty).astype(row.dtype)
