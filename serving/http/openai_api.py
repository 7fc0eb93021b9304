"""An OpenAI-compatible API on the HTTP port (and vLLM's `GET /health` and `/version`, which
its deployments probe): `GET /v1/models[/{model}]`, `POST /v1/completions` and `POST
/v1/chat/completions`, whole or streamed (`stream: true`: Server-Sent Events, one chunk per
token chunk, then `data: [DONE]`), with `usage`, `max_tokens`, `temperature`, `top_p`,
`seed`, `stop` (strings), `n` (choices, each its own stream in the engine), `logprobs` (of
the sampled tokens, and of the k most likely: completions' `logprobs: k`, chat's
`top_logprobs`), `frequency_penalty`, `presence_penalty` and `logit_bias`, structured output
(`response_format` json_object or json_schema; vLLM's `structured_outputs` and
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`), chat's `tools` (forced
calls, or "auto" with --tool-call-parser: serving/http/tools.py), and vLLM's `top_k`,
`min_tokens`, `repetition_penalty` and `ignore_eos`. Completions also take a batch of
prompts (choice `index` = prompt * n + choice) and `echo` (the prompt before the
completion; with `logprobs`, every prompt token's log-prob too, the first one null, and
`max_tokens: 0` for the prompt alone): what lm-evaluation-harness sends to score a model.
Errors are OpenAI error objects with the matching status; a parameter this server cannot
honour (`tool_choice` "auto" without a parser, `best_of`, `suffix`) is refused rather than
ignored.
Generation stops at the model's end token (config.json / tokenizer_config.json) unless
`ignore_eos`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import serving
from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument, NotFound
from serving.http.chat import messages_of, render
from serving.http.codec import http_status_for
from serving.http.streams import ChunkStreams, until_disconnect
from serving.http.tools import Forced, Hermes, tool_reader
from serving.http.triton_generate import SSE_HEADERS, sse
from serving.sampling import (MAX_TOP_LOGPROBS, Chunk, GenerationRequest, Grammar, Sampling,
                              join_chunks)
from serving.tokenizer import token_text

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}
STARTED = int(time.time())


def error(exc: BaseException) -> Response:
    status, message = http_status_for(exc)
    code = "model_not_found" if isinstance(exc, NotFound) else None
    return JSONResponse({"error": {"message": message, "type": _TYPES.get(status, "error"),
                                   "param": None, "code": code}}, status)


def _model(name: str) -> dict:
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "shapetuner"}


async def models(frontend, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model(frontend.slot.name)]})


async def model(frontend, request: Request) -> Response:
    """`client.models.retrieve(name)`: the served model, or 404 model_not_found."""
    name = request.path_params["model"]
    if name != frontend.slot.name:
        raise NotFound(f"The model '{name}' does not exist")
    return JSONResponse(_model(name))


async def health(frontend, request: Request) -> Response:
    """vLLM's `GET /health`, which its deployments probe: 200 once the model serves (its
    accuracy re-checked), 503 before."""
    return Response(status_code=200 if frontend.slot.ready() else 503)


async def version(frontend, request: Request) -> Response:
    """vLLM's `GET /version`."""
    return JSONResponse({"version": serving.__version__})


# ----------------------------------------------------------------------------- requests


def body_value(body: dict, name: str, kinds: tuple, default=None):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise InvalidArgument(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}")
    return value


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or any(not isinstance(s, str) for s in stops):
        raise InvalidArgument("'stop' must be a string or a list of strings")
    return tuple(s for s in stops if s)


def _check_unsupported(body: dict) -> None:
    """A parameter that would change the output and that this server cannot honour is an
    error: silently ignoring tools would answer something else than asked."""
    for name in ("tools", "functions", "suffix"):  # (chat takes its tools out before)
        if body.get(name):
            raise InvalidArgument(f"'{name}' is not supported here")
    if body.get("tool_choice") not in (None, "none"):
        raise InvalidArgument("'tool_choice' needs 'tools'")
    if body_value(body, "best_of", (int,), None) not in (None, body_value(body, "n", (int,), 1)):
        raise InvalidArgument("'best_of' is not supported (leave it equal to 'n')")


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


def _choices(engine: DecoderEngine, body: dict) -> int:
    """`n`: at most the streams the engine runs at once (more would wait behind each other)."""
    n, limit = body_value(body, "n", (int,), 1), engine.options.max_streams
    if not 1 <= n <= limit:
        raise InvalidArgument(f"'n' must be between 1 and {limit} (the streams this server "
                              f"runs at once: --max-streams), not {n}")
    return n


