"""Tool calling as the openai client sends it, where the client forces the call: a named
function (also through the client's `chat.completions.stream` helper with
`pydantic_function_tool`, which parses the streamed arguments itself) and "required".
The arguments equal an independent reference (greedy under llguidance's mask on ONNX
Runtime's logits of the prompt transformers renders with the tools), and "auto" is refused
with a reason."""

from __future__ import annotations

import json

import openai
import pytest
from llm_support import TOOL_CHAT as MESSAGES
from llm_support import (TOOLS, TOOLS_TEMPLATE, WEATHER,  # noqa: F401
                         greedy, guided_greedy, llama, openai_client, rendered_ids,
                         schema_grammar, start, tokenizer, tools_artifact)
from pydantic import BaseModel, Field


class Lookup(BaseModel):
    word: str = Field(max_length=6)


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    return tools_artifact(tmp_path_factory.mktemp("tools"), llama)


@pytest.fixture(scope="module")
def server(artifact):
    s = start(artifact, generate={"max_streams": 4, "max_tokens": 64})
    yield s
    s.stop(5)



def test_a_named_function_is_called_with_the_models_arguments(server, artifact, llama) -> None:
    got = openai_client(server).chat.completions.create(
        model=server.slot.name, messages=MESSAGES, tools=TOOLS, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
    eos = server.slot.engine.text.eos_ids[0]
    want = guided_greedy(llama, rendered_ids(MESSAGES, TOOLS_TEMPLATE, tools=TOOLS), schema_grammar(WEATHER), eos)
    assert call.function.arguments == tokenizer().decode(want)  # the model's own text


def test_the_stream_helper_parses_a_pydantic_tools_arguments(server) -> None:
    tool = openai.pydantic_function_tool(Lookup)
    with openai_client(server).chat.completions.stream(
            model=server.slot.name, messages=MESSAGES, tools=[tool], temperature=0,
            tool_choice={"type": "function", "function": {"name": "Lookup"}}) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "Lookup" and isinstance(call.function.parsed_arguments,
                                                         Lookup)
    assert final.choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools_or_more(server, artifact, llama) -> None:
    c, name = openai_client(server), server.slot.name
    got = c.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS,
                                    tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_tokens=60)
    (call,) = got.choices[0].message.tool_calls
    assert got.choices[0].finish_reason == "tool_calls"
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)
    # several calls allowed: this model keeps calling, and max_tokens cuts the list: the
    # calls as far as they came, the last one's arguments cut (finish reason "length"), as
    # OpenAI and vLLM answer, so that an agent sees a failed call rather than a text answer
    named = c.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS,
                                      tool_choice={"type": "function", "function": {
                                          "name": "get_weather"}},
                                      temperature=0, max_tokens=6).choices[0]
    assert named.finish_reason == "length" and named.message.content is None
    (call,) = named.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"')
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)
    cut = c.chat.completions.create(model=name, messages=MESSAGES, tools=TOOLS,
                                    tool_choice="required", temperature=0, max_tokens=40)
    calls = cut.choices[0].message.tool_calls
    assert cut.choices[0].finish_reason == "length" and calls and cut.choices[0].message.content \
        is None
    assert all(c.function.name in ("get_weather", "get_time") for c in calls)
    whole = sum(1 for c in calls if _parses(c.function.arguments))
    assert whole == len(calls) - 1  # all but the last, cut
    streamed = [ch.choices[0] for ch in c.chat.completions.create(
        model=name, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=40, stream=True) if ch.choices]
    assert streamed[-1].finish_reason == "length"
    assert [d.function.arguments for d in streamed[-1].delta.tool_calls] == \
        [c.function.arguments for c in calls]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_a_tool_result_turn_is_taken(server) -> None:
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    got = openai_client(server).chat.completions.create(model=server.slot.name, messages=history,
                                                  tools=TOOLS, tool_choice="none",
                                                  max_tokens=4, temperature=0)
    assert got.choices[0].message.tool_calls is None and got.choices[0].message.content


@pytest.mark.parametrize("extra, says", [
    ({"tools": TOOLS}, "'auto' \\(the model decides\\) needs .* --tool-call-parser"),
    ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools\\[0\\] must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "'nope', which is not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool calls or a structured output, not both"),
])
def test_what_cannot_be_done_is_400(server, extra, says) -> None:
    with pytest.raises(openai.BadRequestError, match=says):
        openai_client(server).chat.completions.create(model=server.slot.name, messages=MESSAGES,
                                                max_tokens=4, **extra)


# ------------------------------------------------- tool_choice "auto" with a call parser

CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
TIME = '{"name": "get_time", "arguments": {"zone": "UTC"}}'


def _read_streamed(parser: str, pieces: list[str]) -> tuple[str, list | None]:
    """A parser's reader fed as a stream is fed: each piece, then the end."""
    from serving.http.tools import READERS

    reader, held, sent, content, calls = READERS[parser](), "", 0, "", None
    for i, piece in enumerate(pieces):
        held += piece
        out, calls = reader.read(held, sent, i == len(pieces) - 1)
        sent += len(out)
        content += out
    return content, calls


