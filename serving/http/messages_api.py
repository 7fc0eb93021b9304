"""Anthropic's Messages API, `POST /v1/messages` and `POST /v1/messages/count_tokens`, as vLLM
and SGLang serve it: what the anthropic client's `messages.create` and `messages.stream` send,
and the agents and SDKs written on them when pointed at this server (ANTHROPIC_BASE_URL).

A request is read as a chat and rendered with the model's chat template like chat
completions': `system` (a string or text blocks) first, then `messages` whose content is a
string or blocks: `text`; an assistant's earlier `tool_use` (chat's `tool_calls`, its `input`
as JSON arguments) and the user's `tool_result` (chat's tool message); an assistant's
`thinking` is dropped as reasoning models' templates drop it. A last assistant message is a
prefill: the answer continues it. `max_tokens` (required), `stop_sequences`, structured
output (`output_config.format` json_schema), and the sampling settings older clients send
(`temperature`, `top_p`, `top_k`; without them the model samples at temperature 1, as the
API does) with vLLM's extras (`min_p`, `min_tokens`, `seed`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `bad_words`);
`tools` ({name, description, input_schema}) with `tool_choice` auto / any / tool / none and
`disable_parallel_tool_use`, made and read as chat's (serving/http/tools.py:
forced calls from any model, "auto" with --tool-call-parser), answered as `tool_use` blocks
with stop_reason "tool_use". With --reasoning-parser the thinking comes back as a `thinking`
block (its `signature` empty: nothing here signs it). stop_reason is end_turn, max_tokens,
stop_sequence (with the `stop_sequence` that matched) or tool_use. `usage` splits the prompt
as the API does: `cache_read_input_tokens` read from the prefix cache, `input_tokens`
computed.

Streamed (`stream: true`) as the API's events, each `event: TYPE`: message_start, then per
content block content_block_start, its deltas (thinking_delta, text_delta, or one
input_json_delta with a call's whole input) and content_block_stop, then message_delta (the
stop reason and the usage) and message_stop; a failure is an `error` event. Errors
are the API's error objects. The server's token is taken as `x-api-key` (the client's
api_key) or as a bearer token (its auth_token). What cannot be honoured is refused with 400:
image and document blocks, server tools (web search, code execution, ...), `container`,
`mcp_servers`, `output_config.effort`, `thinking` without a reasoning parser."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.decoder import DecoderEngine
from serving.errors import ContextTooLong, InvalidArgument
from serving.http.chat import chat_prompt
from serving.http.codec import http_status_for
from serving.http.openai_requests import (SAMPLING, body_value, generations_for,
                                          model_defaults, text_engine)
from serving.http.reasoning import Reply, Thinking
from serving.http.streams import ChunkStream
from serving.http.tools import tool_reader
from serving.http.triton_generate import SSE_HEADERS
from serving.sampling import Chunk, Grammar

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 503: "overloaded_error",
          529: "overloaded_error"}


def error(exc: BaseException) -> Response:
    """The API's error object, which the anthropic client raises as its typed errors."""
    status, message = http_status_for(exc)
    status = 529 if status == 429 else status  # a full server: Anthropic's API's overload
    if isinstance(exc, ContextTooLong):  # the API's words for it
        e = exc
        message = (f"prompt is too long: {e.prompt_tokens} tokens > {e.prompt_limit} maximum"
                   if e.prompt_alone else
                   f"input length and `max_tokens` exceed context limit: {e.prompt_tokens} + "
                   f"{e.max_tokens} > {e.context}, decrease input length or `max_tokens` and "
                   "try again")
    return JSONResponse(_error_body(_TYPES.get(status, "api_error"), message), status)


def _error_body(kind: str, message: str) -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


# -------------------------------------------------------------------- the request as a chat


def _text_of(where: str, content) -> str:
    """A string, or text blocks joined (`system`, a tool_result's content)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or any(
            not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str)
            for b in content):
        raise InvalidArgument(f"{where} must be a string or a list of text blocks")
    return "".join(b["text"] for b in content)


def _call(where: str, block: dict) -> dict:
    """An earlier tool_use block as a chat tool call."""
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise InvalidArgument(f"{where}: a tool_use block needs 'id' and 'name'")
    return {"id": block["id"], "type": "function", "function": {
        "name": block["name"], "arguments": json.dumps(block.get("input") or {})}}


def _result(where: str, block: dict) -> dict:
    """A tool_result block as chat's tool message."""
    if not isinstance(block.get("tool_use_id"), str):
        raise InvalidArgument(f"{where}: a tool_result block needs 'tool_use_id'")
    return {"role": "tool", "tool_call_id": block["tool_use_id"],
            "content": _text_of(f"{where}.content", block.get("content", ""))}


