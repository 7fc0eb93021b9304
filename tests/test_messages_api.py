"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) driven by the
real anthropic client: `messages.create` whole and streamed, the `messages.stream` helper
(which builds the message from the events itself), against greedy on ONNX Runtime's logits
of the prompt transformers' `apply_chat_template` renders for the same chat; stop reasons,
a prefill, tools (a named tool, earlier tool_use / tool_result turns), structured output,
the token as `x-api-key`, and what cannot be honoured refused with 400.

This client version sends no sampling settings (the API took them out); the tests send
`temperature: 0` as older clients did, through `extra_body`."""

from __future__ import annotations

import json

import anthropic
import pytest
import requests
from llm_support import (TOOL_CHAT, TOOLS, TOOLS_TEMPLATE, WEATHER,  # noqa: F401
                         end_token_at, greedy, guided_greedy, llama, rendered_ids,
                         schema_grammar, start, tokenizer, tools_artifact)

SYSTEM = "You are terse."
QUESTION = "Name a fox."
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
END_AT = 5  # the artifact's end token is the 6th token greedy answers CHAT with
GREEDY = {"temperature": 0}
TOKEN = "key-123"
# the API's form of the chat tests' tools
WEATHER_TOOL = {"name": "get_weather", "description": "The weather", "input_schema": WEATHER}


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    """The decoder artifact with the tools template, its end token one that greedy answers
    CHAT with (so an answer ends its turn), first met at END_AT."""
    out = tools_artifact(tmp_path_factory.mktemp("messages"), llama)
    end_token_at(out, llama, CHAT, END_AT)
    return out


@pytest.fixture(scope="module")
def server(artifact):
    s = start(artifact, token=TOKEN, generate={"max_streams": 4, "max_tokens": 64})
    yield s
    s.stop(5)


def client(server, key: str = TOKEN) -> anthropic.Anthropic:
    """The real anthropic client on the server's HTTP port (no retries: a failure shows)."""
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.http_port}", api_key=key,
                               max_retries=0, timeout=60)


def ask(server, **fields) -> dict:
    return dict(model=server.slot.name, system=SYSTEM, max_tokens=32, extra_body=GREEDY,
                messages=[{"role": "user", "content": QUESTION}]) | fields


@pytest.fixture(scope="module")
def want(llama) -> str:
    """Greedy's answer to CHAT up to the end token."""
    return tokenizer().decode(greedy(llama, rendered_ids(CHAT), END_AT)[0])


def test_an_answer_that_meets_the_end_token_ends_its_turn(server, want) -> None:
    got = client(server).messages.create(**ask(server))
    assert (got.type, got.role, got.stop_reason, got.stop_sequence) == (
        "message", "assistant", "end_turn", None)
    assert [(b.type, b.text) for b in got.content] == [("text", want)]
    assert (got.usage.input_tokens, got.usage.output_tokens) == (len(rendered_ids(CHAT)), END_AT)


