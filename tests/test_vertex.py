"""Google Vertex AI's custom-container contract (serving/http/vertex.py), with the bodies that
TGI's and TEI's Vertex AI images take: `{"instances": [...]}` answered `{"predictions":
[...]}`, a decoder's instances TGI's generate bodies or chat bodies (the model's own greedy
text when asked for greedy), an encoder's the bodies of TEI's `POST /` (each prediction that
body's answer); the first refusal answers the call in its API's shape; the predict and
health paths Vertex AI names in AIP_PREDICT_ROUTE and AIP_HEALTH_ROUTE."""

from __future__ import annotations

import pytest
import requests
from llm_support import (CHAT, NO_EOS, PROMPT, decoder, decoder_artifact, greedy,  # noqa: F401
                         llama, rendered_ids, start, tokenizer)

from serving.http.vertex import routes

NEW = 8


def _post(port: int, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=60)


def _greedy_text(llama, ids: list[int]) -> str:
    return tokenizer().decode(greedy(llama, ids, NEW)[0])


def test_generate_and_chat_instances_give_their_texts(decoder, llama) -> None:
    generate = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "do_sample": False,
                                                 **NO_EOS}}
    chat = {"messages": CHAT, "max_tokens": NEW, "temperature": 0, **NO_EOS}
    sampled = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, "seed": 7, **NO_EOS}}
    r = _post(decoder.http_port, "/vertex", {"instances": [generate, chat, sampled]})
    assert r.status_code == 200, r.text
    got = r.json()["predictions"]
    assert got[:2] == [_greedy_text(llama, tokenizer().encode(PROMPT).ids),
                       _greedy_text(llama, rendered_ids(CHAT))]
    # TGI's Vertex route samples unless told not to: the same seed, the same text
    again = _post(decoder.http_port, "/vertex", {"instances": [sampled]}).json()
    assert isinstance(got[2], str) and again["predictions"] == [got[2]] and got[2] != got[0]


@pytest.mark.parametrize("body, says", [
    ({"instances": []}, "'instances' must be a non-empty list"),
    ({"inputs": PROMPT}, "'instances' must be a non-empty list"),
    ({"instances": [{"inputs": PROMPT}] * 2049}, "at most 2048"),
    ({"instances": [{"inputs": PROMPT, "stream": True}]}, "answered whole"),
    ({"instances": [{"inputs": PROMPT}, {"inputs": PROMPT, "parameters": {
        "temperature": -1}}]}, "temperature"),
])
def test_a_refusal_answers_the_call_in_tgis_shape(decoder, body, says) -> None:
    r = _post(decoder.http_port, "/vertex", body)
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert says in r.json()["error"]


def test_the_routes_vertex_ai_names(llama, tmp_path, monkeypatch) -> None:
    predict = "/v1/endpoints/1234/deployedModels/5678:predict"  # Vertex AI's own default form
    monkeypatch.setenv("AIP_PREDICT_ROUTE", predict)
    monkeypatch.setenv("AIP_HEALTH_ROUTE", "/v1/endpoints/1234/deployedModels/5678")
    s = start(decoder_artifact(tmp_path, llama), generate={"max_tokens": 64})
    try:
        health = requests.get(f"http://127.0.0.1:{s.http_port}/v1/endpoints/1234/"
                              "deployedModels/5678", timeout=10)
        body = {"instances": [{"inputs": PROMPT, "parameters": {
            "max_new_tokens": NEW, "do_sample": False, **NO_EOS}}]}
        r = _post(s.http_port, predict, body)
    finally:
        s.stop(5)
    assert health.status_code == 200
    assert r.json() == {"predictions": [_greedy_text(llama, tokenizer().encode(PROMPT).ids)]}
    with pytest.raises(ValueError, match="AIP_PREDICT_ROUTE='predict' is not a route path"):
        routes({"AIP_PREDICT_ROUTE": "predict"})


def test_an_encoders_instances_are_teis_bodies(cross_encoder_artifact) -> None:
    s = start(cross_encoder_artifact)
    try:
        asked = [{"query": "Where do foxes live?", "texts": ["Foxes live in forests.",
                                                            "The dog sleeps all day."]},
                 {"query": "What sleeps?", "texts": ["A cat.", "The dog sleeps all day."],
                  "raw_scores": True}]
        got = _post(s.http_port, "/vertex", {"instances": asked})
        direct = [_post(s.http_port, "/rerank", body).json() for body in asked]
        too_long = {**asked[0], "texts": ["fox " * 2000], "truncate": False}
        refused = _post(s.http_port, "/vertex", {"instances": [asked[0], too_long]})
    finally:
        s.stop(5)
    assert got.status_code == 200 and got.json() == {"predictions": direct}
    assert refused.status_code == 413 and refused.json()["error_type"] == "Validation"
