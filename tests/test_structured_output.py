"""Structured output as clients ask for it: the openai client's `chat.completions.parse` and
`responses.parse` with a pydantic model (strict json_schema), JSON mode, vLLM's
`guided_choice` / `structured_outputs`, TensorRT-LLM's guide tensors and the vLLM backend's
`structured_outputs` over tritonclient. Each output equals an independent reference: greedy
on ONNX Runtime's logits of the whole sequence, masked by llguidance's own numpy helpers
(nothing of the server's code), and parses as what was asked."""

from __future__ import annotations

import json
import queue
import re

import numpy as np
import openai
import pytest
import tritonclient.grpc as tg
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import (PROMPT, VOCAB, guided_greedy, llama, openai_client,  # noqa: F401
                         tokenizer)
from pydantic import BaseModel, Field

from serving.errors import InvalidArgument
from serving.generation import GenerateOptions, Generator
from serving.sampling import GenerationRequest, Grammar
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

MESSAGES = [{"role": "user", "content": "Who are you?"}]


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=99)


def _eos(server) -> int:
    return server.slot.engine.text.eos_ids[0]


def _json(schema: dict) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def _chat_prompt(server) -> list[int]:
    from serving.http.chat import render

    text = render(server.slot.engine.text, MESSAGES)
    return tokenizer().encode(text, add_special_tokens=False).ids



def test_chat_completions_parse_a_pydantic_model(server, llama) -> None:
    from openai.lib._pydantic import to_strict_json_schema

    got = openai_client(server).chat.completions.parse(model=server.slot.name, messages=MESSAGES,
                                                 response_format=Person, temperature=0)
    person = got.choices[0].message.parsed
    assert isinstance(person, Person) and got.choices[0].finish_reason == "stop"
    want = guided_greedy(llama, _chat_prompt(server), _json(to_strict_json_schema(Person)),
                     _eos(server))
    assert got.choices[0].message.content == tokenizer().decode(want)


def test_json_mode_answers_an_object(server, llama) -> None:
    got = openai_client(server).chat.completions.create(
        model=server.slot.name, messages=MESSAGES, temperature=0, max_tokens=40,
        response_format={"type": "json_object"})
    content = got.choices[0].message.content
    assert isinstance(json.loads(content), dict)
    want = guided_greedy(llama, _chat_prompt(server), _json({"type": "object"}), _eos(server), 40)
    assert content == tokenizer().decode(want)


def test_vllm_guided_choice_and_regex_whole_and_streamed(server, llama) -> None:
    c, prompt = openai_client(server), tokenizer().encode(PROMPT).ids
    choices = ["red fox", "grey wolf", "brown bear"]
    got = c.completions.create(model=server.slot.name, prompt=PROMPT, temperature=0,
                               max_tokens=10, extra_body={"guided_choice": choices})
    assert got.choices[0].text in choices and got.choices[0].finish_reason == "stop"
    grammar = "start: " + " | ".join(json.dumps(x) for x in choices)
    assert got.choices[0].text == tokenizer().decode(guided_greedy(llama, prompt, grammar,
                                                               _eos(server)))
    regex = r"[0-9]{3}-[a-z]{2,4}"
    streamed = c.completions.create(model=server.slot.name, prompt=PROMPT, temperature=0,
                                    max_tokens=10, stream=True,
                                    extra_body={"structured_outputs": {"regex": regex}})
    text = "".join(x.choices[0].text for x in streamed)
    assert re.fullmatch(regex, text)
    from llguidance import LLMatcher

    assert text == tokenizer().decode(guided_greedy(llama, prompt, LLMatcher.grammar_from_regex(
        regex), _eos(server)))


def test_responses_parse_a_pydantic_model(server) -> None:
    got = openai_client(server).responses.parse(model=server.slot.name, input="Who are you?",
                                          text_format=Person, temperature=0)
    assert isinstance(got.output_parsed, Person) and got.status == "completed"


def _tensor(name: str, value, datatype: str = "BYTES"):
    array = np.array([value.encode() if isinstance(value, str) else value],
                     object if datatype == "BYTES" else np.int32)
    made = tg.InferInput(name, list(array.shape), datatype)
    made.set_data_from_numpy(array)
    return made