def _message(i: int, m) -> list[dict]:
    """One message as chat messages: its tool results (each a tool message, first, as the
    API puts them first), then its text and calls."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise InvalidArgument(f"messages[{i}] must be an object with 'role' user or assistant")
    role, content = m["role"], m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise InvalidArgument(f"messages[{i}].content must be a string or a list of blocks")
    text, calls, results = [], [], []
    for j, b in enumerate(blocks):
        where, kind = f"messages[{i}].content[{j}]", b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(where, b))
        elif kind == "tool_result" and role == "user":
            results.append(_result(where, b))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thinking: reasoning models' templates drop it
        elif kind is None:
            raise InvalidArgument(f"{where} must be an object with a 'type'")
        else:
            raise InvalidArgument(f"{where}: a {kind!r} block is not served here (text, and "
                                  "tool_use / tool_result / thinking where the role has them)")
    if results and not (text or calls):
        return results
    return results + [{"role": role, "content": "".join(text)} | (
        {"tool_calls": calls} if calls else {})]


def _tools(body: dict) -> dict:
    """`tools`, `tool_choice` and its `disable_parallel_tool_use` as a chat body holds them
    (client tools only: the API's server tools run on Anthropic's side)."""
    tools = body_value(body, "tools", (list,), []) or []
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom") or not isinstance(
                t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise InvalidArgument(f"tools[{i}] must be {{'name': ..., 'input_schema': {{...}}}}"
                                  " (server tools are not served)")
        out.append({"type": "function", "function": {
            "name": t["name"], "parameters": t["input_schema"]} | (
            {"description": t["description"]} if t.get("description") else {})})
    choice = body.get("tool_choice") or {"type": "auto"}
    kinds = {"auto": "auto", "any": "required", "none": "none"}
    if not isinstance(choice, dict) or choice.get("type") not in (*kinds, "tool"):
        raise InvalidArgument("'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or "
                              "{'type': 'tool', 'name': ...}")
    chat = {"tools": out, "tool_choice": {"type": "function", "function": {
        "name": choice.get("name")}} if choice["type"] == "tool" else kinds[choice["type"]]}
    if not out and chat["tool_choice"] == "auto":
        chat["tool_choice"] = None  # the default, with no tools
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    return chat


def chat_body(body: dict) -> dict:
    """The request as a chat completions body: messages, tools, and a last assistant
    message continued (the API's prefill)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty list")
    system = body.get("system")
    chat = ([{"role": "system", "content": _text_of("'system'", system)}] if system else [])
    for i, m in enumerate(messages):
        chat += _message(i, m)
    prefill = chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls")
    return {"messages": chat, **_tools(body), "add_generation_prompt": not prefill,
            "continue_final_message": prefill}


def _thinking(frontend, body: dict) -> Thinking | None:
    asked = body_value(body, "thinking", (dict,), {}) or {}
    if asked.get("type") not in (None, "disabled") and frontend.reasoning_parser is None:
        raise InvalidArgument("'thinking' needs a reasoning model's thinking parsed: start the "
                              "server with --reasoning-parser")
    return Thinking(frontend.reasoning_parser) if frontend.reasoning_parser else None


def _format(body: dict) -> Grammar | None:
    """`output_config.format` (json_schema: structured output); `effort` is refused, as
    nothing here controls how long a model thinks."""
    config = body_value(body, "output_config", (dict,), {}) or {}
    if config.get("effort") is not None:
        raise InvalidArgument("'output_config.effort' is not supported (a reasoning model's "
                              "effort is not controlled here)")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(
            fmt.get("schema"), dict):
        raise InvalidArgument("'output_config.format' must be {'type': 'json_schema', "
                              "'schema': {...}}")
    return Grammar.of("json", fmt["schema"])


def _refuse_unsupported(body: dict) -> None:
    for name in ("container", "mcp_servers"):
        if body.get(name):
            raise InvalidArgument(f"'{name}' is not supported (it runs on Anthropic's side)")


# -------------------------------------------------------------------------------- answers


@dataclass(kw_only=True)
class _Answer(Reply):
    """One message as it is built: its text so far, split into thinking, text and calls."""

    engine: DecoderEngine
    prompt: int  # tokens
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)

    def stop(self, chunk: Chunk) -> dict:
        if self.calls:
            reason = "tool_use"
        elif chunk.reason == "length":
            reason = "max_tokens"
        else:
            reason = "stop_sequence" if chunk.stop is not None else "end_turn"
        return {"stop_reason": reason, "stop_sequence": chunk.stop}

    def calls_as_blocks(self) -> list[dict]:
        return [{"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
                 "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])}
                for c in self.calls or ()]

    def content_blocks(self) -> list[dict]:
        """The finished content: the thinking, the text, then the calls."""
        out = [{"type": "thinking", "thinking": self.reasoning, "signature": ""}] \
            if self.reasoning else []
        out += [{"type": "text", "text": self.content}] if self.content else []
        return out + self.calls_as_blocks()

    def usage(self) -> dict:
        """The API's usage: its input_tokens are the prompt tokens computed, beside those
        read from the (prefix) cache; the three add up to the prompt."""
        return {"input_tokens": self.prompt - self.cached, "cache_read_input_tokens": self.cached,
                "cache_creation_input_tokens": 0, "output_tokens": self.generated}

    def message(self, content: list, stop: dict | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.engine.name,
                "content": content, **(stop or {"stop_reason": None, "stop_sequence": None}),
                "usage": self.usage()}


def _event(kind: str, **fields) -> bytes:
    data = json.dumps({"type": kind, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def messages(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    engine = text_engine(frontend, body)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidArgument("'max_tokens' is required: an integer >= 1")
    _refuse_unsupported(body)
    stops = body_value(body, "stop_sequences", (list,), []) or []
    thinking = _thinking(frontend, body)
    chat = chat_body(body)
    reader = tool_reader(chat, frontend.tool_parser)
    prompt = tuple(engine.tokenizer.encode(chat_prompt(engine.text, chat),
                                           add_special_tokens=False).ids)
    answer = _Answer(engine=engine, prompt=len(prompt), tools=reader, thinking=thinking)
    sampling = {k: body[k] for k in SAMPLING if k in body}
    (generation,) = generations_for(engine, {**sampling, "max_tokens": max_tokens,
                                             "stop": stops}, prompt, None, answer.id,
                                    defaults=model_defaults(frontend, engine))
    grammar, forced = _format(body), reader.grammar if reader is not None else None
    if grammar is not None and forced is not None:
        raise InvalidArgument("ask for tool calls or a structured output, not both")
    grammar = grammar or forced
    if thinking is not None:  # a grammar holds the answer after the thinking
        grammar = thinking.constrain(grammar)
    stream = ChunkStream(engine, replace(generation, grammar=grammar))
    if not body_value(body, "stream", (bool,), False):
        whole = await stream.whole(request.receive)
        if whole is None:
            return Response(status_code=499)
        answer.add(whole)
        return JSONResponse(answer.message(answer.content_blocks(), answer.stop(whole)))
    return StreamingResponse(_events(answer, stream), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _events(a: _Answer, stream: ChunkStream):
    """The events of one streamed message: the thinking block (opened by the first thought,
    closed when the text starts), the text block (opened by its first text), then the calls,
    each a block with its whole input in one delta. Blocks take their index in that order."""
    yield _event("message_start", message=a.message([], None))
    blocks = 0  # blocks opened so far
    thinking: int | None = None  # the thinking block's index while it is open
    text: int | None = None  # the text block's index while it is open
    async for chunk in stream:
        if chunk.final and chunk.reason not in ("length", "stop"):
            failure = chunk.detail or f"generation ended: {chunk.reason}"
            yield _event("error", error=_error_body("api_error", failure)["error"])
            return
        thought, piece = a.add(chunk)
        if thought:
            if thinking is None:
                thinking, blocks = blocks, blocks + 1
                yield _event("content_block_start", index=thinking, content_block={
                    "type": "thinking", "thinking": "", "signature": ""})
            yield _event("content_block_delta", index=thinking,
                         delta={"type": "thinking_delta", "thinking": thought})
        if thinking is not None and (piece or chunk.final):  # the thinking is over
            yield _event("content_block_delta", index=thinking,
                         delta={"type": "signature_delta", "signature": ""})
            yield _event("content_block_stop", index=thinking)
            thinking = None
        if piece:
            if text is None:
                text, blocks = blocks, blocks + 1
                yield _event("content_block_start", index=text,
                             content_block={"type": "text", "text": ""})
            yield _event("content_block_delta", index=text,
                         delta={"type": "text_delta", "text": piece})
        if chunk.final:
            if text is not None:
                yield _event("content_block_stop", index=text)
            for index, call in enumerate(a.calls_as_blocks(), start=blocks):
                yield _event("content_block_start", index=index,
                             content_block={**call, "input": {}})
                yield _event("content_block_delta", index=index, delta={
                    "type": "input_json_delta", "partial_json": json.dumps(call["input"])})
                yield _event("content_block_stop", index=index)
            yield _event("message_delta", delta=a.stop(chunk), usage=a.usage())
            yield _event("message_stop")


async def count_tokens(frontend, request: Request) -> Response:
    """`client.messages.count_tokens`: the prompt's tokens, as the chat template renders the
    request (its messages, system and tools)."""
    body = await frontend.json(request)
    engine = text_engine(frontend, body)
    text = chat_prompt(engine.text, chat_body(body))
    return JSONResponse({"input_tokens": len(engine.tokenizer.encode(
        text, add_special_tokens=False).ids)})


ROUTES = [("/v1/messages", ["POST"], "v1/messages", messages, error),
          ("/v1/messages/count_tokens", ["POST"], "v1/messages/count_tokens", count_tokens,
           error)]
