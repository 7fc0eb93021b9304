"""The OpenAI-compatible API driven by the real `openai` Python client (whole and streamed)
and by curl: models, completions and chat completions (the prompt rendered from the
artifact's chat template exactly as transformers renders it), greedy text equal to ONNX
Runtime's own greedy run, usage, stop strings across token boundaries, the end token and
ignore_eos, log-probs and the k most likely tokens' against ONNX Runtime's logits, seeds,
`n` choices (equal when greedy, from seed, seed + 1, ... when sampled; a beam search's and
best_of's: tests/test_openai_choices.py), OpenAI error objects with their statuses, the
bearer token, and a client that closes its stream freeing its slots."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import openai
import pytest
from llm_support import (CHAT, EOS_PROMPT, NO_EOS, PROMPT, decoder_artifact,  # noqa: F401
                         greedy, llama, log_softmax, logits_of, openai_client, rendered,
                         start, tokenizer, wait_for)

MESSAGES = CHAT


@pytest.fixture(scope="module")
def artifact(llama, tmp_path_factory):
    return decoder_artifact(tmp_path_factory.mktemp("oai"), llama)


@pytest.fixture(scope="module")
def server(artifact):
    s = start(artifact, generate={"max_streams": 4, "max_tokens": 64})
    yield s
    s.stop(5)



def _want(llama, prompt: str, n: int) -> tuple[list[int], str]:
    ids, _ = greedy(llama, tokenizer().encode(prompt).ids, n)
    return ids, tokenizer().decode(ids)


def test_completions_default_to_16_tokens_as_openai(server) -> None:
    got = openai_client(server).completions.create(model=server.slot.name, prompt=PROMPT,
                                             extra_body=NO_EOS)
    assert got.usage.completion_tokens == 16


def test_models_lists_the_served_model(server) -> None:
    assert [m.id for m in openai_client(server).models.list().data] == [server.slot.name]
    assert openai_client(server).models.retrieve(server.slot.name).id == server.slot.name
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist"):
        openai_client(server).models.retrieve("gpt-4")


def test_completion_is_greedy_with_usage(server, llama) -> None:
    ids, text = _want(llama, PROMPT, 8)
    got = openai_client(server).completions.create(model=server.slot.name, prompt=PROMPT,
                                             max_tokens=8, temperature=0, extra_body=NO_EOS)
    assert got.choices[0].text == text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(tokenizer().encode(PROMPT).ids)
    assert got.usage.completion_tokens == 8 and got.usage.total_tokens == got.usage.prompt_tokens + 8


def test_streamed_completion_ends_with_usage(server, llama) -> None:
    _, text = _want(llama, PROMPT, 8)
    chunks = list(openai_client(server).completions.create(
        model=server.slot.name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8 and len(chunks) >= 9
    # vLLM's continuous_usage_stats: each chunk's usage counts the tokens sent so far
    chunks = list(openai_client(server).completions.create(
        model=server.slot.name, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body=NO_EOS))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 8
    assert all(c.usage.prompt_tokens == len(tokenizer().encode(PROMPT).ids) for c in chunks)


def test_chat_renders_the_template_as_transformers_does(server, artifact, llama) -> None:
    text = rendered(MESSAGES)
    prompt = tokenizer().encode(text, add_special_tokens=False).ids
    ids, _ = greedy(llama, prompt, 6)
    got = openai_client(server).chat.completions.create(model=server.slot.name, messages=MESSAGES,
                                                  max_tokens=6, temperature=0,
                                                  extra_body=NO_EOS)
    assert got.usage.prompt_tokens == len(prompt)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == tokenizer().decode(ids)
    streamed = list(openai_client(server).chat.completions.create(
        model=server.slot.name, messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        extra_body=NO_EOS))
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == tokenizer().decode(ids)
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_strings_across_tokens_trim_the_text(server, llama) -> None:
    pieces = [tokenizer().decode([t]) for t in _want(llama, PROMPT, 16)[0]]
    full = "".join(pieces)
    i = next(k for k in range(1, 15) if pieces[k] and len(pieces[k + 1]) >= 2)
    stop = pieces[i][-1:] + pieces[i + 1][:2]
    for stream in (False, True):
        got = openai_client(server).completions.create(model=server.slot.name, prompt=PROMPT,
                                                 max_tokens=16, temperature=0, stop=[stop],
                                                 stream=stream, extra_body=NO_EOS)
        chunks = list(got) if stream else [got]
        assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]
        assert chunks[-1].choices[0].finish_reason == "stop"
        # vLLM's stop_reason names the stop string (None on the other chunks)
        assert [(c.choices[0].model_extra or {}).get("stop_reason") for c in chunks] == [
            None] * (len(chunks) - 1) + [stop]


def test_the_end_token_stops_unless_ignore_eos(server, llama) -> None:
    eos = server.slot.engine.text.eos_ids[0]
    k = _want(llama, EOS_PROMPT, 16)[0].index(eos)
    c = openai_client(server)
    stopped = c.completions.create(model=server.slot.name, prompt=EOS_PROMPT, max_tokens=20,
                                   temperature=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == k
    assert stopped.choices[0].model_extra["stop_reason"] is None  # an end token, no string
    going = c.completions.create(model=server.slot.name, prompt=EOS_PROMPT, max_tokens=20,
                                 temperature=0, extra_body=NO_EOS)
    assert going.usage.completion_tokens == 20


def test_logprobs_are_the_models_own(server, llama) -> None:
    ids, logits = greedy(llama, tokenizer().encode(PROMPT).ids, 5)
    want = [float(log_softmax(v)[t]) for v, t in zip(logits, ids)]
    c = openai_client(server)
    got = c.completions.create(model=server.slot.name, prompt=PROMPT, max_tokens=5,
                               temperature=0, logprobs=0, extra_body=NO_EOS)
    np.testing.assert_allclose(got.choices[0].logprobs.token_logprobs, want, atol=1e-3)
    chat = c.chat.completions.create(model=server.slot.name, messages=MESSAGES, max_tokens=4,
                                     temperature=0, logprobs=True, extra_body=NO_EOS)
    assert len(chat.choices[0].logprobs.content) == 4
    assert all(t.logprob <= 0 for t in chat.choices[0].logprobs.content)


def test_seeded_sampling_is_reproducible(server) -> None:
    def run(seed: int) -> str:
        return openai_client(server).completions.create(
            model=server.slot.name, prompt=PROMPT, max_tokens=12, temperature=1.0, top_p=0.9,
            seed=seed, extra_body=NO_EOS).choices[0].text

    assert run(7) == run(7) and run(7) != run(8)


def test_n_greedy_choices_are_equal_each_with_its_index(server, llama) -> None:
    _, text = _want(llama, PROMPT, 8)
    c = openai_client(server)
    got = c.completions.create(model=server.slot.name, prompt=PROMPT, max_tokens=8, n=3,
                               temperature=0, extra_body=NO_EOS)
    assert [(x.index, x.text) for x in got.choices] == [(0, text), (1, text), (2, text)]
    assert got.usage.completion_tokens == 3 * 8
    assert got.usage.prompt_tokens == len(tokenizer().encode(PROMPT).ids)
    chunks = list(c.chat.completions.create(
        model=server.slot.name, messages=MESSAGES, max_tokens=6, n=2, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body=NO_EOS))
    choices = [x.choices[0] for x in chunks if x.choices]
    texts = ["".join(x.delta.content or "" for x in choices if x.index == i) for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]
    firsts = [next(x for x in choices if x.index == i) for i in (0, 1)]
    assert all(x.delta.role == "assistant" for x in firsts)
    assert [x.finish_reason for x in choices if x.finish_reason] == ["length", "length"]
    assert chunks[-1].usage.completion_tokens == 2 * 6


def test_n_sampled_choices_come_from_seed_seed_plus_1_and_so_on(server) -> None:
    def run(seed: int, n: int = 1, stream: bool = False) -> list[str]:
        got = openai_client(server).completions.create(
            model=server.slot.name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed,
            n=n, stream=stream, extra_body=NO_EOS)
        if not stream:
            return [x.text for x in sorted(got.choices, key=lambda x: x.index)]
        texts = [""] * n
        for chunk in got:
            texts[chunk.choices[0].index] += chunk.choices[0].text
        return texts

    alone = [run(11)[0], run(12)[0], run(13)[0]]
    assert len(set(alone)) == 3
    assert run(11, 3) == alone and run(11, 3, stream=True) == alone


def _top(logits: np.ndarray, k: int) -> list[tuple[str, float]]:
    """The k most likely tokens' text and log-prob under one row of raw logits."""
    lp = log_softmax(logits)
    return [(tokenizer().decode([int(i)]), float(lp[i])) for i in np.argsort(-lp)[:k]]