def top_count(name: str, k) -> int:
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"'{name}' must be between 0 and {MAX_TOP_LOGPROBS}, not {k}")
    return k


def _max_tokens(body: dict) -> int | None:
    return body_value(body, "max_completion_tokens", (int,)) or body_value(body, "max_tokens",
                                                                           (int,))


def generations_for(engine: DecoderEngine, body: dict, prompt: tuple[int, ...],
                    top: int | None, request_id: str, default_max_tokens: int | None = None,
                    echo: bool = False) -> list[GenerationRequest]:
    """The `n` generations a body asks for (choice i samples with seed + i); without
    max_tokens, `default_max_tokens` (OpenAI's 16 for completions) or, for chat, as many as
    the cache and --max-tokens leave room for. `top`: None without log-probs, else how many
    of the most likely tokens come with each (and, with `echo`, with each prompt token).
    `echo` with max_tokens 0 runs one token that the answer leaves out (_Shape.drop)."""
    _check_unsupported(body)
    n = _choices(engine, body)
    room = engine.generator.max_cache_len - len(prompt) + 1
    limit = default_max_tokens or min(engine.options.max_tokens, max(1, room))
    max_tokens = _max_tokens(body)
    if echo and max_tokens == 0:
        max_tokens = 1
    stop_ids = frozenset() if body_value(body, "ignore_eos", (bool,), False) else \
        frozenset(engine.text.eos_ids)
    seed = body_value(body, "seed", (int,))
    adjustments, grammar = _adjustments(body), structured_output(body)
    sampling = [Sampling(float(body_value(body, "temperature", (int, float), 1.0)),
                         body_value(body, "top_k", (int,), 0) if body.get("top_k") != -1 else 0,
                         float(body_value(body, "top_p", (int, float), 1.0)),
                         seed if seed is None or i == 0 else (seed + i) % 2**64, **adjustments)
                for i in range(n)]
    return [GenerationRequest(prompt, limit if max_tokens is None else max_tokens, s,
                              stop_ids, f"{request_id}-{i}" if n > 1 else request_id,
                              min_tokens=body_value(body, "min_tokens", (int,), 0),
                              stop_strings=_stops(body), logprobs=top is not None,
                              top_logprobs=top or 0,
                              prompt_logprobs=top if echo and top is not None else None,
                              grammar=grammar)
            for i, s in enumerate(sampling)]


def text_engine(frontend, body: dict) -> DecoderEngine:
    name = body.get("model")
    if not isinstance(name, str):
        raise InvalidArgument("'model' must be the name of a served model")
    engine = frontend.slot.find(name)
    if not isinstance(engine, DecoderEngine) or engine.tokenizer is None:
        raise InvalidArgument(f"model '{name}' does not generate text (it needs a decoder "
                              "artifact with tokenizer.json)")
    return engine


def token_ids(x) -> bool:
    """Whether `x` is a non-empty list of token ids (ints, not bools), as OpenAI's prompt and
    input lists carry them."""
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _completion_prompts(engine: DecoderEngine, prompt) -> list[tuple[tuple[int, ...], str]]:
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


# ---------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class _Echo:
    """Completions' `echo`: each choice's prompt goes before its completion (`prompts`: per
    choice index, the prompt's ids and text); `drop`: max_tokens was 0, so the one token
    generated is left out."""

    prompts: tuple[tuple[tuple[int, ...], str], ...]
    drop: bool


