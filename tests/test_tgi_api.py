"""Text Generation Inference's generate API (serving/http/tgi_api.py) driven by the client
written for it, huggingface_hub's InferenceClient.text_generation, unmodified: greedy text,
token ids and log-probs equal ONNX Runtime's own (llm_support.greedy), streamed token by
token with the whole text and details on the last event, stop sequences kept in the text
as TGI keeps them, return_full_text, truncate, seeded sampling reproducible, best_of (the
likeliest of seeded samples), the prompt's log-probs (decoder_input_details), typical_p, a
JSON grammar held, and TGI's 422 for what it cannot take; `POST /` answers as TGI does there."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
from llm_support import (CHAT, NO_EOS, PROMPT, decoder, greedy, llama,  # noqa: F401
                         log_softmax, logits_of, rendered, tokenizer)

NEW = 12


@pytest.fixture(scope="module")
def client(decoder):
    from huggingface_hub import InferenceClient, constants

    # the suite runs in Hugging Face's offline mode (no hub downloads), which also stops
    # the client reaching a local server: a user's own client runs online
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield InferenceClient(model=f"http://127.0.0.1:{decoder.http_port}", timeout=60)


def _want(llama, prompt: str = PROMPT, n: int = NEW) -> tuple[list[int], list[np.ndarray]]:
    return greedy(llama, tokenizer().encode(prompt).ids, n)


def test_greedy_text_ids_and_logprobs_are_the_models_own(client, llama) -> None:
    ids, logits = _want(llama)
    assert client.text_generation(PROMPT, max_new_tokens=NEW) == tokenizer().decode(ids)
    out = client.text_generation(PROMPT, max_new_tokens=NEW, details=True, top_n_tokens=2)
    assert out.generated_text == tokenizer().decode(ids)
    assert out.details.finish_reason == "length" and out.details.generated_tokens == NEW
    assert [t.id for t in out.details.tokens] == ids
    want = [float(log_softmax(x)[t]) for x, t in zip(logits, ids)]
    assert [t.logprob for t in out.details.tokens] == pytest.approx(want, abs=1e-4)
    # greedy takes the likeliest (the client leaves these as TGI's JSON objects)
    assert [top[0]["id"] for top in out.details.top_tokens] == ids


def test_streamed_token_by_token_with_the_text_on_the_last(client, llama) -> None:
    ids, _ = _want(llama)
    events = list(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True,
                                         details=True))
    assert [e.token.id for e in events] == ids
    assert [e.token.text for e in events] == [tokenizer().decode([t]) for t in ids]
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == tokenizer().decode(ids)
    assert events[-1].details.finish_reason == "length"
    assert events[-1].details.generated_tokens == NEW
    plain = list(client.text_generation(PROMPT, max_new_tokens=NEW, stream=True))
    assert plain == [tokenizer().decode([t]) for t in ids]


def test_a_stop_sequence_ends_it_and_stays_in_the_text(client, llama) -> None:
    ids, _ = _want(llama)
    text = tokenizer().decode(ids)
    # a later token whose text is plain letters and first appears there
    k, stop = next((k, tokenizer().decode([t])) for k, t in enumerate(ids) if k >= 2
                   and tokenizer().decode([t]).strip().isalpha()
                   and text.find(tokenizer().decode([t])) == len(tokenizer().decode(ids[:k])))
    out = client.text_generation(PROMPT, max_new_tokens=NEW, stop=[stop], details=True)
    assert out.details.finish_reason == "stop_sequence"
    assert out.generated_text == tokenizer().decode(ids[:k + 1])  # the stop kept, as TGI


def test_full_text_truncate_and_seeded_sampling(client, llama) -> None:
    ids, _ = _want(llama)
    full = client.text_generation(PROMPT, max_new_tokens=NEW, return_full_text=True)
    assert full == PROMPT + tokenizer().decode(ids)
    prompt = tokenizer().encode(PROMPT).ids
    cut, _ = greedy(llama, prompt[-3:], NEW)  # truncate keeps the prompt's last tokens
    assert client.text_generation(PROMPT, max_new_tokens=NEW, truncate=3) == \
        tokenizer().decode(cut)
    sampled = [client.text_generation(PROMPT, max_new_tokens=NEW, do_sample=True,
                                      temperature=1.5, seed=s) for s in (7, 7, 8)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_the_default_length_is_held_to_the_servers_limit(client, decoder) -> None:
    # TGI's default is 100 new tokens; this server allows 64 (the fixture's --max-tokens)
    out = client.text_generation(PROMPT, details=True)
    assert out.details.finish_reason in ("length", "eos_token")
    assert out.details.generated_tokens <= decoder.slot.engine.options.max_tokens == 64


def test_best_of_answers_the_likeliest_of_reproducible_samples(client, decoder) -> None:
    """best_of 3 samples three sequences, each with a seed of its own that the details report
    and that reproduces it alone; the answer is the one with the highest log-probability per
    token, the other two are best_of_sequences; an unseeded request reports its seed too."""
    asked = dict(max_new_tokens=NEW, do_sample=True, temperature=1.5, details=True)
    out = client.text_generation(PROMPT, best_of=3, **asked)
    others = out.details.best_of_sequences
    assert len(others) == 2
    sequences = [(out.generated_text, out.details)] + [(o.generated_text, o) for o in others]
    assert len({d.seed for _, d in sequences}) == 3
    for text, d in sequences:
        again = client.text_generation(PROMPT, seed=d.seed, **asked)
        assert again.generated_text == text and again.details.seed == d.seed
        assert [t.id for t in again.details.tokens] == [t.id for t in d.tokens]

    def per_token(d) -> float:
        return sum(t.logprob for t in d.tokens) / len(d.tokens)

    assert per_token(out.details) == max(per_token(d) for _, d in sequences)
    assert len({text for text, _ in sequences}) > 1  # sampled apart, at temperature 1.5
    alone = client.text_generation(PROMPT, **asked)
    assert isinstance(alone.details.seed, int) and alone.details.best_of_sequences is None
    assert client.text_generation(PROMPT, seed=alone.details.seed, **asked).generated_text \
        == alone.generated_text
    r = requests.post(f"http://127.0.0.1:{decoder.http_port}/generate_stream", timeout=60,
                      json={"inputs": PROMPT, "parameters": {"best_of": 2, "do_sample": True}})
    assert r.status_code == 422 and "not supported when streaming" in r.json()["error"]


def test_decoder_input_details_score_the_prompt_as_the_model_does(client, decoder,
                                                                 llama) -> None:
    """What an evaluation harness asks TGI to score a continuation (lighteval's TGI
    endpoint): decoder_input_details gives every prompt token's log-prob under ONNX Runtime's
    own logits of the whole prompt, the first one null; not when streamed."""
    ids = tokenizer().encode(PROMPT).ids
    lp = log_softmax(logits_of(llama, ids))  # (S, V)
    out = client.text_generation(PROMPT, max_new_tokens=1, details=True,
                                 decoder_input_details=True)
    prefill = out.details.prefill
    assert [t.id for t in prefill] == ids and prefill[0].logprob is None
    assert [t.text for t in prefill] == [tokenizer().decode([t]) for t in ids]
    np.testing.assert_allclose([t.logprob for t in prefill[1:]],
                               [lp[j, ids[j + 1]] for j in range(len(ids) - 1)], atol=1e-3)
    assert client.text_generation(PROMPT, max_new_tokens=1, details=True).details.prefill == []
    r = requests.post(f"http://127.0.0.1:{decoder.http_port}/generate_stream", timeout=60,
                      json={"inputs": PROMPT, "parameters": {"decoder_input_details": True}})
    assert r.status_code == 422 and "not supported when streaming" in r.json()["error"]


def test_typical_p_as_langchains_tgi_classes_send_it(client, llama) -> None:
    """LangChain's HuggingFaceEndpoint (and the older HuggingFaceTextGenInference) send
    typical_p 0.95, top_p 0.95 and temperature 0.8 unless told otherwise: taken, seeded
    reproducibly; a tiny typical_p leaves only the most typical next token (the one whose
    surprise is nearest the entropy of ONNX Runtime's own distribution), whatever the seed."""
    langchain = dict(max_new_tokens=NEW, typical_p=0.95, top_p=0.95, temperature=0.8,
                     do_sample=True, seed=11)
    assert len({client.text_generation(PROMPT, **langchain) for _ in range(2)}) == 1
    ids = tokenizer().encode(PROMPT).ids
    lp = log_softmax(logits_of(llama, ids)[-1]).astype(np.float64)
    typical = int(np.argmin(np.abs(-lp + np.sum(np.exp(lp) * lp))))
    firsts = {client.text_generation(PROMPT, max_new_tokens=1, typical_p=1e-6, seed=s,
                                     details=True).details.tokens[0].id for s in range(4)}
    assert firsts == {typical} and typical != int(np.argmax(lp))


def test_a_json_grammar_is_held(client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = client.text_generation(PROMPT, max_new_tokens=24,
                                 grammar={"type": "json", "value": schema})
    assert isinstance(json.loads(out)["n"], int)


@pytest.mark.parametrize("parameters, says", [
    ({"best_of": 2}, "you must use sampling when 'best_of' is > 1"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "'seed' must not be set"),
    ({"best_of": 5, "do_sample": True}, "'best_of' must be at most 4"),
    ({"best_of": 0}, "'best_of' must be at least 1"),
    ({"watermark": True}, "'watermark' is not supported"),
    ({"temperature": 0}, "'temperature' must be strictly positive"),
    ({"temperature": "hot"}, "'temperature' must be int or float"),
    ({"grammar": {"type": "lark", "value": "x"}}, "'grammar' type must be"),
])
def test_what_it_cannot_take_is_tgis_422(decoder, parameters, says) -> None:
    r = requests.post(f"http://127.0.0.1:{decoder.http_port}/generate", timeout=60,
                      json={"inputs": PROMPT, "parameters": parameters})
    assert r.status_code == 422
    assert r.json()["error_type"] == "validation" and says in r.json()["error"]


def test_root_answers_a_list_or_a_stream_as_the_body_says(decoder, llama) -> None:
    ids, _ = _want(llama)
    url = f"http://127.0.0.1:{decoder.http_port}/"
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW}}
    assert requests.post(url, json=body, timeout=60).json() == [
        {"generated_text": tokenizer().decode(ids)}]
    with requests.post(url, json={**body, "stream": True}, timeout=60, stream=True) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:")]
    assert [e["token"]["id"] for e in events] == ids and events[-1]["index"] == NEW


