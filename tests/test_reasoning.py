"""`tuner serve --reasoning-parser`: a reasoning model's thinking apart from its answer, on
what DeepSeek-R1-style and Qwen3-style models write (whole, and streamed 3 characters at a
time: the pieces join to the whole), and served through the openai client: the message's
`reasoning` (and `reasoning_content`), the Responses API's reasoning item and the Messages
API's thinking block, against greedy on ONNX Runtime's logits."""

from __future__ import annotations

import pytest
from llm_support import (PROMPT, decoder_artifact, greedy, llama, openai_client,  # noqa: F401
                         rendered_ids, start, tokenizer)

WRITTEN = [
    # DeepSeek-R1: the prompt opened the block; a <think> written anyway is dropped
    ("deepseek_r1", "Foxes are red.\n</think>\n\nRed.", "Foxes are red.\n", "\n\nRed."),
    ("deepseek_r1", "<think>\nHmm.</think>Red.", "\nHmm.", "Red."),
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", ""),
    ("deepseek_r1", "a </thin> is not the end", "a </thin> is not the end", ""),
    # Qwen3's hybrid models: thinking only when the reply opens the block
    ("qwen3", "<think>\nHmm.\n</think>\n\nRed.", "\nHmm.\n", "\n\nRed."),
    ("qwen3", "\n<think>Hmm.</think>Red.", "Hmm.", "Red."),
    ("qwen3", "Red, with thinking off.", "", "Red, with thinking off."),
    ("qwen3", "<thin ice", "", "<thin ice"),
]


def _streamed(parser: str, text: str) -> tuple[str, str]:
    from serving.http.reasoning import Thinking

    thinking, reasoning, content = Thinking(parser), "", ""
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    for i in range(len(pieces)):
        r, c = thinking.split("".join(pieces[:i + 1]), i == len(pieces) - 1)
        assert r.startswith(reasoning) and c.startswith(content)  # what went out stays
        reasoning, content = r, c
    return reasoning, content


@pytest.mark.parametrize("parser, text, reasoning, content", WRITTEN)
def test_thinking_is_split_off_whole_and_streamed(parser, text, reasoning, content) -> None:
    from serving.http.reasoning import Thinking

    assert Thinking(parser).split(text, True) == (reasoning, content)
    assert _streamed(parser, text) == (reasoning, content)


