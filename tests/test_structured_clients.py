"""Structured output from a schema as pydantic writes it (no `additionalProperties`), the way
instructor and hand-written clients send it, and instructor itself (its TOOLS and
JSON_SCHEMA modes, which most structured-extraction code runs on; in an environment of its
own, models/venvs.py). An object that lists its
properties takes no others (serving/generation/grammar.closed, xgrammar's strict mode, vLLM's
default): each output equals greedy under the schema closed by hand, masked by llguidance's
own helpers; before, a model could add keys of its own until its tokens ran out (instructor:
IncompleteOutputException)."""

from __future__ import annotations

import json
import subprocess

import pytest
from llm_support import TOOLS_TEMPLATE, guided_greedy, llama  # noqa: F401
from llm_support import (openai_client, rendered_ids, schema_grammar, start, tokenizer,
                         tools_artifact)
from pydantic import BaseModel, Field

from models.venvs import ensure_venv
from serving.generation.grammar import closed

MESSAGES = [{"role": "user", "content": "Jo is 30."}]


class User(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    """The decoder artifact with the tools template (instructor's TOOLS mode sends tools)."""
    out = tools_artifact(tmp_path_factory.mktemp("structured"), llama)
    s = start(out, generate={"max_tokens": 64})
    yield s
    s.stop(5)


def _eos(server) -> int:
    return server.slot.engine.text.eos_ids[0]


def test_closed_walks_schemas_not_names() -> None:
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object", "properties": {
        "properties": {"type": "string"},  # a property so named is not a schema's keyword
        "items": {"type": "array", "items": inner},
        "either": {"anyOf": [inner, {"type": "null"}]},
        "free": {"type": "object"},  # lists no properties: any object
        "open": {**inner, "additionalProperties": True},
        "ref": {"$ref": "#/$defs/Inner"}},
        "$defs": {"Inner": inner}, "allOf": [inner]}
    got = closed(schema)
    shut = {**inner, "additionalProperties": False}
    assert got["additionalProperties"] is False
    assert got["properties"]["properties"] == {"type": "string"}
    assert got["properties"]["items"]["items"] == shut
    assert got["properties"]["either"]["anyOf"] == [shut, {"type": "null"}]
    assert got["properties"]["free"] == {"type": "object"}
    assert got["properties"]["open"]["additionalProperties"] is True
    assert got["$defs"]["Inner"] == shut and got["allOf"] == [inner]
    assert schema["properties"]["items"]["items"] == inner  # (the request's own left alone)


def test_a_pydantic_schema_takes_no_other_keys(server, llama) -> None:
    schema = User.model_json_schema()
    assert "additionalProperties" not in schema
    got = openai_client(server).chat.completions.create(
        model=server.slot.name, messages=MESSAGES, temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "User",
                                                                "schema": schema}})
    prompt = rendered_ids(MESSAGES, TOOLS_TEMPLATE)
    want = guided_greedy(llama, prompt, schema_grammar({**schema, "additionalProperties": False}),
                         _eos(server), 60)
    assert got.choices[0].message.content == tokenizer().decode(want)
    assert got.choices[0].finish_reason == "stop"
    User.model_validate_json(got.choices[0].message.content)


# instructor, in an environment of its own (pip resolves it against an older openai client
# than the suite's): its response_model over the openai client, as extraction code calls it
VENV = ("instructor", ("instructor>=1.7,<2",))
CLIENT = """
import json, sys
import instructor, openai
from pydantic import BaseModel, Field

class User(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)

url, model, mode, messages = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
client = instructor.from_openai(openai.OpenAI(base_url=url, api_key="x", max_retries=0),
                                mode=getattr(instructor.Mode, mode))
user, completion = client.chat.completions.create_with_completion(
    model=model, response_model=User, messages=messages, max_tokens=60, temperature=0,
    max_retries=0)
message = completion.choices[0].message
text = message.tool_calls[0].function.arguments if mode == "TOOLS" else message.content
print(json.dumps({"user": user.model_dump(), "text": text,
                  "prompt_tokens": completion.usage.prompt_tokens}))
"""


@pytest.mark.venv(*VENV)
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_extracts_a_model(server, llama, mode) -> None:
    """instructor's response_model over the openai client, unchanged: a forced tool call
    (TOOLS) or a json_schema response format; the user is greedy's, under the closed schema
    (its tool call's arguments, its answer's content)."""
    python = ensure_venv(*VENV)
    r = subprocess.run([str(python), "-P", "-c", CLIENT, f"http://127.0.0.1:{server.http_port}"
                        "/v1", server.slot.name, mode, json.dumps(MESSAGES)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["user"] == User.model_validate_json(got["text"]).model_dump()
    schema = {**User.model_json_schema(), "additionalProperties": False}
    tools = ([{"type": "function", "function": {"name": "User"}}] if mode == "TOOLS" else None)
    prompt = rendered_ids(MESSAGES, TOOLS_TEMPLATE, tools=tools)
    assert got["prompt_tokens"] == len(prompt)
    want = guided_greedy(llama, prompt, schema_grammar(schema), _eos(server), 60)
    assert json.loads(got["text"]) == json.loads(tokenizer().decode(want))