def _stream(server, inputs: list) -> tuple[list[int], str]:
    got: queue.Queue = queue.Queue()
    with tg.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        client.start_stream(lambda result, error: got.put((result, error)))
        client.async_stream_infer(server.slot.name, inputs)
        ids, text = [], ""
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                client.stop_stream()
                raise error
            ids += result.as_numpy("output_ids").reshape(-1).tolist()
            text += result.as_numpy("text_output")[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                client.stop_stream()
                return ids, text


def test_tensorrt_llm_guides_and_the_vllm_backends_structured_outputs(server, llama) -> None:
    from llguidance import LLMatcher

    prompt = tokenizer().encode(PROMPT).ids
    ids, _ = _stream(server, [_tensor("text_input", PROMPT),
                              _tensor("max_tokens", 12, "INT32"),
                              _tensor("guided_decoding_guide_type", "regex"),
                              _tensor("guided_decoding_guide", "(ab|cd)[0-9]{2}")])
    assert ids == guided_greedy(llama, prompt, LLMatcher.grammar_from_regex("(ab|cd)[0-9]{2}"),
                            _eos(server))
    schema = {**Person.model_json_schema(), "additionalProperties": False}
    _, text = _stream(server, [_tensor("text_input", PROMPT), _tensor(
        "sampling_parameters", json.dumps({"max_tokens": "40", "ignore_eos": "true",
                                           "structured_outputs": {"json": schema}}))])
    assert Person.model_validate_json(text)
    # an EBNF grammar (xgrammar's / GBNF's, as TensorRT-LLM takes it) of the regex's language
    ebnf = 'root ::= pair digit digit\npair ::= "ab" | "cd"\ndigit ::= [0-9]'
    got, _ = _stream(server, [_tensor("text_input", PROMPT), _tensor("max_tokens", 12, "INT32"),
                              _tensor("guided_decoding_guide_type", "ebnf_grammar"),
                              _tensor("guided_decoding_guide", ebnf)])
    assert got == ids
    with pytest.raises(Exception, match="the grammar cannot be compiled: Expected"):
        _stream(server, [_tensor("text_input", PROMPT),
                         _tensor("guided_decoding_guide_type", "ebnf_grammar"),
                         _tensor("guided_decoding_guide", "root ::= (\"a\"")])
    with pytest.raises(Exception, match="'guided_decoding_guide_type' must be one of"):
        _stream(server, [_tensor("text_input", PROMPT),
                         _tensor("guided_decoding_guide_type", "structural_tag"),
                         _tensor("guided_decoding_guide", "{}")])


@pytest.mark.parametrize("body, says", [
    ({"extra_body": {"guided_regex": "(ab"}}, "the regex cannot be compiled"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "needs 'json_schema.schema'"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}},
     "ask for one structured output"),
    ({"extra_body": {"guided_choice": []}}, "a choice must be a non-empty list of strings"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "json": {}}}}, "exactly one of"),
])
def test_bad_structured_output_is_400(server, body, says) -> None:
    with pytest.raises(openai.BadRequestError, match=says):
        openai_client(server).chat.completions.create(model=server.slot.name, messages=MESSAGES,
                                                max_tokens=4, **body)


def test_a_constrained_stream_leaves_the_others_in_its_batch_alone(llama) -> None:
    """Three streams at once, one under a grammar: the others give what they give alone."""
    eos = 7
    gen = Generator(OrtRunner(load_cpu(llama)), cache_record(load_model(llama)), VOCAB,
                    GenerateOptions(), max_positions=256, tokenizer=tokenizer(),
                    eos_ids=(eos,))

    def run(requests) -> list[list[int]]:
        queues = [queue.Queue() for _ in requests]
        reasons.clear()
        for q, r in zip(queues, requests):
            gen.submit(r, q.put)
        out = []
        for q in queues:
            chunks = [q.get(timeout=60)]
            while not chunks[-1].final:
                chunks.append(q.get(timeout=60))
            out.append([t for c in chunks for t in c.ids])
            reasons.append(chunks[-1].reason)
        return out

    reasons: list[str] = []

    try:
        prompts = [tuple(tokenizer().encode(t).ids) for t in (PROMPT, "A dog", "Cafe au lait")]
        free = [GenerationRequest(p, 12) for p in prompts[1:]]
        alone = [run([r])[0] for r in free]
        guided = GenerationRequest(prompts[0], 12, grammar=Grammar("regex", "[a-c]{5}"))
        together = run([guided, *free])
        assert together[1:] == alone
        from llguidance import LLMatcher

        assert together[0] == guided_greedy(llama, list(prompts[0]),
                                        LLMatcher.grammar_from_regex("[a-c]{5}"), eos)
        # the only token the grammar allows is a bad word: that stream alone ends, an error
        a = tokenizer().token_to_id("a")
        stuck, beside = run([GenerationRequest(prompts[0], 4, grammar=Grammar("regex", "a"),
                                               bad_words=((a,),)), free[0]])
        assert stuck == [] and beside == alone[0] and reasons == ["error", "length"]
        with pytest.raises(InvalidArgument, match="the grammar cannot be compiled"):
            gen.submit(GenerationRequest(prompts[0], 4, grammar=Grammar("grammar", "start: (")),
                       lambda c: None)
    finally:
        gen.close()