# what each model family writes (vLLM's parser tests and the models' chat templates)
PROSE = "It is 12:00 in Oslo (a <b>tool</b> said; {see} [TOOL] notes)."
WRITTEN = [
    ("hermes", f"<tool_call>\n{CALL}\n</tool_call>", "", ["get_weather"]),
    ("hermes", f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{TIME}\n"
     "</tool_call>", "Let me check.\n", ["get_weather", "get_time"]),
    ("hermes", f"<tool_call>\n{CALL}", "", ["get_weather"]),  # cut after the JSON: a call
    ("hermes", '<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', None),
    ("hermes", PROSE, PROSE, None),
    # Mistral before its v11 tokenizer: a JSON list after the token
    ("mistral", f"[TOOL_CALLS][{CALL}, {TIME}]", "", ["get_weather", "get_time"]),
    ("mistral", f"Checking. [TOOL_CALLS] [{CALL}]", "Checking. ", ["get_weather"]),
    # v11 and later: name{arguments} after each token; v13: name[ARGS]{arguments}
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Oslo", "days": 2}[TOOL_CALLS]get_time'
     '{"zone": "UTC"}', "", ["get_weather", "get_time"]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}', "",
     ["get_weather"]),
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_", "[TOOL_CALLS][{\"name\": \"get_", None),
    ("mistral", PROSE, PROSE, None),
    # Llama 3.1 - 3.3: the output is the call, "parameters" as their template asks
    ("llama3_json", CALL.replace("arguments", "parameters"), "", ["get_weather"]),
    ("llama3_json", f"<|python_tag|>{CALL}; {TIME}", "", ["get_weather", "get_time"]),
    ("llama3_json", f" \n{CALL}", "", ["get_weather"]),
    ("llama3_json", f"{CALL} and then", f"{CALL} and then", None),
    ("llama3_json", '{"name": "Oslo", "days": 2}', '{"name": "Oslo", "days": 2}', None),
    ("llama3_json", PROSE, PROSE, None),
]


@pytest.mark.parametrize("parser, text, content, names", WRITTEN)
def test_calls_are_read_out_of_the_text_whole_and_streamed(parser, text, content,
                                                           names) -> None:
    for pieces in ([text], [text[i:i + 3] for i in range(0, len(text), 3)]):
        got, calls = _read_streamed(parser, pieces)
        assert got == content
        assert (None if calls is None else [c["function"]["name"] for c in calls]) == names
    if names:
        _, calls = _read_streamed(parser, [text])
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "days": 2}


@pytest.mark.parametrize("parser, held, now", [
    ("hermes", "Sure <tool_", "Sure "), ("hermes", "Sure <tool_x", "Sure <tool_x"),
    ("mistral", "Sure [TOOL", "Sure "), ("mistral", "Sure [TOOLS]", "Sure [TOOLS]"),
    ("llama3_json", " <|python", ""), ("llama3_json", " {", ""), ("llama3_json", "Sure", "Sure"),
])
def test_streamed_content_is_held_back_only_while_a_call_may_start(parser, held, now) -> None:
    from serving.http.tools import READERS

    assert READERS[parser]().read(held, 0, False) == (now, None)


def _literal(text: str) -> str:
    """A regex matching exactly `text` (llguidance's Rust syntax: escape its metacharacters
    only)."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}" else c for c in text)


@pytest.mark.parametrize("parser, text, content", [
    ("hermes", f"On it.<tool_call>{TIME}</tool_call>", "On it."),
    ("mistral", '[TOOL_CALLS]get_time{"zone": "UTC"}', ""),
    ("llama3_json", TIME.replace("arguments", "parameters"), ""),
])
def test_a_call_the_model_writes_comes_back_as_tool_calls(artifact, parser, text,
                                                          content) -> None:
    """The served path end to end: a regex makes this random model write a call in its
    family's syntax; the server answers it as `tool_calls`, whole and streamed."""
    s = start(artifact, tool_call_parser=parser, generate={"max_tokens": 128})
    try:
        c = openai_client(s)
        ask = dict(model=s.slot.name, messages=MESSAGES, tools=TOOLS, temperature=0,
                   max_tokens=128, extra_body={"structured_outputs": {"regex": _literal(text)}})
        got = c.chat.completions.create(**ask).choices[0]
        assert got.finish_reason == "tool_calls" and (got.message.content or "") == content
        [call] = got.message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments) == {
            "zone": "UTC"}
        chunks = list(c.chat.completions.create(**ask, stream=True))
        assert "".join(x.choices[0].delta.content or "" for x in chunks) == content
        [streamed] = [t for x in chunks for t in x.choices[0].delta.tool_calls or []]
        assert (streamed.function.name, streamed.function.arguments) == (
            "get_time", call.function.arguments)
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    finally:
        s.stop(5)


