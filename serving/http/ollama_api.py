"""Ollama's API, for the clients written against a local Ollama server: the `ollama` Python
client (and LangChain's ChatOllama / OllamaEmbeddings, LlamaIndex's Ollama classes on it),
Open WebUI, editor plugins. Point them at this server's HTTP port (`OLLAMA_HOST`):

  GET  /api/version, /api/tags, /api/ps       the served model (named NAME or NAME:latest)
  POST /api/show        {"model"}: its chat template, what it can do
  POST /api/generate    {"model", "prompt", "system", "raw", "context", "format", "options",
                        "stream", "logprobs", "top_logprobs"}: the prompt as the user's turn
                        of the chat template (as is with `raw` or without a template);
                        `context` (the ids a previous answer returned) goes before it
  POST /api/chat        {"model", "messages", "format", "options", "stream", ...}
  POST /api/embed       {"model", "input", "truncate", "dimensions"}: unit vectors
  POST /api/embeddings  {"model", "prompt"}: Ollama's older call, one vector as the model
                        gives it

A decoder artifact with a tokenizer generates; an encoder artifact embeds. Answers stream as
Ollama streams them (its default, `stream` true): one JSON object a line, the last one
`done` with `done_reason` and the counts and durations (ns). An empty prompt (or no
messages) answers `done_reason` "load", as Ollama does to warm a model.

`options` map onto the same generation requests as the OpenAI API's
(serving/http/ollama_options.py): num_predict (-1 / -2: as many as the cache and
--max-tokens allow), temperature, top_k, top_p, min_p, seed, stop, repeat_penalty over the
last repeat_last_n ids (0: off, -1: all), presence_penalty, frequency_penalty (over the
output, as OpenAI's), each left out Ollama's own default. Images and `template` are refused;
a `suffix` (code completion: the text after the cursor) writes the prompt in a code model's
fill-in-the-middle format (serving/fill_in_middle.py), and a model without one is refused
as Ollama refuses it ("does not support insert"). A chat's `tools` come back as the
message's `tool_calls` when the server reads the model's own call syntax
(--tool-call-parser), and its thinking as the message's `thinking` with --reasoning-parser
(unless `think` is false); without them each is refused.
A prompt past the context is cut as Ollama cuts it (serving/http/ollama_context.py); errors
are Ollama's {"error": message}, 404 for a model not served, 400 for a bad request."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import datetime, timezone

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import serving
from serving.decoder import DecoderEngine
from serving.embedding import normalized
from serving.errors import ContextTooLong, InvalidArgument, NotFound
from serving.fill_in_middle import fim_format
from serving.http.chat import chat_prompt
from serving.http.codec import http_status_for
from serving.http.embeddings_api import embed_rows, embedder_of, encoder_named, texts_of
from serving.http.ollama_context import fitted
from serving.http.ollama_options import generation_of
from serving.http.openai_requests import body_value, text_generator
from serving.http.reasoning import Reply, Thinking
from serving.http.streams import ChunkStream
from serving.http.tei_api import dimensions_of, text_rows
from serving.http.tools import PARSERS, tool_reader
from serving.sampling import Chunk
from serving.tokenizer import token_text

_STARTED = datetime.now(timezone.utc).isoformat()


def error(exc: BaseException) -> Response:
    status, message = http_status_for(exc)
    status = 503 if status == 429 else status  # Ollama answers a full queue "server busy" 503
    if isinstance(exc, ContextTooLong):  # an input to embed, with `truncate` false
        message = "input length exceeds maximum context length"  # Ollama's words
    return JSONResponse({"error": message}, status)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _served(frontend, body: dict) -> str:
    """The model a body names, NAME or NAME:latest: Ollama's clients always name one."""
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise InvalidArgument("'model' is required")
    if name.removesuffix(":latest") != frontend.slot.name:
        raise NotFound(f"model '{name}' not found (this server serves "
                       f"'{frontend.slot.name}')")
    return name


def _decoder(frontend, body: dict) -> tuple[str, DecoderEngine]:
    name = _served(frontend, body)
    return name, text_generator(frontend.slot.find(frontend.slot.name), name)


def _refuse(body: dict) -> None:
    if body.get("images") or any(m.get("images") for m in body.get("messages") or []
                                 if isinstance(m, dict)):
        raise InvalidArgument("images are not supported: this model reads text")
    if body.get("template"):
        raise InvalidArgument("'template' is not supported")


def _reply(frontend, body: dict) -> Reply:
    """How a chat's reply is read: its thinking apart (`think` not false, with the server's
    --reasoning-parser) and the model's own tool calls (with --tool-call-parser; Ollama's
    model always decides whether to call)."""
    think = body_value(body, "think", (bool, str))
    if think not in (None, False) and frontend.reasoning_parser is None:
        raise InvalidArgument("'think' needs the model's thinking told apart: start the server "
                              "with --reasoning-parser")
    if body.get("tools") and frontend.tool_parser is None:
        raise InvalidArgument("'tools' need the model's own call syntax read: start the server "
                              f"with --tool-call-parser ({' | '.join(PARSERS)})")
    thinking = Thinking(frontend.reasoning_parser) if frontend.reasoning_parser and \
        think is not False else None
    return Reply(thinking=thinking, tools=tool_reader({"tools": body.get("tools")},
                                                      frontend.tool_parser))


