"""An OpenAI-compatible API on the HTTP port (and vLLM's `GET /health` and `/version`, which
its deployments probe): `GET /v1/models[/{model}]` (in a form the anthropic client reads
too), `POST /v1/completions` and `POST
/v1/chat/completions`, whole or streamed (`stream: true`: Server-Sent Events, one chunk per
token chunk, then `data: [DONE]`), with `usage` (its prompt_tokens_details.cached_tokens:
the prompt tokens read from the prefix cache), `max_tokens`, `temperature`, `top_p`,
`seed`, `stop` (strings; vLLM's `stop_reason` names the one that matched), `n` (choices,
each its own stream in the engine; with vLLM's `use_beam_search`, one search's n best
sequences and its `length_penalty`, streamed together at its end), `best_of` (that many
sampled, the n with the highest log-probability per token returned), `logprobs` (of
the sampled tokens, and of the k most likely: completions' `logprobs: k`, chat's
`top_logprobs`), `frequency_penalty`, `presence_penalty` and `logit_bias`, structured output
(`response_format` json_object or json_schema; vLLM's `structured_outputs` and `guided_json`
/ `guided_regex` / `guided_choice` / `guided_grammar`), chat's `tools` (forced calls, or
"auto" with --tool-call-parser: serving/http/tools.py), vLLM's `top_k`, `min_p`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids` and `bad_words`, and its
chat options (`chat_template_kwargs`,
`documents`, `continue_final_message`: serving/http/chat.py). Completions also take a batch
of prompts (choice `index` = prompt * n + choice) and `echo` (the prompt before the
completion; with `logprobs`, every prompt token's log-prob too, the first one null, and
`max_tokens: 0` for the prompt alone): what lm-evaluation-harness sends to score a model;
and `suffix` (code completion: the prompt before the cursor, the suffix after it, in a code
model's fill-in-the-middle format: serving/fill_in_middle.py).
Errors are OpenAI error objects with the matching status; a parameter this server cannot
honour (`tool_choice` "auto" without a parser, a streamed `best_of`, audio output,
`web_search_options`, vLLM's other extras away from their defaults) is
refused rather than ignored. Generation stops at the model's end tokens
(serving/text_config.py: config.json,
generation_config.json, genai_config.json, tokenizer_config.json) unless `ignore_eos`."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import serving
from serving.decoder import DecoderEngine
from serving.errors import ContextTooLong, InvalidArgument, NotFound
from serving.http.chat import chat_prompt
from serving.http.codec import http_status_for
from serving.http.openai_requests import (body_value, candidate_count, choice_count,
                                          completion_prompts, generations_for, max_tokens_of,
                                          model_defaults, text_engine, top_count)
from serving.http.reasoning import Reply, Thinking
from serving.http.streams import ChunkStreams, until_disconnect
from serving.http.tools import Reader, tool_reader
from serving.http.triton_generate import SSE_HEADERS, sse
from serving.sampling import Chunk, GenerationRequest, best_chunks, join_chunks
from serving.tokenizer import token_text

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}
STARTED = int(time.time())


def error(exc: BaseException) -> Response:
    status, message = http_status_for(exc)
    code = "model_not_found" if isinstance(exc, NotFound) else None
    if isinstance(exc, ContextTooLong):  # OpenAI's code and words: LiteLLM and LangChain
        code, message = "context_length_exceeded", _too_long(exc)  # tell an overflow by them
    return JSONResponse({"error": {"message": message, "type": _TYPES.get(status, "error"),
                                   "param": None, "code": code}}, status)


def _too_long(e: ContextTooLong) -> str:
    said = f"This model's maximum context length is {e.context} tokens. However, "
    if e.prompt_alone:
        return said + (f"your prompt has {e.prompt_tokens} tokens (at most {e.prompt_limit} "
                       "are accepted). Please reduce the length of the messages.")
    return said + (f"you requested {e.prompt_tokens + e.max_tokens} tokens "
                   f"({e.prompt_tokens} in the messages, {e.max_tokens} in the completion). "
                   "Please reduce the length of the messages or completion.")


def _model(name: str) -> dict:
    """One model as both OpenAI's and Anthropic's model lists have it (each client reads
    its own fields of the same object)."""
    return {"id": name, "object": "model", "created": STARTED, "owned_by": "shapetuner",
            "type": "model", "display_name": name, "lifecycle": "active",
            "created_at": datetime.fromtimestamp(STARTED, timezone.utc).isoformat()}


async def models(frontend, request: Request) -> Response:
    """OpenAI's and Anthropic's model list, and KServe V1's (`models`: the names): the three
    share the path, each client reads its own keys."""
    name = frontend.slot.name
    return JSONResponse({"object": "list", "data": [_model(name)],
                         "has_more": False, "first_id": name, "last_id": name,
                         "models": [name]})


async def model(frontend, request: Request) -> Response:
    """`client.models.retrieve(name)`: the served model, or 404 model_not_found; KServe V1's
    model readiness on the same path (`name`, `ready`; 503 until the model serves, as
    KServe answers)."""
    name = request.path_params["model"]
    if name != frontend.slot.name:
        raise NotFound(f"The model '{name}' does not exist")
    ready = frontend.slot.ready()
    return JSONResponse(_model(name) | {"name": name, "ready": ready}, 200 if ready else 503)


async def health(frontend, request: Request) -> Response:
    """vLLM's `GET /health`, which its deployments probe: 200 once the model serves (its
    accuracy re-checked), 503 before."""
    return Response(status_code=200 if frontend.slot.ready() else 503)


async def version(frontend, request: Request) -> Response:
    """vLLM's `GET /version`."""
    return JSONResponse({"version": serving.__version__})


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
                 echo: _Echo | None = None, tools: Reader | None = None,
                 thinking: Thinking | None = None) -> None:
        self.engine, self.chat, self.logprobs, self.top = engine, chat, top is not None, top
        self.echo, self.tools, self.thinking = echo, tools, thinking
        # each choice's text so far, when it may hold reasoning or tool calls
        self.replies = [Reply(thinking=thinking, tools=tools) for _ in range(n)]
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
        # vLLM's stop_reason: the stop string that ended the choice (None: an end token or
        # max_tokens did), which OpenAI's finish_reason "stop" does not tell apart
        out = {"index": index, "logprobs": self._logprobs(chunk, index),
               "finish_reason": reason, "stop_reason": chunk.stop if chunk.final else None}
        if not self.chat:
            out["text"] = chunk.text or ""
            if self.echo is not None and (first or not stream):
                out["text"] = self.echo.prompts[index][1] + out["text"]
        elif self.tools is not None or self.thinking is not None:
            self._message(out, chunk, stream, first, index)
        elif stream:
            out["delta"] = ({"role": "assistant", "content": chunk.text or ""} if first
                            else {"content": chunk.text} if chunk.text else {})
        else:
            out["message"] = {"role": "assistant", "content": chunk.text or ""}
        return out

    def _message(self, out: dict, chunk: Chunk, stream: bool, first: bool,
                 index: int) -> None:
        """A choice whose text may hold reasoning (serving/http/reasoning.py) or tool calls:
        the parsers say what reasoning and content may go now and, at the end, the calls
        (streamed: one delta carrying them whole)."""
        thought, content = self.replies[index].add(chunk)
        calls = self.replies[index].calls
        if calls is not None and out["finish_reason"] != "length":  # (a call cut short)
            out["finish_reason"] = "tool_calls"
        # vLLM's field is now `reasoning`; `reasoning_content`, its first name, is what many
        # clients (LangChain's, DeepSeek's SDK examples) read
        thinking = {"reasoning": thought, "reasoning_content": thought} if thought else {}
        if stream:
            delta: dict = {"role": "assistant", "content": content} if first else (
                {"content": content} if content else {})
            delta |= thinking
            if calls is not None:  # deltas name each call's place in the list
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            out["delta"] = delta
        else:
            out["message"] = {"role": "assistant", "content": content or (
                None if calls or thought else "")} | thinking | (
                {"tool_calls": calls} if calls else {})

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