def test_auto_with_the_parser_answers_text_when_the_model_calls_nothing(artifact,
                                                                         llama) -> None:
    s = start(artifact, tool_call_parser="hermes", generate={"max_tokens": 64})
    try:
        c = openai_client(s)
        got = c.chat.completions.create(model=s.slot.name, messages=MESSAGES, tools=TOOLS,
                                        temperature=0, max_tokens=8)
        want = tokenizer().decode(greedy(llama, rendered_ids(MESSAGES, TOOLS_TEMPLATE, tools=TOOLS), 8)[0])
        assert got.choices[0].message.content == want and got.choices[0].finish_reason == \
            "length" and got.choices[0].message.tool_calls is None
        streamed = c.chat.completions.create(model=s.slot.name, messages=MESSAGES, tools=TOOLS,
                                             temperature=0, max_tokens=8, stream=True)
        assert "".join(x.choices[0].delta.content or "" for x in streamed) == want
    finally:
        s.stop(5)


# ------------------------------------------------- the Responses API's function tools

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses form


def test_responses_calls_a_named_function_as_chat_does(server, artifact, llama) -> None:
    got = openai_client(server).responses.create(
        model=server.slot.name, input=MESSAGES[0]["content"], tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert got.status == "completed" and [o.type for o in got.output] == ["function_call"]
    call = got.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    eos = server.slot.engine.text.eos_ids[0]
    want = guided_greedy(llama, rendered_ids(MESSAGES, TOOLS_TEMPLATE, tools=TOOLS), schema_grammar(WEATHER), eos)
    assert json.loads(call.arguments) == json.loads(tokenizer().decode(want))
    cut = openai_client(server).responses.create(
        model=server.slot.name, input=MESSAGES[0]["content"], tools=FLAT_TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=6)  # a call cut short: an incomplete call, as OpenAI answers
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (item,) = cut.output
    assert (item.type, item.status, item.name) == ("function_call", "incomplete", "get_weather")
    assert call.arguments.startswith(item.arguments) and not _parses(item.arguments)


def test_responses_stream_helper_parses_a_pydantic_tools_arguments(server) -> None:
    from openai.lib._tools import pydantic_responses_function_tool

    with openai_client(server).responses.stream(
            model=server.slot.name, input=MESSAGES, temperature=0,
            tools=[pydantic_responses_function_tool(Lookup)],
            tool_choice={"type": "function", "name": "Lookup"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    (call,) = final.output
    assert call.type == "function_call" and isinstance(call.parsed_arguments, Lookup)
    # each event names the call's place in the final output
    assert {e.output_index for e in events if hasattr(e, "output_index")} == {0}
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {call.id}


def test_responses_takes_earlier_calls_and_their_outputs(server, artifact, llama) -> None:
    """An agent's second turn: the model's call and the tool's output, as input items, give
    the prompt transformers renders for the same turns in chat's form."""
    args = '{"zone": "UTC"}'
    items = MESSAGES + [
        {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    chat = MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    got = openai_client(server).responses.create(
        model=server.slot.name, input=items, tools=FLAT_TOOLS, tool_choice="none",
        temperature=0, max_output_tokens=4)
    assert [o.type for o in got.output] == ["message"]
    want = greedy(llama, rendered_ids(chat, TOOLS_TEMPLATE, tools=TOOLS), 4)[0]
    assert got.output_text == tokenizer().decode(want)


def test_responses_auto_reads_the_models_own_call(artifact) -> None:
    """"auto" on the Responses API with a parser: a JSON schema makes this random model write
    a Llama 3.1 call; it comes back as a function_call item, whole and streamed."""
    schema = {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {
        "type": "object", "properties": {"zone": {"const": "UTC"}}, "required": ["zone"],
        "additionalProperties": False}}, "required": ["name", "parameters"],
        "additionalProperties": False}
    s = start(artifact, tool_call_parser="llama3_json", generate={"max_tokens": 64})
    try:
        ask = dict(model=s.slot.name, input=MESSAGES, tools=FLAT_TOOLS, temperature=0,
                   text={"format": {"type": "json_schema", "name": "call", "schema": schema}})
        got = openai_client(s).responses.create(**ask)
        assert [(o.type, o.name, json.loads(o.arguments)) for o in got.output] == [
            ("function_call", "get_time", {"zone": "UTC"})]
        events = list(openai_client(s).responses.create(**ask, stream=True))
        assert not [e for e in events if e.type == "response.output_text.delta"]
        assert events[-1].type == "response.completed"
        assert [o.name for o in events[-1].response.output] == ["get_time"]
    finally:
        s.stop(5)


def test_an_unknown_parser_is_refused_before_serving() -> None:
    from serving.server import ServerOptions
    from tuner.errors import BadInput

    with pytest.raises(BadInput, match="--tool-call-parser must be one of \\['hermes', "
                       "'llama3_json', 'mistral'\\], not 'pythonic'"):
        ServerOptions(tool_call_parser="pythonic")
