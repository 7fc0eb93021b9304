"""Structured output (JSON schemas, JSON mode, regexes, choices, Lark or EBNF grammars), as
vLLM's `guidance` backend does it: llguidance compiles a request's grammar against the served
tokenizer; before each of the stream's samplings the tokens that would leave the grammar
are masked out (-inf), and after it the sampled token moves the matcher on. The stream
ends ("stop") when the match is complete: nothing may follow, or the end token came where
the grammar allows the end.

JSON is compact (no free whitespace between tokens of the JSON): a model may otherwise fill
its output with whitespace, which every schema allows (vLLM's `disable_any_whitespace`). An
object that lists its properties takes no others unless its schema says so (`closed`), as
xgrammar's strict mode holds it (vLLM's default backend; OpenAI's structured outputs require
it): a schema as pydantic writes it says nothing, and a model could otherwise add keys of its
own, one after another, until its tokens run out."""

from __future__ import annotations

import json
from typing import Sequence

import numpy as np

from serving.errors import InvalidArgument
from serving.sampling import Grammar


# JSON Schema's keywords whose values are schemas, lists of schemas, or maps of names to
# schemas (the walk below goes only through these: a property may be named "properties")
_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
           "unevaluatedItems", "propertyNames")
_SCHEMAS = ("anyOf", "oneOf", "prefixItems")  # (allOf's branches each hold a part: open)
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema):
    """`schema` with every object that lists its `properties` closed to others
    (`additionalProperties: false` where neither it nor `patternProperties` /
    `unevaluatedProperties` says otherwise), through every subschema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SCHEMAS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(
            k in out for k in ("additionalProperties", "patternProperties",
                               "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _source(grammar: Grammar) -> str:
    """llguidance's grammar text for a request's Grammar."""
    from llguidance import LLMatcher

    if grammar.kind == "json":
        try:
            schema = json.loads(grammar.source)
            return LLMatcher.grammar_from_json_schema(
                closed(schema), defaults={"whitespace_flexible": False})
        except ValueError as e:
            raise InvalidArgument(f"the JSON schema is not a JSON object: {e}") from None
    if grammar.kind == "regex":
        return LLMatcher.grammar_from_regex(grammar.source)
    if grammar.kind == "choice":
        try:
            choices = json.loads(grammar.source)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(
                isinstance(c, str) for c in choices):
            raise InvalidArgument("a choice must be a non-empty list of strings")
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    return LLMatcher.grammar_from_lark(_lark(grammar.source))


# What a reasoning model writes before the answer its grammar holds, by family (vLLM's
# reasoning parser names): free text up to `</think>` (the lexeme stops there, the tag
# itself part of the output), after the prompt opened the block (DeepSeek-R1), or inside a
# block the reply may open (Qwen3's hybrid models, which answer at once with thinking off).
THINKING = {
    "deepseek_r1": 'start: think @answer\nthink[stop="</think>"]: /(.|\n)*/',
    "qwen3": 'start: thought? @answer\nthought: "<think>" think\n'
             'think[stop="</think>"]: /(.|\n)*/',
}


def _after_thinking(source: str, family: str) -> str:
    """llguidance's grammar `source` (top-level JSON) after the family's thinking: a Lark
    grammar first that names the answer's grammar `@answer`."""
    spec = json.loads(source)
    answer, *rest = spec["grammars"]
    return json.dumps({**spec, "grammars": [{"lark_grammar": THINKING[family]},
                                            {**answer, "name": "answer"}, *rest]})


def _lark(source: str) -> str:
    """A grammar in llguidance's Lark, or in the EBNF of llama.cpp's GBNF and xgrammar
    (`root ::= ...`: TensorRT-LLM's `ebnf_grammar`, what vLLM's `grammar` also takes),
    converted to Lark by llguidance's own converter (a Lark grammar passes unchanged)."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(source)
    except Exception as e:  # noqa: BLE001 - the converter raises its own and others
        raise InvalidArgument(f"the grammar cannot be compiled: {e}") from None


class Matcher:
    """One stream's place in its grammar."""

    def __init__(self, matcher, eos: frozenset[int], vocab: int, tokens: int) -> None:
        self._m, self.eos, self._vocab = matcher, eos, vocab  # vocab: the logits' width
        self._words = np.empty((tokens + 31) // 32, np.int32)  # one bit per token it knows

    def restrict(self, row: np.ndarray) -> None:
        """`row` (vocab,), in place: -inf for every token the grammar does not allow next."""
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        allowed = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:self._vocab]
        row[:len(allowed)][allowed[:len(row)] == 0] = -np.inf

    def advance(self, token: int) -> bool:
        """Take the sampled token; whether the match is complete (the stream ends).
        GrammarError where the grammar cannot take it (every token it allows was masked
        out besides it, e.g. by the request's bad words): that stream ends alone."""
        if token in self.eos:
            return True
        if not self._m.consume_token(token):
            raise GrammarError(f"no token the grammar allows was left to sample (token "
                               f"{token}: {self._m.get_error()})")
        return self._m.is_stopped()


class GrammarError(ValueError):
    """A constrained stream cannot go on."""


class GrammarCompiler:
    """Builds matchers for one served tokenizer (its llguidance twin made on first use: for
    a 150k vocabulary that takes about a second)."""

    def __init__(self, tokenizer, vocab: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, frozenset(eos_ids)
        self._twin = None

    def _tokenizer(self):
        if self._twin is None:
            from llguidance import LLTokenizer

            size = max(self.vocab, self.tokenizer.get_vocab_size(with_added_tokens=True))
            self._twin = LLTokenizer(self.tokenizer.to_str(), n_vocab=size,
                                     eos_token=sorted(self.eos))
        return self._twin

    def matcher(self, grammar: Grammar) -> Matcher:
        """InvalidArgument, with llguidance's reason, for a grammar it cannot compile."""
        if self.tokenizer is None:
            raise InvalidArgument("structured output needs the model's tokenizer (no "
                                  "tokenizer.json in this artifact)")
        if not self.eos:
            raise InvalidArgument("structured output needs the model's end token (no "
                                  "eos_token_id in config.json, generation_config.json or "
                                  "genai_config.json, no eos_token in tokenizer_config.json)")
        from llguidance import LLMatcher

        source = _source(grammar)
        if grammar.thinking is not None:
            source = _after_thinking(source, grammar.thinking)
        m = LLMatcher(self._tokenizer(), source, log_level=0)
        if m.is_error():
            raise InvalidArgument(f"the {grammar.kind} cannot be compiled: {m.get_error()}")
        return Matcher(m, self.eos, self.vocab, self._tokenizer().vocab_size)