def test_top_logprobs_are_the_models_k_most_likely(server, artifact, llama) -> None:
    ids, logits = greedy(llama, tokenizer().encode(PROMPT).ids, 4)
    want = [_top(v, 3) for v in logits]
    c = openai_client(server)
    for stream in (False, True):
        got = c.completions.create(model=server.slot.name, prompt=PROMPT, max_tokens=4,
                                   temperature=0, logprobs=3, stream=stream, extra_body=NO_EOS)
        tops = [t for x in (got if stream else [got]) for t in x.choices[0].logprobs.top_logprobs]
        assert len(tops) == 4
        for top, expected in zip(tops, want):  # the sampled (greedy) token is the first
            assert list(top) == [t for t, _ in expected]
            np.testing.assert_allclose(list(top.values()), [p for _, p in expected], atol=1e-3)
    prompt = tokenizer().encode(rendered(MESSAGES), add_special_tokens=False)
    want = [_top(v, 2) for v in greedy(llama, prompt.ids, 3)[1]]
    for stream in (False, True):
        got = c.chat.completions.create(model=server.slot.name, messages=MESSAGES, max_tokens=3,
                                        temperature=0, logprobs=True, top_logprobs=2,
                                        stream=stream, extra_body=NO_EOS)
        content = [t for x in (got if stream else [got]) if x.choices
                   for t in (x.choices[0].logprobs.content if x.choices[0].logprobs else [])]
        assert len(content) == 3
        for t, expected in zip(content, want):
            assert [a.token for a in t.top_logprobs] == [e for e, _ in expected]
            np.testing.assert_allclose([a.logprob for a in t.top_logprobs],
                                       [p for _, p in expected], atol=1e-3)
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].bytes == list(
                t.token.encode())


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(server, llama) -> None:
    """What lm-evaluation-harness sends to score a continuation: the prompt echoed with every
    token's log-prob (the first one null) under ONNX Runtime's own logits of the whole prompt,
    with no token (max_tokens 0) or after it the greedy ones, whole or streamed."""
    ids = tokenizer().encode(PROMPT).ids
    lp = log_softmax(logits_of(llama, ids))  # (S, V)
    want = [float(lp[j, ids[j + 1]]) for j in range(len(ids) - 1)]
    c, name = openai_client(server), server.slot.name
    alone = c.completions.create(model=name, prompt=PROMPT, echo=True, logprobs=1,
                                 max_tokens=0, temperature=0)
    got = alone.choices[0]
    assert got.text == PROMPT and alone.usage.completion_tokens == 0
    assert got.logprobs.tokens == [tokenizer().decode([t]) for t in ids]
    assert got.logprobs.token_logprobs[0] is None and got.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(got.logprobs.token_logprobs[1:], want, atol=1e-3)
    for j, top in enumerate(got.logprobs.top_logprobs[1:]):  # the most likely, and the token
        likeliest = tokenizer().decode([int(np.argmax(lp[j]))])
        assert top[likeliest] == pytest.approx(lp[j].max(), abs=1e-3)
    assert got.logprobs.text_offset[:2] == [0, len(got.logprobs.tokens[0])]
    new, _ = greedy(llama, ids, 3)
    for stream in (False, True):
        answer = c.completions.create(model=name, prompt=PROMPT, echo=True, logprobs=1,
                                      max_tokens=3, temperature=0, stream=stream,
                                      extra_body=NO_EOS)
        chunks = list(answer) if stream else [answer]
        assert "".join(x.choices[0].text for x in chunks) == PROMPT + tokenizer().decode(new)
        values = [v for x in chunks for v in x.choices[0].logprobs.token_logprobs]
        assert len(values) == len(ids) + 3 and values[0] is None
        np.testing.assert_allclose(values[1:len(ids)], want, atol=1e-3)
    without = c.completions.create(model=name, prompt=PROMPT, echo=True, max_tokens=2,
                                   temperature=0, extra_body=NO_EOS)
    assert without.choices[0].text == PROMPT + tokenizer().decode(new[:2])
    assert without.choices[0].logprobs is None


