"""What an OpenAI body asks a decoder for, as GenerationRequests (serving/http/openai_api.py
answers them): the served model by name, the prompts (completions' strings, token ids or a
batch of either), `n` choices each with its seed (or, with vLLM's `use_beam_search`, one
search's n best sequences), `max_tokens` / `max_completion_tokens`,
sampling, stops, log-probs, penalties and logit bias, structured output (`response_format`,
vLLM's `structured_outputs` / `guided_*`), and the parameters refused rather than ignored.
Every check raises InvalidArgument saying what is wrong (400)."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from serving.conventions import bad_word_ids
from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument
from serving.fill_in_middle import fim_format
from serving.generation.beam_decode import MAX_BEAMS
from serving.generation.beams import searchable, unsearchable
from serving.sampling import (MAX_TOP_LOGPROBS, GenerationRequest, Grammar, Sampling,
                              allowed_ids, sample_seed)


def body_value(body: dict, name: str, kinds: tuple, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise InvalidArgument(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}")
    return value


# what the APIs that are not chat completions (Responses, Anthropic's Messages) take of its
# sampling settings, vLLM's extras included, under the same names
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "seed",
            "repetition_penalty", "ignore_eos", "stop_token_ids", "bad_words")


MAX_STOPS = 64  # stop strings a request may name (each is looked for after every token)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
        raise InvalidArgument("'stop' must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise InvalidArgument(f"'stop' holds {len(stops)} strings; at most {MAX_STOPS}")
    return tuple(s for s in stops if s)


def _check_unsupported(body: dict) -> None:
    """A parameter that would change the output and that this server cannot honour is an
    error: silently ignoring tools would answer something else than asked."""
    for name in ("tools", "functions", "suffix"):  # (chat takes its tools out before)
        if body.get(name):
            raise InvalidArgument(f"'{name}' is not supported here")
    if body.get("tool_choice") not in (None, "none"):
        raise InvalidArgument("'tool_choice' needs 'tools'")
    modalities = body_value(body, "modalities", (list,), None) or ["text"]
    if body.get("audio") or modalities != ["text"]:
        raise InvalidArgument("only text is generated here ('modalities': ['text'], no "
                              "'audio')")
    if body.get("web_search_options") is not None:
        raise InvalidArgument("'web_search_options' is not supported (nothing here searches "
                              "the web)")
    searched = beam_searched(body)
    for name, default in _VLLM_DEFAULTS_ONLY.items():
        if name == "length_penalty" and searched:
            continue  # the search's own setting
        if body.get(name) is not None and body[name] != default:
            raise InvalidArgument(f"'{name}' is not supported here (only {default!r})")


# vLLM's extras this server takes only at their defaults: each changes the answer otherwise
_VLLM_DEFAULTS_ONLY = {"skip_special_tokens": True, "spaces_between_special_tokens": True,
                       "return_tokens_as_token_ids": False,
                       "prompt_logprobs": None, "truncate_prompt_tokens": None,
                       "length_penalty": 1}


def beam_searched(body: dict) -> bool:
    """Whether a body asks for vLLM's beam search (`use_beam_search`)."""
    return body_value(body, "use_beam_search", (bool,), False)


def beam_search(body: dict, generation: GenerationRequest, n: int) -> GenerationRequest:
    """vLLM's `use_beam_search`: one search of `n` beams whose n best sequences are the
    choices (as vLLM answers it; the search is transformers' generate with num_beams and
    num_return_sequences n, and vLLM's `length_penalty`). A search is greedy: the temperature
    is not read, as vLLM's search reads none; what it cannot give is refused."""
    penalty = float(body_value(body, "length_penalty", (int, float), 1.0))
    searched = replace(generation, sampling=replace(generation.sampling, temperature=0.0),
                       beams=n, returns=n, length_penalty=penalty)
    if not searchable(searched):
        raise InvalidArgument(f"'use_beam_search': {unsearchable(n)}")
    return searched