def test_the_stream_helper_builds_the_same_message_from_the_events(server, want) -> None:
    with client(server).messages.stream(**ask(server)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == want and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == END_AT
    events = list(client(server).messages.create(**ask(server), stream=True))
    kinds = [e.type for e in events if e.type != "content_block_delta"]
    assert kinds == ["message_start", "content_block_start", "content_block_stop",
                     "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == want


def test_max_tokens_and_a_stop_sequence_say_why_it_stopped(server, llama, want) -> None:
    c = client(server)
    cut = c.messages.create(**ask(server, max_tokens=3))
    assert cut.stop_reason == "max_tokens" and cut.content[0].text == tokenizer().decode(
        greedy(llama, rendered_ids(CHAT), 3)[0])
    stop = want[len(want) // 2:len(want) // 2 + 2]  # two characters inside the answer
    for got in (c.messages.create(**ask(server, stop_sequences=["@@never", stop])),
                c.messages.stream(**ask(server, stop_sequences=["@@never", stop])
                                  ).__enter__().get_final_message()):
        assert (got.stop_reason, got.stop_sequence) == ("stop_sequence", stop)
        assert got.content[0].text == want[:want.index(stop)]


def test_a_last_assistant_message_is_continued(server, llama) -> None:
    """The API's prefill: the answer goes on from the assistant's text, as transformers'
    continue_final_message renders it."""
    chat = CHAT + [{"role": "assistant", "content": "Vix"}]
    got = client(server).messages.create(**ask(server, max_tokens=4, messages=[
        {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Vix"}],
        extra_body=GREEDY | {"ignore_eos": True}))
    ids = rendered_ids(chat, continue_final_message=True, add_generation_prompt=False)
    assert got.content[0].text == tokenizer().decode(greedy(llama, ids, 4)[0])


def test_the_model_list_is_read_by_the_anthropic_client(server) -> None:
    c = client(server)
    assert [m.id for m in c.models.list()] == [server.slot.name]
    assert c.models.retrieve(server.slot.name).display_name == server.slot.name


def test_vllms_extras_are_taken_as_on_chat_completions(server, llama, want) -> None:
    """stop_token_ids end the answer before that token; min_p 1 at temperature 1 leaves
    greedy's answer (temperature 1 alone samples another)."""
    ids = greedy(llama, rendered_ids(CHAT), END_AT)[0]
    got = client(server).messages.create(**ask(server, extra_body={
        "temperature": 0, "stop_token_ids": [ids[2]]}))
    assert ids[2] not in ids[:2] and got.content[0].text == tokenizer().decode(ids[:2])
    sampled = {"temperature": 1.0, "seed": 5}
    c = client(server)
    assert c.messages.create(**ask(server, extra_body=sampled)).content[0].text != want
    assert c.messages.create(**ask(server, extra_body=sampled | {"min_p": 1.0})
                             ).content[0].text == want


def test_count_tokens_counts_the_rendered_prompt(server) -> None:
    got = client(server).messages.count_tokens(model=server.slot.name, system=SYSTEM,
                                               messages=[{"role": "user", "content": QUESTION}])
    assert got.input_tokens == len(rendered_ids(CHAT))


def test_a_named_tool_is_used_with_the_models_input(server, llama) -> None:
    fields = ask(server, system=[], messages=TOOL_CHAT, tools=[WEATHER_TOOL],
                 tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=64)
    got = client(server).messages.create(**fields)
    assert got.stop_reason == "tool_use"
    [block] = got.content
    assert (block.type, block.name) == ("tool_use", "get_weather") and block.id
    eos = server.slot.engine.text.eos_ids[0]
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "description":
                                                    "The weather", "parameters": WEATHER}}]
    reference = guided_greedy(llama, rendered_ids(TOOL_CHAT, TOOLS_TEMPLATE, tools=chat_tools),
                              schema_grammar(WEATHER), eos)
    assert block.input == json.loads(tokenizer().decode(reference))
    with client(server).messages.stream(**fields) as stream:
        final = stream.get_final_message()  # the helper joins the input_json_delta itself
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", block.input)] and final.stop_reason == "tool_use"


def test_earlier_tool_use_and_its_result_are_the_chats_turns(server, llama) -> None:
    """An agent's next turn: the model's tool_use block and the user's tool_result give the
    prompt transformers renders for the same turns in chat's form."""
    messages = TOOL_CHAT + [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": "UTC"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}]}]
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    got = client(server).messages.create(**ask(server, system=[], messages=messages, tools=tools,
                                               tool_choice={"type": "none"}, max_tokens=4))
    chat = TOOL_CHAT + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "12:00"}]
    want = greedy(llama, rendered_ids(chat, TOOLS_TEMPLATE, tools=TOOLS), 4)[0]
    assert got.content[0].text == tokenizer().decode(want)


def test_output_config_format_is_structured_output(server, llama) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
              "required": ["name"], "additionalProperties": False}
    got = client(server).messages.create(**ask(server, max_tokens=48, output_config={
        "format": {"type": "json_schema", "schema": schema}}))
    eos = server.slot.engine.text.eos_ids[0]
    reference = guided_greedy(llama, rendered_ids(CHAT), schema_grammar(schema), eos)
    assert json.loads(got.content[0].text) == json.loads(tokenizer().decode(reference))


