"""Every OpenAI answer validated against the openai package's own types, strictly (the
client itself builds its objects without validation, so a missing required field or a
wrong type passes it unseen): completions, chat completions and their stream chunks, with
log-probs, tool calls and reasoning; the model list; the Responses API's response and every
stream event; and Anthropic's Messages API against the anthropic package's types."""

from __future__ import annotations

import json

import requests
import pytest
from llm_support import PROMPT, decoder_artifact, llama, start  # noqa: F401
from anthropic.types import Message, ModelInfo, RawMessageStreamEvent
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

MESSAGES = [{"role": "user", "content": "Name a fox."}]
TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    s = start(decoder_artifact(tmp_path_factory.mktemp("schemas"), llama),
              reasoning_parser="qwen3")
    yield s
    s.stop(5)


def _post(server, path: str, body: dict) -> list[dict]:
    """The answer's JSON objects: one, or each SSE event's data (without [DONE])."""
    r = requests.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return [r.json()]
    data = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" or path in ("/v1/responses", "/v1/messages")
    return [json.loads(d) for d in data if d != "[DONE]"]


CHAT = {"messages": MESSAGES, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
CASES = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "logprobs": 2}, Completion),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True,
                         "stream_options": {"include_usage": True}}, Completion),
    ("/v1/chat/completions", CHAT, ChatCompletion),
    ("/v1/chat/completions", {**CHAT, "stream": True, "n": 2}, ChatCompletionChunk),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required"},
     ChatCompletion),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": "required",
                              "stream": True}, ChatCompletionChunk),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 4, "top_logprobs": 2,
                       "include": ["message.output_text.logprobs"]}, Response),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 4, "stream": True},
     ResponseStreamEvent),
    ("/v1/responses", {"input": PROMPT, "max_output_tokens": 4, "background": True}, Response),
    ("/v1/responses", {"input": MESSAGES, "max_output_tokens": 40, "stream": True,
                       "tools": [{"type": "function", **TOOL["function"]}],
                       "tool_choice": "required"}, ResponseStreamEvent),
    # Anthropic's Messages API, against the anthropic package's types
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 4, "system": "Be terse."}, Message),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 4, "stream": True},
     RawMessageStreamEvent),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 40, "tool_choice": {"type": "any"},
                      "tools": [{"name": "pick", "input_schema": TOOL["function"]["parameters"]}],
                      "stream": True}, RawMessageStreamEvent),
    ("/v1/messages", {"messages": MESSAGES, "max_tokens": 40, "tool_choice": {"type": "any"},
                      "tools": [{"name": "pick", "input_schema": TOOL["function"]["parameters"]}]},
     Message),
]


@pytest.mark.parametrize("path, body, kind", CASES)
def test_each_answer_is_a_valid_object_of_its_api(server, path, body, kind) -> None:
    objects = _post(server, path, {"model": server.slot.name, "temperature": 0, **body})
    adapter = TypeAdapter(kind)
    for obj in objects:
        if kind is Completion and body.get("stream"):
            # the SDK types a streamed completion chunk as the whole object, whose finish
            # reason is never null; OpenAI's own streams send null until the last chunk
            for c in obj["choices"]:
                c["finish_reason"] = c["finish_reason"] or "length"
        adapter.validate_python(obj)
    assert objects


def test_the_model_list_is_valid(server) -> None:
    r = requests.get(f"http://127.0.0.1:{server.http_port}/v1/models", timeout=30).json()
    assert [Model.model_validate(m).id for m in r["data"]] == [server.slot.name]
    assert [ModelInfo.model_validate(m).id for m in r["data"]] == [server.slot.name]