def _adjustments(body: dict) -> dict:
    """The logit adjustments of a body, as Sampling's fields: OpenAI's `frequency_penalty`
    and `presence_penalty` (-2..2) and `logit_bias` ({"id": -100..100}), and vLLM's
    `repetition_penalty` (> 0)."""
    out = {}
    for name in ("frequency_penalty", "presence_penalty"):
        value = float(body_value(body, name, (int, float), 0))
        if not -2 <= value <= 2:
            raise InvalidArgument(f"'{name}' must be between -2 and 2, not {value}")
        out[name] = value
    out["repetition_penalty"] = float(body_value(body, "repetition_penalty", (int, float), 1))
    bias = body_value(body, "logit_bias", (dict,), {})
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidArgument(f"'logit_bias' keys must be token ids, not {key!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not -100 <= value <= 100:
            raise InvalidArgument(f"'logit_bias' values must be numbers between -100 and 100, "
                                  f"not {value!r} (token {key})")
        pairs.append((token, float(value)))
    out["logit_bias"] = tuple(pairs)
    return out


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # vLLM's older names


def structured_output(body: dict) -> Grammar | None:
    """The grammar a body asks for: OpenAI's `response_format` (json_object, or json_schema
    with its `schema`), vLLM's `structured_outputs` or its older `guided_*` keys; at most
    one of them."""
    asked = []
    fmt = body_value(body, "response_format", (dict,), {}) or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        asked.append(Grammar.of("json", {"type": "object"}))
    elif kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise InvalidArgument("'response_format' json_schema needs 'json_schema.schema', "
                                  "a JSON schema object")
        asked.append(Grammar.of("json", schema))
    elif kind != "text":
        raise InvalidArgument(f"'response_format' {kind!r} is not supported (text, "
                              "json_object, json_schema)")
    if body.get("structured_outputs") is not None:
        asked.append(Grammar.from_vllm(body["structured_outputs"]))
    asked += [Grammar.of(kind, body[key]) for key, kind in _GUIDED.items()
              if body.get(key) is not None]
    if len(asked) > 1:
        raise InvalidArgument("ask for one structured output (response_format, "
                              "structured_outputs or one guided_* key), not several")
    return asked[0] if asked else None


def choice_count(engine: DecoderEngine, body: dict) -> int:
    """`n`: at most the streams the engine runs at once (more would wait behind each other);
    with vLLM's `use_beam_search`, the beam width: at most MAX_BEAMS."""
    n = body_value(body, "n", (int,), 1)
    if beam_searched(body):
        if not 1 <= n <= MAX_BEAMS:
            raise InvalidArgument(f"'n' is the beam width with 'use_beam_search': 1 to "
                                  f"{MAX_BEAMS}, not {n}")
        return n
    limit = engine.options.max_streams
    if not 1 <= n <= limit:
        raise InvalidArgument(f"'n' must be between 1 and {limit} (the streams this server "
                              f"runs at once: --max-streams), not {n}")
    return n


def candidate_count(engine: DecoderEngine, body: dict) -> int:
    """OpenAI's `best_of` (its legacy completions; vLLM takes it on chat too): how many
    completions are sampled for each prompt, of which the `n` with the highest
    log-probability per token are the choices; at least n, at most the streams the engine
    runs at once; not streamed (the best are known only at the end) nor with a beam search
    (whose n best are the choices already)."""
    n = choice_count(engine, body)
    best = body_value(body, "best_of", (int,), None)
    if best is None or best == n:
        return n
    if best < n:
        raise InvalidArgument(f"'best_of' must be at least 'n' ({n}), not {best}")
    if beam_searched(body):
        raise InvalidArgument("'best_of' with 'use_beam_search': leave it equal to 'n' (the "
                              "search's n best are the choices)")
    if body_value(body, "stream", (bool,), False):
        raise InvalidArgument("'best_of' above 'n' cannot be streamed: the best are known "
                              "only when every candidate is done")
    if best > engine.options.max_streams:
        raise InvalidArgument(f"'best_of' must be at most {engine.options.max_streams} (the "
                              f"streams this server runs at once: --max-streams), not {best}")
    return best


def top_count(name: str, k) -> int:
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}, not {k}")
    return k


def model_defaults(frontend, engine: DecoderEngine) -> Mapping[str, float | int]:
    """The sampling settings the model's generation_config.json names (serving/text_config.py),
    which the OpenAI-compatible APIs apply where a request names none, as vLLM's OpenAI
    server does unless started with `--generation-config vllm`; none when the server was
    started with `--generation-config none`."""
    return dict(engine.text.sampling) if frontend.model_defaults else {}