def test_the_token_is_taken_as_x_api_key_or_bearer(server) -> None:
    with pytest.raises(anthropic.AuthenticationError, match="bearer token"):
        client(server, "wrong").messages.create(**ask(server, max_tokens=1))
    bearer = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.http_port}",
                                 auth_token=TOKEN, max_retries=0, timeout=60)
    assert bearer.messages.create(**ask(server, max_tokens=1)).usage.output_tokens == 1


@pytest.mark.parametrize("fields, says", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
     "'image' block is not served"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "server tools are not served"),
    ({"tools": [WEATHER_TOOL]}, "--tool-call-parser"),
    ({"tools": {}}, "'tools' must be list"),
    ({"messages": [{"role": "user", "content": ["Name a fox."]}]},
     "content\\[0\\] must be an object with a 'type'"),
    ({"messages": [{"role": "system", "content": QUESTION}]}, "'role' user or assistant"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "--reasoning-parser"),
    ({"output_config": {"effort": "high"}}, "'output_config.effort' is not supported"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "tool calls or a structured output, not both"),
])
def test_what_cannot_be_done_is_400(server, fields, says) -> None:
    with pytest.raises(anthropic.BadRequestError, match=says):
        client(server).messages.create(**ask(server, **fields))


def test_errors_are_the_apis_error_objects(server) -> None:
    """What a client sees without the SDK: the API's error object and status."""
    url = f"http://127.0.0.1:{server.http_port}/v1/messages"
    got = requests.post(url, json={"model": server.slot.name, "messages": [
        {"role": "user", "content": QUESTION}]}, headers={"x-api-key": TOKEN}, timeout=30)
    assert got.status_code == 400
    assert got.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'max_tokens' is required: an integer >= 1"}}
    missing = requests.post(url, json={}, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"


def test_a_repeated_prompt_is_read_from_the_prefix_cache(server) -> None:
    """The second time a prompt comes, its whole 16-token blocks (all but the last token's
    block) are the prefix cache's: usage says so as the API does (cache_read_input_tokens
    beside input_tokens, adding up to the prompt), whole and streamed."""
    fields = ask(server, system="You answer in one word, always.", max_tokens=2)
    c, total = client(server), len(rendered_ids([{"role": "system", "content": fields["system"]},
                                                 {"role": "user", "content": QUESTION}]))
    first = c.messages.create(**fields).usage  # (its first block may be an earlier prompt's)
    assert first.input_tokens + first.cache_read_input_tokens == total
    again = c.messages.create(**fields).usage
    assert again.cache_read_input_tokens > first.cache_read_input_tokens
    with c.messages.stream(**fields) as stream:
        streamed = stream.get_final_message().usage
    for usage in (again, streamed):
        assert usage.cache_read_input_tokens == (total - 1) // 16 * 16 > 0
        assert usage.input_tokens + usage.cache_read_input_tokens == total


def test_auto_reads_the_models_own_call_as_a_tool_use_block(artifact) -> None:
    """tool_choice auto with --tool-call-parser: a JSON schema makes this random model write a
    Llama 3.1 call; it comes back as a tool_use block with stop_reason tool_use, whole and
    through the stream helper."""
    schema = {"type": "object", "properties": {"name": {"const": "get_time"}, "parameters": {
        "type": "object", "properties": {"zone": {"const": "UTC"}}, "required": ["zone"],
        "additionalProperties": False}}, "required": ["name", "parameters"],
        "additionalProperties": False}
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    s = start(artifact, tool_call_parser="llama3_json", generate={"max_tokens": 64})
    try:
        fields = dict(model=s.slot.name, max_tokens=64, messages=TOOL_CHAT, tools=tools,
                      extra_body=GREEDY, output_config={
                          "format": {"type": "json_schema", "schema": schema}})
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.http_port}", api_key="unused",
                                max_retries=0, timeout=60)
        got = c.messages.create(**fields)
        with c.messages.stream(**fields) as stream:
            final = stream.get_final_message()
    finally:
        s.stop(5)
    for message in (got, final):
        assert [(b.type, b.name, b.input) for b in message.content] == [
            ("tool_use", "get_time", {"zone": "UTC"})]
        assert message.stop_reason == "tool_use"