def test_info_is_tgis_with_this_servers_limits(decoder) -> None:
    info = requests.get(f"http://127.0.0.1:{decoder.http_port}/info", timeout=30).json()
    generator = decoder.slot.find(decoder.slot.name).generator
    assert info["router"] == "text-generation-router"
    assert info["model_id"] == decoder.slot.name
    assert info["model_pipeline_tag"] == "text-generation"
    assert info["max_total_tokens"] == generator.max_cache_len
    assert info["max_input_tokens"] == generator.max_prompt < info["max_total_tokens"]
    assert info["max_best_of"] == 4 and info["max_stop_sequences"] == 64  # --max-streams
    too_many = {"inputs": PROMPT, "parameters": {"stop": ["x"] * 65}}
    r = requests.post(f"http://127.0.0.1:{decoder.http_port}/generate", json=too_many,
                      timeout=30)
    assert r.status_code == 422 and "at most 64" in r.json()["error"]


def test_chat_completion_from_the_client_that_names_no_model(client, llama) -> None:
    """InferenceClient given the server's URL sends `"model": "dummy"` (TGI takes any name):
    the served model answers, as it answers /v1/chat/completions."""
    prompt = tokenizer().encode(rendered(CHAT), add_special_tokens=False).ids
    ids, _ = greedy(llama, prompt, 6)
    out = client.chat_completion(CHAT, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert out.choices[0].message.content == tokenizer().decode(ids)
    assert out.usage.prompt_tokens == len(prompt)
    chunks = list(client.chat_completion(CHAT, max_tokens=6, temperature=0, stream=True,
                                         extra_body=NO_EOS))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == tokenizer().decode(ids)