def max_tokens_of(body: dict) -> int | None:
    return body_value(body, "max_completion_tokens", (int,)) or body_value(body, "max_tokens",
                                                                           (int,))


def generations_for(engine: DecoderEngine, body: dict, prompt: tuple[int, ...],
                    top: int | None, request_id: str, default_max_tokens: int | None = None,
                    echo: bool = False, defaults: Mapping[str, float | int] | None = None
                    ) -> list[GenerationRequest]:
    """The generations a body asks for: `n`, or `best_of` candidates (choice i samples
    with seed + i; with vLLM's `use_beam_search` one search whose n best sequences are the
    choices); without
    max_tokens, `default_max_tokens` (OpenAI's 16 for completions) or, for chat, as many as
    the cache and --max-tokens leave room for. `top`: None without log-probs, else how many
    of the most likely tokens come with each (and, with `echo`, with each prompt token).
    `echo` with max_tokens 0 runs one token that the answer leaves out (_Shape.drop).
    `defaults`: the model's sampling defaults (model_defaults), for what the body leaves
    out (the other names are the API's own); max_new_tokens bounds the default length only
    (vLLM's bounds a request's max_tokens too)."""
    _check_unsupported(body)
    defaults = {} if defaults is None or beam_searched(body) else dict(defaults)
    most = defaults.pop("max_new_tokens", None)
    body = defaults | {k: v for k, v in body.items() if v is not None}
    n, count = choice_count(engine, body), candidate_count(engine, body)
    room = engine.generator.room(len(prompt))
    limit = default_max_tokens or min(engine.options.max_tokens, max(1, room))
    if most is not None:
        limit = min(limit, most)
    max_tokens = max_tokens_of(body)
    if echo and max_tokens == 0:
        max_tokens = 1
    stop_ids = frozenset() if body_value(body, "ignore_eos", (bool,), False) else \
        frozenset(engine.text.eos_ids)
    stop_ids |= _token_ids(body, "stop_token_ids", engine.generator.vocab)
    seed = body_value(body, "seed", (int,))
    adjustments, grammar = _adjustments(body), structured_output(body)
    adjustments["min_p"] = float(body_value(body, "min_p", (int, float), 0.0))
    adjustments["typical_p"] = float(body_value(body, "typical_p", (int, float), 1.0))  # TGI's
    if body.get("allowed_token_ids") is not None:
        adjustments["allowed_ids"] = allowed_ids(sorted(_token_ids(
            body, "allowed_token_ids", engine.generator.vocab)))
    searched = beam_searched(body)  # one stream, n beams
    sampling = [Sampling(float(body_value(body, "temperature", (int, float), 1.0)),
                         body_value(body, "top_k", (int,), 0) if body.get("top_k") != -1 else 0,
                         float(body_value(body, "top_p", (int, float), 1.0)),
                         sample_seed(seed, i), **adjustments)
                for i in range(1 if searched else count)]
    generations = [GenerationRequest(prompt, limit if max_tokens is None else max_tokens, s,
                                     stop_ids, f"{request_id}-{i}" if count > 1 else request_id,
                                     min_tokens=body_value(body, "min_tokens", (int,), 0),
                                     stop_strings=_stops(body),
                                     logprobs=top is not None or count > n,  # (to rank them)
                                     include_stop=body_value(body, "include_stop_str_in_output",
                                                             (bool,), False),
                                     top_logprobs=top or 0,
                                     prompt_logprobs=top if echo and top is not None else None,
                                     bad_words=_bad_words(engine, body), grammar=grammar)
                   for i, s in enumerate(sampling)]
    return [beam_search(body, generations[0], n)] if searched else generations


def _token_ids(body: dict, name: str, vocab: int) -> frozenset[int]:
    ids = body_value(body, name, (list,), []) or []
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise InvalidArgument(f"'{name}' must be a list of token ids in [0, {vocab})")
    return frozenset(ids)