def test_a_batch_of_prompts_answers_each_in_order(server, llama) -> None:
    """OpenAI's list of prompts (strings or token ids): choice index = prompt * n + choice,
    each prompt's tokens counted once."""
    prompts = [PROMPT, EOS_PROMPT]
    want = [_want(llama, p, 4)[1] for p in prompts]
    c = openai_client(server)
    for batch in (prompts, [tokenizer().encode(p).ids for p in prompts]):
        got = c.completions.create(model=server.slot.name, prompt=batch, max_tokens=4, n=2,
                                   temperature=0, extra_body=NO_EOS)
        assert [(x.index, x.text) for x in sorted(got.choices, key=lambda x: x.index)] == [
            (0, want[0]), (1, want[0]), (2, want[1]), (3, want[1])]
        assert got.usage.prompt_tokens == sum(len(tokenizer().encode(p).ids) for p in prompts)
        assert got.usage.completion_tokens == 4 * 4


def test_what_cannot_be_honoured_is_refused_not_ignored(server) -> None:
    c, name = openai_client(server), server.slot.name
    with pytest.raises(openai.BadRequestError, match="'response_format' 'grammar' is not"):
        c.chat.completions.create(model=name, messages=MESSAGES,
                                  response_format={"type": "grammar"})
    with pytest.raises(openai.BadRequestError, match="'auto' \\(the model decides\\)"):
        c.chat.completions.create(model=name, messages=MESSAGES, tools=[{
            "type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported here"):
        c.completions.create(model=name, prompt=PROMPT, extra_body={"tools": [{}]})
    with pytest.raises(openai.BadRequestError, match="'suffix' needs a code model's fill-in"):
        c.completions.create(model=name, prompt=PROMPT, suffix="the end")  # (it has none)
    with pytest.raises(openai.BadRequestError, match="'echo' is a parameter of /v1/completions"):
        c.chat.completions.create(model=name, messages=MESSAGES, extra_body={"echo": True})
    with pytest.raises(openai.BadRequestError, match="'prompt' must be a string, a list"):
        c.completions.create(model=name, prompt=[PROMPT, 5])
    fine = c.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2,
                                     response_format={"type": "text"}, tool_choice="none")
    assert fine.choices[0].message.role == "assistant"


def test_errors_are_openai_error_objects(server) -> None:
    c = openai_client(server)
    with pytest.raises(openai.NotFoundError, match="unknown model: 'gpt-4'"):
        c.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="temperature must be a finite number"):
        c.completions.create(model=server.slot.name, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="'logprobs' must be between 0 and 20"):
        c.completions.create(model=server.slot.name, prompt=PROMPT, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs'"):
        c.chat.completions.create(model=server.slot.name, messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="no chat template|'messages' must be"):
        c.chat.completions.create(model=server.slot.name, messages=[])
    with pytest.raises(openai.BadRequestError, match="'n' must be between 1 and 4 .*not 5"):
        c.chat.completions.create(model=server.slot.name, messages=MESSAGES, n=5)
    with pytest.raises(openai.BadRequestError, match="only text is generated here"):
        c.chat.completions.create(model=server.slot.name, messages=MESSAGES,
                                  modalities=["text", "audio"],
                                  audio={"voice": "alloy", "format": "wav"})
    for extra in ({"skip_special_tokens": False},
                  {"prompt_logprobs": 1}, {"truncate_prompt_tokens": 4}):
        with pytest.raises(openai.BadRequestError, match=f"'{next(iter(extra))}' is not "):
            c.chat.completions.create(model=server.slot.name, messages=MESSAGES,
                                      extra_body=extra)
    with pytest.raises(openai.BadRequestError, match="'web_search_options' is not supported"):
        c.chat.completions.create(model=server.slot.name, messages=MESSAGES,
                                  web_search_options={})
    with pytest.raises(openai.BadRequestError, match="max_tokens 400 is over the limit 64"):
        c.completions.create(model=server.slot.name, prompt=PROMPT, max_tokens=400)


def test_a_bearer_token_guards_the_api(artifact) -> None:
    guarded = start(artifact, token="tok-123", generate={"max_tokens": 8})
    try:
        with pytest.raises(openai.AuthenticationError, match="bearer token"):
            openai_client(guarded, "wrong").models.list()
        assert openai_client(guarded, "tok-123").models.list().data[0].id == guarded.slot.name
    finally:
        guarded.stop(5)


def test_curl_streams_sse_ending_with_done(server, llama) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    _, text = _want(llama, PROMPT, 5)
    body = json.dumps({"model": server.slot.name, "prompt": PROMPT, "max_tokens": 5,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                          f"http://127.0.0.1:{server.http_port}/v1/completions"],
                         capture_output=True, timeout=60).stdout.decode()
    events = [e for e in out.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


@pytest.mark.parametrize("n", [1, 2])
def test_closing_a_stream_frees_its_slots(server, n) -> None:
    stream = openai_client(server).completions.create(model=server.slot.name, prompt=PROMPT, n=n,
                                                max_tokens=60, stream=True, extra_body=NO_EOS)
    next(iter(stream))
    assert wait_for(lambda: server.slot.engine.active() == n)  # one stream per choice
    stream.close()
    assert wait_for(lambda: server.slot.engine.active() == 0)
