"""OpenAI's Responses API, `POST /v1/responses`: what the openai client's `responses.create`
and `responses.stream`, and the agent frameworks built on them, send a decoder with a chat
template. `input` is a string (one user message) or a list of messages (`role`, `content` as
a string or `input_text` / `output_text` parts; `"type": "message"` optional);
`instructions` comes first as a system message; `max_output_tokens`, `temperature`, `top_p`,
`top_logprobs` with `include: ["message.output_text.logprobs"]`, structured output
(`text.format` json_object or json_schema), `metadata` (answered back) and vLLM's sampling
extras (`top_k`, `min_tokens`, `seed`, `repetition_penalty`, `ignore_eos`) as on
/v1/chat/completions. Function tools, `tool_choice` and the earlier turns' `function_call` /
`function_call_output` items work as chat completions' tools (serving/http/tools.py: forced
calls from any model, "auto" with --tool-call-parser); calls come back as `function_call`
output items after the message (when there is text). With --reasoning-parser a reasoning
model's thinking is a `reasoning` item before the message (serving/http/reasoning.py).
Answered whole, or with `stream: true` as the API's typed events, each `event: TYPE` with
its `sequence_number`: response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta (one per token chunk),
response.output_text.done, response.content_part.done, response.output_item.done (the
reasoning item first: output_item.added, response.reasoning_text.delta..., .done,
output_item.done), for each call response.output_item.added,
response.function_call_arguments.delta and .done, response.output_item.done, then
response.completed, or response.incomplete when `max_output_tokens` cut the answer (a
forced call cut so is an `incomplete` function_call, its arguments as far as they came;
response.failed when the engine failed).

Responses are kept (`store`, true by default as OpenAI's; serving/http/response_store.py):
`previous_response_id` continues a kept conversation, `GET` / `DELETE /v1/responses/{id}`
return and forget one. `background: true` answers at once (queued) while the generation
runs on; GET polls it, `POST /v1/responses/{id}/cancel` stops it. What cannot be honoured is
refused with 400 rather than ignored: `conversation`, `background` with `stream`, built-in
tools, reasoning settings (effort, summaries) and `truncation: auto`."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument
from serving.http.chat import render
from serving.http.openai_api import error, token_entry
from serving.http.openai_requests import (SAMPLING, body_value, generations_for,
                                          model_defaults, text_engine, top_count)
from serving.http.reasoning import Reply, Thinking
from serving.http.response_store import Stored
from serving.http.responses_background import cancel, in_background
from serving.http.responses_items import chat_tools, function_call, messages, reply, turn
from serving.http.streams import ChunkStream
from serving.http.tools import Reader, tool_reader
from serving.http.triton_generate import SSE_HEADERS
from serving.sampling import Chunk, Grammar
from serving.tokenizer import token_text

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for them
# what agent frameworks ask for to send a reasoning model's thinking back when nothing is
# stored: here the reasoning item carries its text in the clear, and is taken back as it is
ENCRYPTED = "reasoning.encrypted_content"


def _refuse_unsupported(body: dict) -> None:
    if body.get("conversation"):
        raise InvalidArgument("'conversation' is not supported (responses are kept in memory "
                              "for previous_response_id, not as conversations)")
    if body_value(body, "background", (bool,), False):
        if not body_value(body, "store", (bool,), True):
            raise InvalidArgument("'background' needs 'store': a background response is "
                                  "fetched later")
        if body_value(body, "stream", (bool,), False):
            raise InvalidArgument("'background' with 'stream' is not supported: poll GET "
                                  "/v1/responses/{id}")
    reasoning = body_value(body, "reasoning", (dict,), {}) or {}
    if any(v is not None for v in reasoning.values()):
        raise InvalidArgument("'reasoning' settings are not supported (a reasoning model's "
                              "effort and summaries are not controlled here)")
    if body.get("truncation") not in (None, "disabled"):
        raise InvalidArgument("'truncation' must be 'disabled': an input too long for the "
                              "model is refused, not cut")
    include = body_value(body, "include", (list,), []) or []
    if any(x not in (LOGPROBS, ENCRYPTED) for x in include):
        raise InvalidArgument(f"'include' may only name {LOGPROBS!r} and {ENCRYPTED!r}")


def _format(body: dict) -> Grammar | None:
    """`text.format`: text, json_object, or json_schema with its `schema` (structured
    output)."""
    fmt = (body_value(body, "text", (dict,), {}) or {}).get("format") or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        return Grammar.of("json", {"type": "object"})
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise InvalidArgument("'text.format' json_schema needs 'schema', a JSON schema "
                                  "object")
        return Grammar.of("json", fmt["schema"])
    if kind != "text":
        raise InvalidArgument(f"'text.format' {kind!r} is not supported (text, json_object, "
                              "json_schema)")
    return None


@dataclass(kw_only=True)
class _Answer(Reply):
    """One response as it is built: its ids and settings, its text so far and what of it is
    the reasoning, the message's content and the calls (Reply), its log-prob entries."""

    engine: DecoderEngine
    body: dict
    prompt: int  # tokens
    logprobs: bool
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    item: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    thought: str = field(default_factory=lambda: "rs_" + uuid.uuid4().hex)  # its item's id
    created: int = field(default_factory=lambda: int(time.time()))
    tokens: list = field(default_factory=list)  # log-prob entries, when asked
    pending: list = field(default_factory=list)  # entries not yet sent with a delta
    sequence: int = 0

    def add(self, chunk: Chunk) -> tuple[str, str]:
        if self.logprobs:
            tops = list(chunk.top_logprobs or ()) + [()] * len(chunk.ids)
            entries = [{**token_entry(self._text(t), p),
                        "top_logprobs": [token_entry(self._text(a), q) for a, q in top]}
                       for t, p, top in zip(chunk.ids, chunk.logprobs or (), tops)]
            self.tokens += entries
            self.pending += entries
        return super().add(chunk)

    def sent(self) -> list:
        """The log-prob entries a delta carries now (those since the last delta)."""
        out, self.pending = self.pending, []
        return out

    def _text(self, token: int) -> str:
        return token_text(self.engine.tokenizer, token)

    def part(self) -> dict:
        return {"type": "output_text", "text": self.content, "annotations": [],
                "logprobs": self.tokens}

    @property
    def has_message(self) -> bool:
        """A reply of tool calls alone, or of thinking cut short, has no message item."""
        return bool(self.content) or not (self.calls or self.reasoning)

    def message(self, status: str, content: list) -> dict:
        return {"id": self.item, "type": "message", "status": status, "role": "assistant",
                "content": content}

    def thinking_item(self, status: str, text: str | None = None) -> dict:
        text = self.reasoning if text is None else text
        return {"id": self.thought, "type": "reasoning", "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}] if text else []}

    def output(self, status: str) -> list[dict]:
        """The finished output items: the reasoning, the message, then the calls."""
        thinking = [self.thinking_item("completed")] if self.reasoning else []
        message = [self.message(status, [self.part()])] if self.has_message else []
        calls = list(self.calls or ())  # (a forced call cut by max_output_tokens: the last)
        return thinking + message + [function_call(c, "incomplete" if status == "incomplete" and
                                                   k == len(calls) - 1 else "completed")
                                     for k, c in enumerate(calls)]

    def response(self, status: str, output: list, failure: str | None = None) -> dict:
        b = self.body
        done = status in ("completed", "incomplete")
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "completed_at": int(time.time()) if done else None, "status": status,
            "error": None if failure is None else {"code": "server_error", "message": failure},
            "incomplete_details": None if status != "incomplete" else {
                "reason": "max_output_tokens"},
            "instructions": b.get("instructions"), "max_output_tokens": b.get(
                "max_output_tokens"), "model": self.engine.name, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "background": bool(b.get("background", False)),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": b.get("store", True), "temperature": b.get("temperature", 1.0),
            "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [], "top_logprobs": b.get("top_logprobs", 0),
            "top_p": b.get("top_p", 1.0), "truncation": "disabled",
            "usage": None if not done else {
                "input_tokens": self.prompt,
                "input_tokens_details": {"cached_tokens": self.cached,
                                         "cache_write_tokens": 0},
                "output_tokens": self.generated,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt + self.generated},
            "user": b.get("user"), "metadata": b.get("metadata") or {}}

    def final(self, chunk: Chunk) -> dict:
        """The finished response (the chunk is the generation's last)."""
        status = "completed" if chunk.reason == "stop" else "incomplete"
        return self.response(status, self.output(status))

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def responses(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = text_engine(frontend, body)
    _refuse_unsupported(body)
    store = body_value(body, "store", (bool,), True)
    previous = body_value(body, "previous_response_id", (str,))
    history = [*(frontend.responses.get(previous).messages if previous else ()), *turn(body)]
    tools = chat_tools(body)
    reader = tool_reader(tools, frontend.tool_parser, cut_calls=True)
    text = render(engine.text, messages(body, history), True, tools["tools"])
    prompt = tuple(engine.tokenizer.encode(text, add_special_tokens=False).ids)
    logprobs = LOGPROBS in (body.get("include") or [])
    top = top_count("top_logprobs", body_value(body, "top_logprobs", (int,), 0))
    max_tokens = body_value(body, "max_output_tokens", (int,))
    if max_tokens is not None and max_tokens < 1:
        raise InvalidArgument(f"'max_output_tokens' must be >= 1, not {max_tokens}")
    thinking = Thinking(frontend.reasoning_parser) if frontend.reasoning_parser else None
    defaults = model_defaults(frontend, engine)
    shown = {k: defaults[k] for k in ("temperature", "top_p") if k in defaults} | body
    answer = _Answer(engine=engine, body=shown, prompt=len(prompt), logprobs=logprobs,
                     tools=reader, thinking=thinking)  # (it reports what it samples with)
    asked = {k: body[k] for k in SAMPLING if k in body} | {"max_tokens": max_tokens}
    (generation,) = generations_for(engine, asked, prompt, top if logprobs else None, answer.id,
                                    defaults=defaults)
    grammar = _grammar(body, reader)
    if thinking is not None:  # a grammar holds the answer after the thinking
        grammar = thinking.constrain(grammar)
    generation = replace(generation, grammar=grammar)
    stream = ChunkStream(engine, generation)  # refusals answer with a status here

    def kept(final: dict) -> None:  # a finished response, stored when asked (the default)
        if store:
            frontend.responses.put(Stored(
                (*history, reply(answer.content, answer.calls)), final))

    if body_value(body, "background", (bool,), False):
        return JSONResponse(in_background(frontend, answer, stream, kept))
    if not body_value(body, "stream", (bool,), False):
        whole = await stream.whole(request.receive)
        if whole is None:
            return Response(status_code=499)
        answer.add(whole)
        final = answer.final(whole)
        kept(final)
        return JSONResponse(final)
    return StreamingResponse(_events(answer, stream, kept), media_type="text/event-stream",
                             headers=SSE_HEADERS)


def _grammar(body: dict, reader: Reader | None) -> Grammar | None:
    """`text.format`'s grammar, or the forced tool calls' (not both)."""
    fmt = _format(body)
    forced = reader.grammar if reader is not None else None
    if fmt is not None and forced is not None:
        raise InvalidArgument("ask for tool calls or a structured output, not both")
    return fmt or forced


async def _events(a: _Answer, stream: ChunkStream, kept: Callable[[dict], None]):
    """The typed events of one streamed response, in the API's order: the reasoning item
    (when the model thinks) opened by its first thought and closed when the answer starts,
    the message item opened by its first text (or at the end, when there are no calls),
    then the calls. Items take their output_index in that order."""
    yield a.event("response.created", response=a.response("in_progress", []))
    yield a.event("response.in_progress", response=a.response("in_progress", []))
    items = 0  # output items opened so far
    thinking: int | None = None  # the reasoning item's index, while it is open
    message: int | None = None  # the message item's index, once opened
    async for chunk in stream:
        if chunk.final and chunk.reason not in ("length", "stop"):
            failure = chunk.detail or f"generation ended: {chunk.reason}"
            yield a.event("response.failed", response=a.response("failed", [], failure=failure))
            return
        thought, piece = a.add(chunk)
        if thought:
            if thinking is None:
                thinking, items = items, items + 1
                yield a.event("response.output_item.added", output_index=thinking,
                              item=a.thinking_item("in_progress", ""))
            yield a.event("response.reasoning_text.delta", item_id=a.thought,
                          output_index=thinking, content_index=0, delta=thought)
        if thinking is not None and (piece or chunk.final):  # the thinking is over
            for event in _thinking_done(a, thinking):
                yield event
            thinking = None
        if message is None and (piece or (chunk.final and a.has_message)):
            message, items = items, items + 1
            yield a.event("response.output_item.added", output_index=message,
                          item=a.message("in_progress", []))
            yield a.event("response.content_part.added", item_id=a.item, output_index=message,
                          content_index=0, part={**a.part(), "text": "", "logprobs": []})
        where = {"item_id": a.item, "output_index": message, "content_index": 0}
        if piece:
            yield a.event("response.output_text.delta", **where, delta=piece,
                          logprobs=a.sent())
        if chunk.final:
            final = a.final(chunk)
            if message is not None:
                yield a.event("response.output_text.done", **where, text=a.content,
                              logprobs=a.tokens)
                yield a.event("response.content_part.done", **where, part=a.part())
                yield a.event("response.output_item.done", output_index=message,
                              item=final["output"][message])
            for index in range(items, len(final["output"])):
                for event in _call_events(a, index, final["output"][index]):
                    yield event
            kept(final)
            yield a.event(f"response.{final['status']}", response=final)


def _thinking_done(a: _Answer, index: int) -> list[bytes]:
    return [a.event("response.reasoning_text.done", item_id=a.thought, output_index=index,
                    content_index=0, text=a.reasoning),
            a.event("response.output_item.done", output_index=index,
                    item=a.thinking_item("completed"))]


def _call_events(a: _Answer, index: int, item: dict) -> list[bytes]:
    """One function call's events: its item, its arguments (whole, in one delta), done."""
    at = {"item_id": item["id"], "output_index": index}
    return [a.event("response.output_item.added", output_index=index,
                    item={**item, "status": "in_progress", "arguments": ""}),
            a.event("response.function_call_arguments.delta", **at, delta=item["arguments"]),
            a.event("response.function_call_arguments.done", **at, name=item["name"],
                    arguments=item["arguments"]),
            a.event("response.output_item.done", output_index=index, item=item)]


async def retrieve(frontend, request: Request) -> Response:
    """`client.responses.retrieve(id)`: a stored response as it was answered."""
    return JSONResponse(frontend.responses.get(request.path_params["response_id"]).response)


async def delete(frontend, request: Request) -> Response:
    """`client.responses.delete(id)`: forgotten (later requests that continue it get 404)."""
    response_id = request.path_params["response_id"]
    frontend.responses.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


ROUTES = [("/v1/responses", ["POST"], "v1/responses", responses, error),
          ("/v1/responses/{response_id}", ["GET"], "v1/responses/{id}", retrieve, error),
          ("/v1/responses/{response_id}", ["DELETE"], "v1/responses/{id}", delete, error),
          ("/v1/responses/{response_id}/cancel", ["POST"], "v1/responses/{id}/cancel", cancel,
           error)]