def _bad_words(engine: DecoderEngine, body: dict) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words`: each word never generated, as the vLLM backend bans them
    (serving.conventions.bad_word_ids)."""
    words = body_value(body, "bad_words", (list,), []) or []
    if any(not isinstance(w, str) or not w.strip() for w in words):
        raise InvalidArgument("'bad_words' must be a list of non-empty strings")
    return bad_word_ids(engine.tokenizer, words, vllm=True)


# what huggingface_hub's InferenceClient sends as `model` when it is given the server's URL
# instead of a model name ("tgi" in its older releases, "dummy" in newer ones): TGI serves
# one model and takes any name; here these two mean the one served
_PLACEHOLDER_NAMES = ("dummy", "tgi")


def model_named(frontend, body: dict) -> str:
    """The model a body names; the one served when it names none (as vLLM: a body without
    `model` is common from curl and from SageMaker's /invocations, one model an endpoint) or
    names huggingface_hub's placeholder."""
    name = body.get("model", frontend.slot.name)
    if not isinstance(name, str):
        raise InvalidArgument("'model' must be the name of a served model")
    return frontend.slot.name if name in _PLACEHOLDER_NAMES else name


def text_engine(frontend, body: dict) -> DecoderEngine:
    name = model_named(frontend, body)
    return text_generator(frontend.slot.find(name), name)


def text_generator(engine, name: str) -> DecoderEngine:
    """`engine` (model `name`) if it generates text, else why not (every text API's answer)."""
    if not isinstance(engine, DecoderEngine):
        raise InvalidArgument(f"model '{name}' does not generate text: it is served as a tensor "
                              "model (KServe v2 infer); generation needs a decoder exported "
                              "with its KV cache")
    if engine.tokenizer is None:
        raise InvalidArgument(f"model '{name}' does not generate text: its artifact holds no "
                              "tokenizer.json (send token ids: gRPC input_ids)")
    return engine


def token_ids(x) -> bool:
    """Whether `x` is a non-empty list of token ids (ints, not bools), as OpenAI's prompt and
    input lists carry them."""
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def completion_prompts(engine: DecoderEngine, body: dict
                       ) -> tuple[list[tuple[tuple[int, ...], str]], dict]:
    """A completions body's prompts (`prompt_ids`) and the body left for the sampling
    settings: with a `suffix` (code completion: the text after the cursor), each prompt
    written in the model's fill-in-the-middle format, the suffix taken out."""
    suffix = body_value(body, "suffix", (str,))
    if not suffix:
        return prompt_ids(engine, body.get("prompt")), body
    if body.get("echo"):
        raise InvalidArgument("'echo' with 'suffix' is not supported")
    rest = {k: v for k, v in body.items() if k != "suffix"}
    return fim_prompts(engine, body.get("prompt"), suffix), rest


def prompt_ids(engine: DecoderEngine, prompt) -> list[tuple[tuple[int, ...], str]]:
    """OpenAI's `prompt`: a string, token ids, or a list of either (a batch); each as (ids,
    its text: the string as sent, or the ids decoded)."""
    batch = prompt if isinstance(prompt, list) and prompt and all(
        isinstance(p, str) or token_ids(p) for p in prompt) else [prompt]
    out = []
    for p in batch:
        if isinstance(p, str):
            out.append((tuple(engine.tokenizer.encode(p).ids), p))
        elif token_ids(p):
            out.append((tuple(p), engine.tokenizer.decode(p, skip_special_tokens=False)))
        else:
            raise InvalidArgument("'prompt' must be a string, a list of token ids, or a "
                                  "non-empty list of those (a batch)")
    return out


def fim_prompts(engine: DecoderEngine, prompt, suffix: str) -> list[tuple[tuple[int, ...], str]]:
    """OpenAI's `prompt` with a `suffix`: each prompt the text before the insertion point,
    the suffix the text after it, written in the model's fill-in-the-middle format
    (serving/fill_in_middle.py)."""
    fmt = fim_format(engine.tokenizer)
    if fmt is None:
        raise InvalidArgument("'suffix' needs a code model's fill-in-the-middle tokens "
                              "(<fim_prefix>, <|fim_prefix|>, ...), which this model's "
                              "tokenizer does not have")
    batch = prompt if isinstance(prompt, list) else [prompt]
    if not batch or not all(isinstance(p, str) for p in batch):
        raise InvalidArgument("with 'suffix', 'prompt' must be text (or a list of texts)")
    return [(tuple(engine.tokenizer.encode(fmt.text(p, suffix)).ids), p) for p in batch]
