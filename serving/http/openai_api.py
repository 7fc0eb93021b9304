"""An OpenAI-compatible API on the HTTP port: `GET /v1/models`, `POST /v1/completions` and
`POST /v1/chat/completions`, whole or streamed (`stream: true`: Server-Sent Events, one
chunk per token chunk, then `data: [DONE]`), with `usage`, `max_tokens`, `temperature`,
`top_p`, `seed`, `stop` (strings), `logprobs` (of the sampled tokens), and vLLM's `top_k`,
`min_tokens` and `ignore_eos`. Errors are OpenAI error objects with the matching status.
Generation stops at the model's end token (config.json / tokenizer_config.json) unless
`ignore_eos`."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument, NotFound
from serving.http.chat import messages_of, render
from serving.http.codec import http_status_for
from serving.http.streams import ChunkStream, until_disconnect
from serving.http.triton_generate import SSE_HEADERS, sse
from serving.sampling import Chunk, GenerationRequest, Sampling

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error"}
STARTED = int(time.time())


def error(exc: BaseException) -> Response:
    status, message = http_status_for(exc)
    code = "model_not_found" if isinstance(exc, NotFound) else None
    return JSONResponse({"error": {"message": message, "type": _TYPES.get(status, "error"),
                                   "param": None, "code": code}}, status)


async def models(frontend, request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [
        {"id": frontend.slot.name, "object": "model", "created": STARTED,
         "owned_by": "shapetuner"}]})


# ----------------------------------------------------------------------------- requests


def _get(body: dict, name: str, kinds: tuple, default=None):
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
    if _get(body, "n", (int,), 1) != 1:
        raise InvalidArgument("'n' must be 1: one choice per request")
    for name in ("frequency_penalty", "presence_penalty"):
        if _get(body, name, (int, float), 0) != 0:
            raise InvalidArgument(f"'{name}' is not supported (leave it 0)")
    if body.get("echo"):
        raise InvalidArgument("'echo' is not supported")


def _request(engine: DecoderEngine, body: dict, prompt: tuple[int, ...], logprobs: bool,
             request_id: str, default_max_tokens: int | None = None) -> GenerationRequest:
    """The generation a body asks for; without max_tokens, `default_max_tokens` (OpenAI's
    16 for completions) or, for chat, as many as the cache and --max-tokens leave room for."""
    _check_unsupported(body)
    room = engine.generator.max_cache_len - len(prompt) + 1
    limit = default_max_tokens or min(engine.options.max_tokens, max(1, room))
    max_tokens = _get(body, "max_completion_tokens", (int,)) or _get(body, "max_tokens", (int,))
    stop_ids = frozenset() if _get(body, "ignore_eos", (bool,), False) else \
        frozenset(engine.text.eos_ids)
    sampling = Sampling(float(_get(body, "temperature", (int, float), 1.0)),
                        _get(body, "top_k", (int,), 0) if body.get("top_k") != -1 else 0,
                        float(_get(body, "top_p", (int, float), 1.0)),
                        _get(body, "seed", (int,)))
    return GenerationRequest(prompt, limit if max_tokens is None else max_tokens, sampling,
                             stop_ids, request_id, min_tokens=_get(body, "min_tokens", (int,), 0),
                             stop_strings=_stops(body), logprobs=logprobs)


def _engine(frontend, body: dict) -> DecoderEngine:
    name = body.get("model")
    if not isinstance(name, str):
        raise InvalidArgument("'model' must be the name of a served model")
    engine = frontend.slot.find(name)
    if not isinstance(engine, DecoderEngine) or engine.tokenizer is None:
        raise InvalidArgument(f"model '{name}' does not generate text (it needs a decoder "
                              "artifact with tokenizer.json)")
    return engine


def _completion_prompt(engine: DecoderEngine, prompt) -> tuple[int, ...]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        return tuple(engine.tokenizer.encode(prompt).ids)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and
                                                   not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    raise InvalidArgument("'prompt' must be a string or a list of token ids (one prompt)")


# ---------------------------------------------------------------------------- responses


class _Shape:
    """How one endpoint writes choices: completions put text and token log-probs in the
    choice; chat puts a message (a delta when streaming) and content log-probs."""

    def __init__(self, engine: DecoderEngine, chat: bool, logprobs: bool) -> None:
        self.engine, self.chat, self.logprobs = engine, chat, logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offset = 0  # completions' text_offset

    def object(self, stream: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def _logprobs(self, chunk: Chunk):
        if not self.logprobs:
            return None
        tokens = [self.engine.tokenizer.decode([t], skip_special_tokens=False)
                  for t in chunk.ids]
        values = list(chunk.logprobs or ())
        if self.chat:
            return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()),
                                 "top_logprobs": []} for t, v in zip(tokens, values)]}
        offsets = []
        for t in tokens:
            offsets.append(self.offset)
            self.offset += len(t)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": None,
                "text_offset": offsets}

    def choice(self, chunk: Chunk, stream: bool, first: bool = False) -> dict:
        reason = chunk.reason if chunk.final else None
        out = {"index": 0, "logprobs": self._logprobs(chunk), "finish_reason": reason}
        if not self.chat:
            out["text"] = chunk.text or ""
        elif stream:
            out["delta"] = ({"role": "assistant", "content": chunk.text or ""} if first
                            else {"content": chunk.text} if chunk.text else {})
        else:
            out["message"] = {"role": "assistant", "content": chunk.text or ""}
        return out

    def envelope(self, choices: list, stream: bool, usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": self.object(stream), "created": self.created,
               "model": self.engine.name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _joined(chunks: list[Chunk]) -> Chunk:
    last = chunks[-1]
    logprobs = tuple(p for c in chunks for p in (c.logprobs or ()))
    return Chunk(tuple(t for c in chunks for t in c.ids), "".join(c.text or "" for c in chunks),
                 True, last.reason, last.detail, logprobs)


async def _answer(request: Request, shape: _Shape, generation: GenerationRequest,
                  stream_opts: dict | None) -> Response:
    engine = shape.engine
    stream = ChunkStream(engine, generation)  # refusals answer with a status here
    if stream_opts is None:
        chunks = await until_disconnect(request.receive, stream.collect(), stream.close)
        if chunks is None:
            return Response(status_code=499)
        if chunks[-1].reason not in ("length", "stop"):
            raise RuntimeError(chunks[-1].detail or f"generation ended: {chunks[-1].reason}")
        whole = _joined(chunks)
        return JSONResponse(shape.envelope([shape.choice(whole, False)], False,
                                           _usage(len(generation.prompt), len(whole.ids))))

    async def events():
        generated, first = 0, True
        async for chunk in stream:
            if chunk.final and chunk.reason not in ("length", "stop"):
                yield sse({"error": {"message": chunk.detail or chunk.reason,
                                     "type": "internal_error", "param": None, "code": None}})
                break
            generated += len(chunk.ids)
            yield sse(shape.envelope([shape.choice(chunk, True, first)], True))
            first = False
        else:
            if stream_opts.get("include_usage"):
                yield sse(shape.envelope([], True, _usage(len(generation.prompt), generated)))
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


def _stream_options(body: dict) -> dict | None:
    if not _get(body, "stream", (bool,), False):
        return None
    return _get(body, "stream_options", (dict,), {})


async def completions(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = _engine(frontend, body)
    logprobs = _get(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= 1:
        raise InvalidArgument("'logprobs' must be 0 or 1: the log-probability of each "
                              "sampled token is given, not the top alternatives")
    prompt = _completion_prompt(engine, body.get("prompt"))
    shape = _Shape(engine, chat=False, logprobs=logprobs is not None)
    generation = _request(engine, body, prompt, logprobs is not None, shape.id, 16)
    return await _answer(request, shape, generation, _stream_options(body))


async def chat_completions(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = _engine(frontend, body)
    logprobs = _get(body, "logprobs", (bool,), False)
    if _get(body, "top_logprobs", (int,), 0):
        raise InvalidArgument("'top_logprobs' is not supported: 'logprobs' gives the "
                              "log-probability of each sampled token")
    text = render(engine.text, messages_of(body.get("messages")),
                  _get(body, "add_generation_prompt", (bool,), True))
    prompt = tuple(engine.tokenizer.encode(text, add_special_tokens=False).ids)
    shape = _Shape(engine, chat=True, logprobs=logprobs)
    generation = _request(engine, body, prompt, logprobs, shape.id)
    return await _answer(request, shape, generation, _stream_options(body))


ROUTES = [("/v1/models", ["GET"], "v1/models", models, error),
          ("/v1/completions", ["POST"], "v1/completions", completions, error),
          ("/v1/chat/completions", ["POST"], "v1/chat/completions", chat_completions, error)]