class _Shape:
    """How one endpoint writes choices: completions put text and token log-probs in the
    choice; chat puts a message (a delta when streaming) and content log-probs."""

    def __init__(self, engine: DecoderEngine, chat: bool, top: int | None, n: int,
                 echo: _Echo | None = None, tools: Forced | Hermes | None = None) -> None:
        self.engine, self.chat, self.logprobs, self.top = engine, chat, top is not None, top
        self.echo, self.tools = echo, tools
        self.held = [""] * n  # each choice's text so far, when it may hold tool calls
        self.sent = [0] * n  # and how much of it went out as content
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offsets = [0] * n  # each choice's text_offset (completions)

    def object(self, stream: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def _text(self, token: int) -> str:
        return token_text(self.engine.tokenizer, token)

    def _logprobs(self, chunk: Chunk, index: int):
        if not self.logprobs:
            return None
        tokens = [self._text(t) for t in chunk.ids]
        values = list(chunk.logprobs or ())
        tops = [[(self._text(t), p) for t, p in top] for top in chunk.top_logprobs or ()]
        tops += [[]] * (len(tokens) - len(tops))
        if chunk.prompt_logprobs is not None and self.echo is not None:
            return self._with_prompt(chunk, index, tokens, values, tops)
        if self.chat:
            return {"content": [{**token_entry(t, v),
                                 "top_logprobs": [token_entry(*a) for a in top]}
                                for t, v, top in zip(tokens, values, tops)]}
        offsets = self._offsets(tokens, index)
        return {"tokens": tokens, "token_logprobs": values, "text_offset": offsets,
                "top_logprobs": [_alternatives(top, t, v) for t, v, top in
                                 zip(tokens, values, tops)] if self.top else None}

    def _with_prompt(self, chunk: Chunk, index: int, tokens, values, tops) -> dict:
        """Completion log-probs after the prompt's: its first token has none (nothing comes
        before it), the others the model's, with their most likely alternatives."""
        ids = self.echo.prompts[index][0]
        texts = [self._text(t) for t in ids]
        alternatives = [None] + [
            _alternatives([(self._text(t), p) for t, p in top], text, value)
            for top, text, value in zip(chunk.prompt_top_logprobs or (), texts[1:],
                                        chunk.prompt_logprobs)] if self.top else None
        offsets = self._offsets(texts, index)  # the prompt's text comes first
        tail = self._logprobs(replace(chunk, prompt_logprobs=None), index)
        return {"tokens": texts + tail["tokens"],
                "token_logprobs": [None, *chunk.prompt_logprobs] + tail["token_logprobs"],
                "text_offset": offsets + tail["text_offset"],
                "top_logprobs": alternatives + tail["top_logprobs"] if self.top else None}

    def _offsets(self, texts: list[str], index: int) -> list[int]:
        out = []
        for t in texts:
            out.append(self.offsets[index])
            self.offsets[index] += len(t)
        return out

    def choice(self, chunk: Chunk, stream: bool, first: bool = False, index: int = 0) -> dict:
        if self.echo is not None and self.echo.drop:
            chunk = replace(chunk, ids=(), text="", logprobs=() if chunk.logprobs else None,
                            top_logprobs=() if chunk.top_logprobs else None)
        reason = chunk.reason if chunk.final else None
        out = {"index": index, "logprobs": self._logprobs(chunk, index),
               "finish_reason": reason}
        if not self.chat:
            out["text"] = chunk.text or ""
            if self.echo is not None and (first or not stream):
                out["text"] = self.echo.prompts[index][1] + out["text"]
        elif self.tools is not None:
            self._tool_calls(out, chunk, stream, first, index)
        elif stream:
            out["delta"] = ({"role": "assistant", "content": chunk.text or ""} if first
                            else {"content": chunk.text} if chunk.text else {})
        else:
            out["message"] = {"role": "assistant", "content": chunk.text or ""}
        return out

    def _tool_calls(self, out: dict, chunk: Chunk, stream: bool, first: bool,
                    index: int) -> None:
        """A choice whose text may hold tool calls: the reader (serving/http/tools.py) says
        what content may go now and, at the end, the calls (streamed: one delta carrying
        them whole)."""
        self.held[index] += chunk.text or ""
        content, calls = self.tools.read(self.held[index], self.sent[index], chunk.final)
        self.sent[index] += len(content)
        if calls is not None:
            out["finish_reason"] = "tool_calls"
        if stream:
            delta: dict = {"role": "assistant", "content": content} if first else (
                {"content": content} if content else {})
            if calls is not None:  # deltas name each call's place in the list
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            out["delta"] = delta
        else:
            out["message"] = {"role": "assistant", "content": content or (
                None if calls else "")} | ({"tool_calls": calls} if calls else {})

    def envelope(self, choices: list, stream: bool, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object(stream), "created": self.created,
               "model": self.engine.name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


def token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _alternatives(top: list[tuple[str, float]], text: str, logprob: float) -> dict:
    """A completion position's top_logprobs: text -> log-prob of the most likely tokens and
    the sampled one (as OpenAI's legacy completions give it); the likelier of two tokens
    with one text wins."""
    out: dict[str, float] = {}
    for t, p in top:
        out.setdefault(t, p)
    out.setdefault(text, logprob)
    return out


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _answer(request: Request, shape: _Shape, generations: list[GenerationRequest],
                  stream_opts: dict | None, prompt: int) -> Response:
    """The choices, one per generation (`index` in order), whole or as SSE chunks; `prompt`:
    the prompt tokens of the request (each prompt once, whatever `n`)."""
    streams = ChunkStreams(shape.engine, generations)  # refusals answer with a status here
    counted = (lambda chunk: 0) if shape.echo is not None and shape.echo.drop else (
        lambda chunk: len(chunk.ids))
    if stream_opts is None:
        chosen = await until_disconnect(request.receive, streams.collect(), streams.close)
        if chosen is None:
            return Response(status_code=499)
        for chunks in chosen:
            if chunks[-1].reason not in ("length", "stop"):
                raise RuntimeError(chunks[-1].detail or f"generation ended: {chunks[-1].reason}")
        wholes = [join_chunks(chunks) for chunks in chosen]
        return JSONResponse(shape.envelope(
            [shape.choice(whole, False, index=i) for i, whole in enumerate(wholes)], False,
            _usage(prompt, sum(counted(w) for w in wholes))))

    async def events():
        generated, started = 0, set()
        async for index, chunk in streams:
            if chunk.final and chunk.reason not in ("length", "stop"):
                yield sse({"error": {"message": chunk.detail or chunk.reason,
                                     "type": "internal_error", "param": None, "code": None}})
                break
            generated += counted(chunk)
            yield sse(shape.envelope([shape.choice(chunk, True, index not in started, index)],
                                     True))
            started.add(index)
        else:
            if stream_opts.get("include_usage"):
                yield sse(shape.envelope([], True, _usage(prompt, generated)))
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _stream_options(body: dict) -> dict | None:
    if not body_value(body, "stream", (bool,), False):
        return None
    return body_value(body, "stream_options", (dict,), {})


async def completions(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = text_engine(frontend, body)
    logprobs = body_value(body, "logprobs", (int,))  # k: the k most likely tokens too
    top = None if logprobs is None else top_count("logprobs", logprobs)
    prompts = _completion_prompts(engine, body.get("prompt"))
    n, echo = _choices(engine, body), body_value(body, "echo", (bool,), False)
    max_tokens = _max_tokens(body)
    shape = _Shape(engine, chat=False, top=top, n=n * len(prompts), echo=_Echo(
        tuple(p for p in prompts for _ in range(n)), max_tokens == 0) if echo else None)
    generations = [g for i, (ids, _) in enumerate(prompts) for g in generations_for(
        engine, body, ids, top, shape.id if len(prompts) == 1 else f"{shape.id}-{i}", 16,
        echo)]
    return await _answer(request, shape, generations, _stream_options(body),
                         sum(len(ids) for ids, _ in prompts))


async def chat_completions(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = text_engine(frontend, body)
    if body.get("echo"):
        raise InvalidArgument("'echo' is a parameter of /v1/completions")
    logprobs = body_value(body, "logprobs", (bool,), False)
    top = top_count("top_logprobs", body_value(body, "top_logprobs", (int,), 0))
    if top and not logprobs:
        raise InvalidArgument("'top_logprobs' needs 'logprobs': true")
    tools = tool_reader(body, frontend.tool_parser)
    text = render(engine.text, messages_of(body.get("messages")),
                  body_value(body, "add_generation_prompt", (bool,), True), body.get("tools"))
    prompt = tuple(engine.tokenizer.encode(text, add_special_tokens=False).ids)
    shape = _Shape(engine, chat=True, top=top if logprobs else None, n=_choices(engine, body),
                   tools=tools)
    sampling = {k: v for k, v in body.items() if k not in ("tools", "tool_choice",
                                                             "parallel_tool_calls")}
    generations = generations_for(engine, sampling, prompt, top if logprobs else None,
                                  shape.id)
    if tools is not None and tools.grammar is not None:  # forced calls
        if generations[0].grammar is not None:
            raise InvalidArgument("ask for tool calls or a structured output, not both")
        generations = [replace(g, grammar=tools.grammar) for g in generations]
    return await _answer(request, shape, generations, _stream_options(body), len(prompt))


ROUTES = [("/health", ["GET"], "health", health, error),
          ("/version", ["GET"], "version", version, error),
          ("/v1/models", ["GET"], "v1/models", models, error),
          ("/v1/models/{model:path}", ["GET"], "v1/models/{model}", model, error),
          ("/v1/completions", ["POST"], "v1/completions", completions, error),
          ("/v1/chat/completions", ["POST"], "v1/chat/completions", chat_completions, error)]
