"""OpenAI's Responses API (`POST /v1/responses`) driven by the real openai client:
`responses.create` whole and streamed, the `responses.stream` helper (which checks the
events' order and identities itself), against a greedy reference computed with ONNX
Runtime on the prompt transformers' `apply_chat_template` renders; log-probs against ONNX
Runtime's own; what cannot be honoured refused with 400."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from llm_support import (decoder_artifact, end_token_at, greedy, llama,  # noqa: F401
                         log_softmax, openai_client, rendered_ids, start, tokenizer,
                         wait_for)

INSTRUCTIONS = "You are terse."
QUESTION = "Name a fox."
END_AT = 5  # the artifact's end token is the 6th token greedy answers QUESTION with


MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    """The decoder artifact, its end token one that greedy answers QUESTION with (so an
    answer completes), first met at END_AT."""
    out = decoder_artifact(tmp_path_factory.mktemp("responses"), llama)
    end_token_at(out, llama, MESSAGES, END_AT)
    return out


@pytest.fixture(scope="module")
def server(artifact):
    s = start(artifact, generate={"max_streams": 4, "max_tokens": 64})
    yield s
    s.stop(5)


@pytest.fixture(scope="module")
def want(artifact, llama) -> tuple[list[int], list[np.ndarray]]:
    """Greedy ids (END_AT of them before the end token) and the logits of each."""
    return greedy(llama, rendered_ids(MESSAGES), END_AT)



def test_an_answer_that_meets_the_end_token_completes(server, artifact, want) -> None:
    got = openai_client(server).responses.create(model=server.slot.name, instructions=INSTRUCTIONS,
                                           input=QUESTION, temperature=0)
    assert got.status == "completed" and got.incomplete_details is None
    assert got.output_text == tokenizer().decode(want[0])
    assert [o.type for o in got.output] == ["message"] and got.output[0].role == "assistant"
    assert got.usage.output_tokens == END_AT
    assert got.usage.input_tokens == len(rendered_ids(MESSAGES)) and got.store is True


def test_the_stream_helper_accepts_the_events_and_the_final_response(server, want) -> None:
    with openai_client(server).responses.stream(model=server.slot.name, input=[
            {"role": "system", "content": INSTRUCTIONS},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": QUESTION}]}],
            temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == tokenizer().decode(want[0])
    assert final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events if e.type != "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]


def test_max_output_tokens_leaves_it_incomplete(server, want) -> None:
    c, name = openai_client(server), server.slot.name
    got = c.responses.create(model=name, instructions=INSTRUCTIONS, input=QUESTION,
                             temperature=0, max_output_tokens=3)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.output_text == tokenizer().decode(want[0][:3])
    events = list(c.responses.create(model=name, instructions=INSTRUCTIONS, input=QUESTION,
                                     temperature=0, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == got.output_text


def test_a_background_response_is_polled_and_another_cancelled(server, want) -> None:
    """`background: true`: answered at once as queued, then GET shows it completed with the
    answer a plain request gets; a long one cancelled is "cancelled" (what it had written
    kept) and its engine stream is gone."""
    c, name = openai_client(server), server.slot.name
    queued = c.responses.create(model=name, instructions=INSTRUCTIONS, input=QUESTION,
                                temperature=0, background=True)
    assert (queued.status, queued.background, queued.output) == ("queued", True, [])
    assert wait_for(lambda: c.responses.retrieve(queued.id).status == "completed", 60)
    assert c.responses.retrieve(queued.id).output_text == tokenizer().decode(want[0])
    long = c.responses.create(model=name, input=QUESTION, temperature=0, background=True,
                              max_output_tokens=60, extra_body={"ignore_eos": True})
    assert wait_for(lambda: server.slot.engine.active() == 1)
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" == c.responses.retrieve(long.id).status
    assert cancelled.usage is None or cancelled.usage.output_tokens < 60
    assert wait_for(lambda: server.slot.engine.active() == 0)
    with pytest.raises(openai.BadRequestError, match="only a response created with"):
        c.responses.cancel(c.responses.create(model=name, input=QUESTION,
                                              max_output_tokens=1).id)
    for extra, says in (({"stream": True}, "'background' with 'stream'"),
                        ({"store": False}, "'background' needs 'store'")):
        with pytest.raises(openai.BadRequestError, match=says):
            c.responses.create(model=name, input=QUESTION, background=True, **extra)


def test_logprobs_are_the_models_own(server, want) -> None:
    ids, logits = want
    got = openai_client(server).responses.create(
        model=server.slot.name, instructions=INSTRUCTIONS, input=QUESTION, temperature=0,
        max_output_tokens=3, top_logprobs=2, include=["message.output_text.logprobs"])
    entries = got.output[0].content[0].logprobs
    assert len(entries) == 3
    for entry, token, row in zip(entries, ids, logits):
        lp = log_softmax(row)
        assert entry.token == tokenizer().decode([token])
        assert entry.logprob == pytest.approx(lp[token], abs=1e-3)
        best = np.argsort(-lp)[:2]
        assert [a.token for a in entry.top_logprobs] == [tokenizer().decode([int(t)])
                                                          for t in best]


def test_a_stored_response_is_continued_retrieved_and_deleted(server) -> None:
    """`store` (true by default, as OpenAI's): `previous_response_id` continues the kept
    conversation (its instructions not carried over, as OpenAI answers), streamed answers
    are kept too, `retrieve` gives the response back, `delete` forgets it."""
    c, name = openai_client(server), server.slot.name
    first = c.responses.create(model=name, instructions=INSTRUCTIONS, input=QUESTION,
                               temperature=0)
    again = "Another one?"
    events = list(c.responses.create(model=name, previous_response_id=first.id, input=again,
                                     temperature=0, max_output_tokens=2, stream=True))
    second = events[-1].response
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": again}]
    assert second.usage.input_tokens == len(rendered_ids(history))
    assert second.previous_response_id == first.id
    assert c.responses.retrieve(second.id).output_text == second.output_text
    third = c.responses.create(model=name, previous_response_id=second.id, input="Why?",
                               max_output_tokens=1, store=False)
    assert third.usage.input_tokens == len(rendered_ids(history + [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Why?"}]))
    c.responses.delete(first.id)
    for call in (lambda: c.responses.retrieve(first.id),  # deleted
                 lambda: c.responses.retrieve(third.id),  # never stored
                 lambda: c.responses.create(model=name, previous_response_id=first.id,
                                            input=again)):
        with pytest.raises(openai.NotFoundError, match="not found"):
            call()


def test_the_store_keeps_the_newest() -> None:
    from serving.http.response_store import ResponseStore, Stored

    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(Stored((), {"id": f"resp_{i}"}))
    assert len(store) == 2 and store.get("resp_2").response == {"id": "resp_2"}
    with pytest.raises(Exception, match="resp_0' not found"):
        store.get("resp_0")


@pytest.mark.parametrize("extra, says", [
    ({"conversation": "conv_1"}, "'conversation' is not supported"),
    ({"tools": [{"type": "web_search"}]}, "built-in tools are not served"),
    ({"text": {"format": {"type": "grammar"}}}, "'text.format' 'grammar' is not"),
    ({"reasoning": {"effort": "low"}}, "'reasoning' settings are not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]},
     "input\\[0\\] must be a message, a function_call, a function_call_output or a"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "needs 'call_id', 'name' and"),
    ({"max_output_tokens": 0}, "'max_output_tokens' must be >= 1"),
])
def test_what_cannot_be_honoured_is_400(server, extra, says) -> None:
    body = {"model": server.slot.name, "input": QUESTION, **extra}
    with pytest.raises(openai.BadRequestError, match=says):
        openai_client(server).responses.create(**body)