def _ollama_call(call: dict) -> dict:
    """An OpenAI tool call as Ollama's: the arguments an object, not JSON text."""
    function = call["function"]
    return {"function": {"name": function["name"],
                         "arguments": json.loads(function["arguments"] or "{}")}}


def _logprobs(engine: DecoderEngine, chunk: Chunk) -> list[dict] | None:
    if chunk.logprobs is None:
        return None

    def entry(token: int, logprob: float) -> dict:
        text = token_text(engine.tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    tops = chunk.top_logprobs or [()] * len(chunk.ids)
    return [{**entry(t, p), "top_logprobs": [entry(i, q) for i, q in top]}
            for t, p, top in zip(chunk.ids, chunk.logprobs, tops)]


def _line(obj: dict) -> bytes:
    return orjson.dumps(obj) + b"\n"


@dataclasses.dataclass
class _Answer:
    """The objects of one answer: each chunk's text (a chat's through its Reply: thinking
    apart, tool calls read out), the last one `done` with the counts."""

    engine: DecoderEngine
    model: str
    prompt: tuple[int, ...]
    reply: Reply | None = None  # a chat's (None: /api/generate's `response` text)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    first: float | None = None
    ids: list[int] = dataclasses.field(default_factory=list)

    def arrived(self, chunk: Chunk) -> None:
        """When the first token was made: the prompt's time ends there, the tokens' begins
        (the chunk's own time: this thread may read a stream's chunks late, all at once)."""
        if self.first is None:
            self.first = chunk.at

    def take(self, chunk: Chunk) -> dict | None:
        """The object for `chunk` (None when it releases nothing to send)."""
        self.arrived(chunk)
        self.ids += chunk.ids
        out = {"model": self.model, "created_at": _now()}
        if self.reply is None:
            out["response"] = chunk.text or ""
        else:
            thought, content = self.reply.add(chunk)
            message = {"role": "assistant", "content": content}
            message |= {"thinking": thought} if thought else {}
            if chunk.final and self.reply.calls:
                message["tool_calls"] = [_ollama_call(c) for c in self.reply.calls]
            out["message"] = message
        logprobs = _logprobs(self.engine, chunk)
        out |= {"logprobs": logprobs} if logprobs is not None else {}
        if chunk.final:
            return out | self._done(chunk)
        said = out["response"] if self.reply is None else \
            out["message"]["content"] or "thinking" in out["message"]
        return out if said or logprobs else None

    def _done(self, last: Chunk) -> dict:
        reason, end = last.reason, last.at  # the last token's time, as it was made
        first = self.first or end
        ns = lambda seconds: int(seconds * 1e9)  # noqa: E731
        out = {"done": True, "done_reason": reason, "total_duration": ns(end - self.started),
               "load_duration": 0, "prompt_eval_count": len(self.prompt),
               "prompt_eval_duration": ns(first - self.started), "eval_count": len(self.ids),
               "eval_duration": ns(end - first)}
        return out if self.reply is not None else out | {"context": [*self.prompt, *self.ids]}


async def _answer(frontend, request: Request, body: dict, answer: _Answer) -> Response:
    thinking = answer.reply.thinking if answer.reply is not None else None
    generation = generation_of(answer.engine, body, answer.prompt, thinking)
    stream = ChunkStream(answer.engine, generation)  # a refusal answers with a status here
    if not body_value(body, "stream", (bool,), True):
        whole = await stream.whole(request.receive, answer.arrived)
        return Response(status_code=499) if whole is None else JSONResponse(answer.take(whole))

    async def lines():
        async for chunk in stream:
            if chunk.reason not in (None, "length", "stop"):
                yield _line({"error": chunk.detail or f"generation ended: {chunk.reason}"})
                return
            out = answer.take(chunk)
            if out is not None:
                yield _line(out)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _loaded(model: str, chat: bool) -> Response:
    """Ollama's answer to a request with nothing to generate from: the model is loaded."""
    out = {"model": model, "created_at": _now(), "done": True, "done_reason": "load"}
    return JSONResponse(out | ({"message": {"role": "assistant", "content": ""}} if chat
                               else {"response": ""}))


async def generate(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    model, engine = _decoder(frontend, body)
    prompt, context = body.get("prompt") or "", body_value(body, "context", (list,), []) or []
    if not isinstance(prompt, str):
        raise InvalidArgument("'prompt' must be a string")
    _refuse(body)
    if body.get("think") not in (None, False):
        raise InvalidArgument("'think' is answered on /api/chat here (with the server's "
                              "--reasoning-parser)")
    if not prompt and not context:
        return _loaded(model, chat=False)
    system, suffix = body_value(body, "system", (str,)), body_value(body, "suffix", (str,))
    fim = fim_format(engine.tokenizer) if suffix else None
    if suffix and fim is None:
        raise InvalidArgument(f'"{model}" does not support insert')  # Ollama's words
    if body_value(body, "raw", (bool,), False) or engine.text.chat_template is None and not fim:
        if system:
            raise InvalidArgument("'system' needs the model's chat template (not 'raw')")
        text, special = prompt, not context
    elif fim is not None:  # code completion: the text before and after the cursor
        text, special = fim.text(prompt, suffix), not context
    else:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [{"role": "user", "content": prompt}]
        text, special = chat_prompt(engine.text, {"messages": messages}), False
    if any(isinstance(t, bool) or not isinstance(t, int) for t in context):
        raise InvalidArgument("'context' must be the token ids a previous answer returned")
    ids = tuple(context) + tuple(engine.tokenizer.encode(text, add_special_tokens=special).ids)
    return await _answer(frontend, request, body, _Answer(engine, model,
                                                          fitted(engine.generator, body, ids)))


async def chat(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    model, engine = _decoder(frontend, body)
    _refuse(body)
    reply = _reply(frontend, body)
    if not body.get("messages"):
        return _loaded(model, chat=True)

    def encode(messages: list[dict]) -> tuple[int, ...]:
        text = chat_prompt(engine.text, {"messages": messages, "tools": body.get("tools")})
        return tuple(engine.tokenizer.encode(text, add_special_tokens=False).ids)

    ids = fitted(engine.generator, body, encode(body["messages"]), body["messages"], encode)
    return await _answer(frontend, request, body, _Answer(engine, model, ids, reply))


async def _vectors(frontend, body: dict, texts: list[str], unit: bool) -> tuple[list, int]:
    """Each text's embedding (unit vectors, cut to `dimensions` first, when `unit`) and the
    tokens read."""
    engine = encoder_named(frontend, frontend.slot.name)
    embedder = embedder_of(engine)
    rows = text_rows(embedder, texts, body)  # cut, or refused with `truncate` false, as TEI's
    dimensions = body.get("dimensions")
    if embedder.pooled and dimensions is not None:
        raise InvalidArgument(f"model '{engine.name}' pools inside its graph: 'dimensions' "
                              "needs the vector before that, which it does not give")
    outputs = await embed_rows(frontend, engine, embedder, rows)
    if embedder.pooled:
        vectors = [embedder.vector(o) for o in outputs]
    else:
        raw = [embedder.unnormalized(o) for o in outputs]
        size = dimensions_of(body, len(raw[0]))
        vectors = [normalized(v[:size]) if unit else v[:size] for v in raw]
    return [v.tolist() for v in vectors], sum(len(r) for r in rows)


async def embed(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    model, start = _served(frontend, body), time.perf_counter()
    texts = texts_of(body.get("input"))
    if any(not isinstance(t, str) for t in texts):
        raise InvalidArgument("'input' must be a string or a list of strings")
    vectors, tokens = await _vectors(frontend, body, texts, unit=True)
    return JSONResponse({"model": model, "embeddings": vectors,
                         "total_duration": int((time.perf_counter() - start) * 1e9),
                         "load_duration": 0, "prompt_eval_count": tokens})


async def embeddings(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    _served(frontend, body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidArgument("'prompt' must be a non-empty string")
    vectors, _ = await _vectors(frontend, body, [prompt], unit=False)
    return JSONResponse({"embedding": vectors[0]})


def _model_entry(frontend) -> dict:
    name = f"{frontend.slot.name}:latest"
    return {"name": name, "model": name, "modified_at": _STARTED,
            "details": {"format": "onnx", "family": "", "families": None,
                        "parameter_size": "", "quantization_level": ""}}


async def version(frontend, request: Request) -> Response:
    return JSONResponse({"version": serving.__version__})


async def tags(frontend, request: Request) -> Response:
    return JSONResponse({"models": [_model_entry(frontend)]})


async def ps(frontend, request: Request) -> Response:
    return JSONResponse({"models": [_model_entry(frontend)] if frontend.slot.ready() else []})


async def show(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    _served(frontend, body)
    engine = frontend.slot.find(frontend.slot.name)
    decoder = isinstance(engine, DecoderEngine)
    template = engine.text.chat_template if decoder and engine.tokenizer else None
    return JSONResponse({"modelfile": "", "parameters": "", "template": template or "",
                         "details": _model_entry(frontend)["details"], "model_info": {},
                         "capabilities": ["completion"] if decoder else ["embedding"],
                         "modified_at": _STARTED})


ROUTES = [("/api/version", ["GET"], "ollama/version", version, error),
          ("/api/tags", ["GET"], "ollama/tags", tags, error),
          ("/api/ps", ["GET"], "ollama/ps", ps, error),
          ("/api/show", ["POST"], "ollama/show", show, error),
          ("/api/generate", ["POST"], "ollama/generate", generate, error),
          ("/api/chat", ["POST"], "ollama/chat", chat, error),
          ("/api/embed", ["POST"], "ollama/embed", embed, error),
          ("/api/embeddings", ["POST"], "ollama/embeddings", embeddings, error)]