def test_a_streamed_close_tag_is_held_back_until_decided() -> None:
    from serving.http.reasoning import Thinking

    assert Thinking("deepseek_r1").split("Hmm </thi", False) == ("Hmm ", "")
    assert Thinking("qwen3").split(" <thi", False) == ("", "")


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    return decoder_artifact(tmp_path_factory.mktemp("reasoning"), llama)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_served_replies_carry_the_reasoning(artifact, llama, parser) -> None:
    """This random model never writes </think>: to DeepSeek-R1's parser the whole reply is
    reasoning (the prompt opened the block, and the reply was cut), to Qwen3's it is all
    content (the reply did not open one)."""
    messages = [{"role": "user", "content": PROMPT}]
    want = tokenizer().decode(greedy(llama, rendered_ids([{"role": "user", "content": PROMPT}]), 8)[0])
    s = start(artifact, reasoning_parser=parser)
    try:
        ask = dict(model=s.slot.name, messages=messages, max_tokens=8, temperature=0,
                   extra_body={"ignore_eos": True})
        message = openai_client(s).chat.completions.create(**ask).choices[0].message
        extra = message.model_extra or {}
        chunks = list(openai_client(s).chat.completions.create(**ask, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        streamed = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
        text = "".join(d.content or "" for d in deltas)
    finally:
        s.stop(5)
    if parser == "deepseek_r1":
        assert (message.content, extra["reasoning"], extra["reasoning_content"]) == (
            None, want, want)
        assert (streamed, text) == (want, "")
    else:
        assert (message.content, "reasoning" in extra) == (want, False)
        assert (streamed, text) == ("", want)


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_responses_api_answers_a_reasoning_item(artifact, llama, parser) -> None:
    """The same on the Responses API: DeepSeek-R1's cut thinking is one reasoning item and
    no message (as OpenAI answers a reasoning model cut while it thinks), streamed as
    reasoning_text events that the openai client's stream helper accepts (it checks their
    items' identities)."""
    want = tokenizer().decode(greedy(llama, rendered_ids([{"role": "user", "content": PROMPT}]), 8)[0])
    s = start(artifact, reasoning_parser=parser)
    try:
        ask = dict(model=s.slot.name, input=PROMPT, max_output_tokens=8, temperature=0,
                   extra_body={"ignore_eos": True})
        got = openai_client(s).responses.create(**ask)
        with openai_client(s).responses.stream(**ask) as stream:
            events = list(stream)  # (its final-response getter waits for "completed")
        kinds, final = [e.type for e in events], events[-1].response
    finally:
        s.stop(5)
    assert got.status == final.status == "incomplete"
    if parser == "deepseek_r1":
        assert [(o.type, o.content[0].text) for o in got.output] == [("reasoning", want)]
        assert [(o.type, o.content[0].text) for o in final.output] == [("reasoning", want)]
        assert [k for k in kinds if k != "response.reasoning_text.delta"] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.reasoning_text.done", "response.output_item.done", "response.incomplete"]
    else:
        assert [o.type for o in got.output] == ["message"] and got.output_text == want
        assert final.output_text == want and "response.reasoning_text.delta" not in kinds


def test_the_messages_api_answers_a_thinking_block(artifact, llama) -> None:
    """Anthropic's Messages API with DeepSeek-R1's parser: the cut thinking is one thinking
    block (no text block), streamed as thinking_delta events that the anthropic client's
    stream helper joins into the same block."""
    import anthropic

    want = tokenizer().decode(greedy(llama, rendered_ids([{"role": "user", "content": PROMPT}]), 8)[0])
    s = start(artifact, reasoning_parser="deepseek_r1")
    try:
        c = anthropic.Anthropic(base_url=f"http://127.0.0.1:{s.http_port}", api_key="unused",
                                max_retries=0, timeout=60)
        ask = dict(model=s.slot.name, max_tokens=8, messages=[{"role": "user", "content": PROMPT}],
                   thinking={"type": "adaptive"}, extra_body={"temperature": 0, "ignore_eos": True})
        got = c.messages.create(**ask)
        with c.messages.stream(**ask) as stream:
            deltas = [e.thinking for e in stream if e.type == "thinking"]
            final = stream.get_final_message()
    finally:
        s.stop(5)
    for message in (got, final):
        assert [(b.type, b.thinking) for b in message.content] == [("thinking", want)]
        assert message.stop_reason == "max_tokens"
    assert "".join(deltas) == want


def test_streamed_thinking_then_answer_are_two_items_in_order(artifact) -> None:
    """What this random model cannot write, a thought and then an answer, through the
    Responses API's event writer: the reasoning item (index 0) closes when the message
    (index 1) opens; each event is one the openai client's types accept."""
    import asyncio
    import json

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from serving.http.reasoning import Thinking
    from serving.http.responses_api import _Answer, _events
    from serving.sampling import Chunk

    texts = ["Red ", "foxes.</th", "ink>\n", "Red."]

    async def chunks():
        for i, text in enumerate(texts):
            yield Chunk((i,), text, i == len(texts) - 1, "stop" if i == len(texts) - 1 else None)

    async def written(answer) -> list[dict]:
        return [json.loads(e.decode().split("data: ", 1)[1]) async for e in _events(
            answer, chunks(), lambda final: None)]

    s = start(artifact)
    try:
        answer = _Answer(engine=s.slot.engine, body={}, prompt=3, logprobs=False,
                         thinking=Thinking("deepseek_r1"))
        events = asyncio.run(written(answer))
    finally:
        s.stop(5)
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)
    placed = [(e["type"].removeprefix("response."), e.get("output_index")) for e in events
              if e["type"] not in ("response.created", "response.in_progress")]
    assert placed == [
        ("output_item.added", 0), ("reasoning_text.delta", 0), ("reasoning_text.delta", 0),
        ("reasoning_text.done", 0), ("output_item.done", 0), ("output_item.added", 1),
        ("content_part.added", 1), ("output_text.delta", 1), ("output_text.delta", 1),
        ("output_text.done", 1),
        ("content_part.done", 1), ("output_item.done", 1), ("completed", None)]
    final = events[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["reasoning", "message"]
    assert final[0]["content"][0]["text"] == "Red foxes."
    assert final[1]["content"][0]["text"] == "\nRed."


def test_an_agents_next_turn_sends_the_reasoning_back(artifact) -> None:
    """Agent frameworks send a reasoning model's earlier reasoning items back as input (and
    ask for `reasoning.encrypted_content` when nothing is stored): taken, and left out of
    the prompt as these models' templates leave earlier thinking."""
    turn = [{"role": "user", "content": PROMPT}]
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Hmm."}]}
    s = start(artifact, reasoning_parser="deepseek_r1")
    try:
        c = openai_client(s)
        alone = c.responses.create(model=s.slot.name, input=turn, max_output_tokens=2)
        back = c.responses.create(model=s.slot.name, input=[*turn, thought],
                                  include=["reasoning.encrypted_content"],
                                  max_output_tokens=2)
    finally:
        s.stop(5)
    assert back.usage.input_tokens == alone.usage.input_tokens == len(rendered_ids([{"role": "user", "content": PROMPT}]))


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}


@pytest.mark.parametrize("parser, text, fits", [
    ("deepseek_r1", 'Hmm, a number.</think>{"a":1}', True),
    ("deepseek_r1", '</think>{"a":2}', True),
    ("deepseek_r1", "Hmm.</think>no JSON", False),
    ("qwen3", '{"a":1}', True),  # thinking off: the answer at once
    ("qwen3", '<think>Hmm.</think>{"a":1}', True),
    ("qwen3", 'Hmm.</think>{"a":1}', False),  # thinking without opening the block
])
def test_a_grammar_holds_the_answer_after_the_thinking(parser, text, fits) -> None:
    """The engine's matcher for a JSON schema under each family's thinking, fed a text's
    tokens: free thinking up to </think>, then the schema."""
    from serving.generation.grammar import GrammarCompiler, GrammarError
    from serving.sampling import Grammar

    grammar = Grammar.of("json", SCHEMA)
    matcher = GrammarCompiler(tokenizer(), tokenizer().get_vocab_size(), [0]).matcher(
        Grammar(grammar.kind, grammar.source, thinking=parser))
    try:
        done = [matcher.advance(t) for t in tokenizer().encode(text).ids][-1]
    except GrammarError:
        done = False
    assert done is fits


def test_a_served_grammar_leaves_the_thinking_free(artifact, llama) -> None:
    """Served with DeepSeek-R1's parser, a JSON schema constrains only what follows
    </think>: this random model's reply equals greedy under the same composition written
    here (llguidance's own grammars), and, never closing its thinking, is all reasoning."""
    import json

    from llguidance import LLMatcher

    from llm_support import guided_greedy

    answer = json.loads(LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}))["grammars"][0]
    composed = json.dumps({"grammars": [
        {"lark_grammar": 'start: t @a\nt[stop="</think>"]: /(.|\n)*/'},
        {**answer, "name": "a"}]})
    s = start(artifact, reasoning_parser="deepseek_r1")
    try:
        eos = s.slot.engine.text.eos_ids[0]
        want = tokenizer().decode(guided_greedy(llama, rendered_ids(
            [{"role": "user", "content": PROMPT}]), composed, eos, 8))
        message = openai_client(s).chat.completions.create(
            model=s.slot.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
            temperature=0, response_format={"type": "json_schema", "json_schema": {
                "name": "a", "schema": SCHEMA}}).choices[0].message
    finally:
        s.stop(5)
    assert (message.content, message.model_extra["reasoning"]) == (None, want)


def test_an_unknown_parser_is_refused_before_serving() -> None:
    from serving.server import ServerOptions
    from tuner.errors import BadInput

    with pytest.raises(BadInput, match="--reasoning-parser must be one of \\['deepseek_r1', "
                       "'qwen3'\\], not 'granite'"):
        ServerOptions(reasoning_parser="granite")