def _usage(prompt: int, completion: int, cached: int | None = None) -> dict:
    """`cached`: of the prompt tokens, those taken from the prefix cache (OpenAI's
    prompt_tokens_details.cached_tokens), when the answer is complete."""
    out = {"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion}
    return out if cached is None else out | {"prompt_tokens_details": {"cached_tokens": cached}}


def _cached(finals: dict[int, Chunk], choices: int, n: int) -> int:
    """Each prompt's tokens taken from the prefix cache by its first choice (choice
    i = prompt * n + k; each prompt is counted once in the usage, whatever `n`)."""
    return sum(finals[i].cached or 0 for i in range(0, choices, n) if i in finals)


async def _answer(request: Request, shape: _Shape, generations: list[GenerationRequest],
                  stream_opts: dict | None, prompt: int, n: int, best: int = 0) -> Response:
    """The choices, one per generation (`index` in order), whole or as SSE chunks; `prompt`:
    the prompt tokens of the request (each prompt once, whatever `n`, the choices a prompt
    has); `best`: the candidates each prompt's n choices are picked from (OpenAI's best_of;
    whole answers only)."""
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
        wholes = best_chunks([c for chunks in chosen for c in _choices(join_chunks(chunks))],
                             n, best or n)
        return JSONResponse(shape.envelope(
            [shape.choice(whole, False, index=i) for i, whole in enumerate(wholes)], False,
            _usage(prompt, sum(counted(w) for w in wholes),
                   _cached(dict(enumerate(wholes)), len(wholes), n))))

    # vLLM's continuous_usage_stats: every chunk carries the usage so far
    running = bool(stream_opts and stream_opts.get("include_usage")
                   and stream_opts.get("continuous_usage_stats"))

    async def events():
        generated, started, finals = 0, set(), {}
        async for stream_index, whole in streams:
            if whole.final and whole.reason not in ("length", "stop"):
                yield sse({"error": {"message": whole.detail or whole.reason,
                                     "type": "internal_error", "param": None, "code": None}})
                break
            beams = _choices(whole)  # (a search's choices come together, at its end)
            for index, chunk in enumerate(beams, stream_index * len(beams)):
                generated += counted(chunk)
                if chunk.final:
                    finals[index] = chunk
                yield sse(shape.envelope([shape.choice(chunk, True, index not in started,
                                                       index)],
                                         True, _usage(prompt, generated) if running else None))
                started.add(index)
        else:
            if stream_opts.get("include_usage"):
                yield sse(shape.envelope([], True, _usage(
                    prompt, generated, _cached(finals, sum(g.returns for g in generations),
                                               n))))
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _choices(chunk: Chunk) -> list[Chunk]:
    """The choices a stream's chunk answers: itself, or a search's beams, each a final chunk
    of its own (vLLM's use_beam_search: the n best sequences, best first)."""
    if chunk.beams is None:
        return [chunk]
    return [replace(chunk, ids=b.ids, text=b.text, reason=b.reason, stop=None, beams=None)
            for b in chunk.beams]


def _stream_options(body: dict) -> dict | None:
    if not body_value(body, "stream", (bool,), False):
        return None
    return body_value(body, "stream_options", (dict,), {})


async def completions(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = text_engine(frontend, body)
    logprobs = body_value(body, "logprobs", (int,))  # k: the k most likely tokens too
    top = None if logprobs is None else top_count("logprobs", logprobs)
    prompts, body = completion_prompts(engine, body)
    n, echo = choice_count(engine, body), body_value(body, "echo", (bool,), False)
    max_tokens = max_tokens_of(body)
    shape = _Shape(engine, chat=False, top=top, n=n * len(prompts), echo=_Echo(
        tuple(p for p in prompts for _ in range(n)), max_tokens == 0) if echo else None)
    generations = [g for i, (ids, _) in enumerate(prompts) for g in generations_for(
        engine, body, ids, top, shape.id if len(prompts) == 1 else f"{shape.id}-{i}", 16,
        echo, model_defaults(frontend, engine))]
    return await _answer(request, shape, generations, _stream_options(body),
                         sum(len(ids) for ids, _ in prompts), n, candidate_count(engine, body))


async def chat_completions(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = text_engine(frontend, body)
    if body.get("echo"):
        raise InvalidArgument("'echo' is a parameter of /v1/completions")
    logprobs = body_value(body, "logprobs", (bool,), False)
    top = top_count("top_logprobs", body_value(body, "top_logprobs", (int,), 0))
    if top and not logprobs:
        raise InvalidArgument("'top_logprobs' needs 'logprobs': true")
    tools = tool_reader(body, frontend.tool_parser, cut_calls=True)
    text = chat_prompt(engine.text, body)
    prompt = tuple(engine.tokenizer.encode(text, add_special_tokens=False).ids)
    thinking = Thinking(frontend.reasoning_parser) if frontend.reasoning_parser else None
    n = choice_count(engine, body)
    shape = _Shape(engine, chat=True, top=top if logprobs else None, n=n, tools=tools,
                   thinking=thinking)
    sampling = {k: v for k, v in body.items() if k not in ("tools", "tool_choice",
                                                             "parallel_tool_calls")}
    generations = generations_for(engine, sampling, prompt, top if logprobs else None,
                                  shape.id, defaults=model_defaults(frontend, engine))
    if tools is not None and tools.grammar is not None:  # forced calls
        if generations[0].grammar is not None:
            raise InvalidArgument("ask for tool calls or a structured output, not both")
        generations = [replace(g, grammar=tools.grammar) for g in generations]
    if thinking is not None:  # a grammar holds the answer after the thinking
        generations = [replace(g, grammar=thinking.constrain(g.grammar)) for g in generations]
    return await _answer(request, shape, generations, _stream_options(body), len(prompt), n,
                         candidate_count(engine, body))


ROUTES = [("/health", ["GET"], "health", health, error),
          ("/version", ["GET"], "version", version, error),
          ("/v1/models", ["GET"], "v1/models", models, error),
          ("/v1/models/{model:path}", ["GET"], "v1/models/{model}", model, error),
          ("/v1/completions", ["POST"], "v1/completions", completions, error),
          ("/v1/chat/completions", ["POST"], "v1/chat/completions", chat_completions, error)]
