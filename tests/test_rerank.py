"""Reranking (`/rerank`, `/v1/rerank`, Cohere's `/v2/rerank`) on a cross-encoder that `tuner
optimize` made an artifact of (models/cross_encoder.py: a BERT classifier with one label,
its WordPiece tokenizer with BERT's pair template), equal to sentence-transformers'
CrossEncoder on the same folder: the scores, their order, `top_n`, `return_documents`, a
document past the model's length, and the config's Identity activation; and Text Embeddings
Inference's shape of `/rerank` (`texts`, `raw_scores`, `return_text`, `truncate`)."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import requests
from llm_support import start

from models.cross_encoder import cached

QUERY = "Where do foxes live?"
DOCUMENTS = ["Foxes live in forests and eat mice.", "The dog sleeps all day.",
             "A red fox jumps over the lazy dog.", "mice " * 200]  # the last past 128 tokens


@pytest.fixture(scope="module")
def artifact(cross_encoder_artifact):
    return cross_encoder_artifact


@pytest.fixture(scope="module")
def server(artifact):
    s = start(artifact)
    yield s
    s.stop(5)


def _reference(activation=None) -> list[float]:
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(cached()), device="cpu", activation_fn=activation)
    return [float(x) for x in model.predict([(QUERY, d) for d in DOCUMENTS])]


def _rerank(server, path: str = "/v1/rerank", **body) -> dict:
    r = requests.post(f"http://127.0.0.1:{server.http_port}{path}", timeout=60,
                      json={"model": server.slot.name, "query": QUERY, "documents": DOCUMENTS,
                            **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_scores_are_cross_encoders_own_highest_first(server) -> None:
    want = _reference()
    got = _rerank(server)
    assert [x["index"] for x in got["results"]] == sorted(range(4), key=lambda i: -want[i])
    for x in got["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        assert x["document"]["text"] == DOCUMENTS[x["index"]]
    assert got["usage"]["total_tokens"] > 128


def test_cohere_and_jina_shapes_top_n_and_no_documents(server) -> None:
    whole = _rerank(server)["results"]
    top = _rerank(server, "/v2/rerank", documents=[{"text": d} for d in DOCUMENTS], top_n=2,
                  return_documents=False)["results"]
    assert [x["index"] for x in top] == [x["index"] for x in whole[:2]]
    assert all("document" not in x for x in top)
    assert _rerank(server, "/rerank")["results"] == whole


def test_text_embeddings_inferences_shape(server) -> None:
    import torch

    url = f"http://127.0.0.1:{server.http_port}/rerank"
    body = {"query": QUERY, "texts": DOCUMENTS}  # cut to the model's length by default
    got = requests.post(url, json=body, timeout=60).json()  # TEI's clients name no model
    want = _reference()
    assert [x["index"] for x in got] == sorted(range(4), key=lambda i: -want[i])
    assert [x["score"] for x in got] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    assert all(set(x) == {"index", "score"} for x in got)
    raw = requests.post(url, json={**body, "raw_scores": True, "return_text": True},
                        timeout=60).json()
    logits = _reference(torch.nn.Identity())
    assert {x["index"]: x["score"] for x in raw} == pytest.approx(dict(enumerate(logits)),
                                                                  abs=1e-5)
    assert all(x["text"] == DOCUMENTS[x["index"]] for x in raw)
    # TEI refuses an input past the model's length when told not to truncate
    r = requests.post(url, json={**body, "truncate": False}, timeout=60)
    assert r.status_code == 413 and r.json()["error_type"] == "Validation"  # TEI's status
    assert re.fullmatch(r"`inputs` must have less than \d+ tokens. Given: \d+",
                        r.json()["error"])
    r = requests.post(url, json={**body, "texts": ["a"] * 2049}, timeout=60)  # /info's limit
    assert r.status_code == 413 and r.json()["error"] == ("batch size 2049 > maximum allowed "
                                                          "batch size 2048")


def test_the_identity_activation_gives_the_raw_logits(artifact, tmp_path) -> None:
    import torch

    out = tmp_path / "identity"
    shutil.copytree(artifact, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}}))
    s = start(out)
    try:
        got = {x["index"]: x["relevance_score"] for x in _rerank(s)["results"]}
    finally:
        s.stop(5)
    want = _reference(torch.nn.Identity())
    assert [got[i] for i in range(4)] == pytest.approx(want, abs=1e-5)
    assert [got[i] for i in range(4)] != pytest.approx(_reference(), abs=1e-3)  # not sigmoid


@pytest.mark.parametrize("body, says", [
    ({"documents": []}, "'documents' must be a non-empty list"),
    ({"documents": [1]}, "documents\\[0\\] must be a string"),
    ({"query": ""}, "'query' must be a non-empty string"),
    ({"top_n": 0}, "'top_n' must be a positive integer"),
    ({"model": "other"}, "unknown model: 'other'"),
])
def test_bad_requests_are_400(server, body, says) -> None:

    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/rerank", timeout=60,
                      json={"model": server.slot.name, "query": QUERY, "documents": DOCUMENTS,
                            **body})
    assert r.status_code in (400, 404) and re.search(says, r.json()["error"]["message"])


def test_an_embedding_model_is_not_a_reranker(tmp_path) -> None:
    from serving_support import make_artifact

    from models.build import cached as built

    out = make_artifact(tmp_path / "encoder", built("bert", "small"))
    shutil.copyfile(cached() / "tokenizer.json", out / "tokenizer.json")
    s = start(out)
    try:
        r = requests.post(f"http://127.0.0.1:{s.http_port}/v1/rerank", timeout=60,
                          json={"model": s.slot.name, "query": QUERY, "documents": DOCUMENTS})
    finally:
        s.stop(5)
    assert r.status_code == 400 and "is not a reranker" in r.json()["error"]["message"]


def test_the_cohere_client_reranks_unchanged(server) -> None:
    """Cohere's own client (v2: /v2/rerank; v1: /v1/rerank, as vLLM serves it), given the
    server's URL: the CrossEncoder's scores, highest first, top_n kept."""
    import cohere

    want = _reference()
    order = sorted(range(4), key=lambda i: -want[i])
    base = f"http://127.0.0.1:{server.http_port}"
    v2 = cohere.ClientV2(base_url=base, api_key="unused", timeout=60)
    got = v2.rerank(model=server.slot.name, query=QUERY, documents=DOCUMENTS, top_n=3)
    assert [r.index for r in got.results] == order[:3]
    assert [r.relevance_score for r in got.results] == pytest.approx(
        [want[i] for i in order[:3]], abs=1e-5)
    v1 = cohere.Client(base_url=base, api_key="unused", timeout=60)
    got = v1.rerank(model=server.slot.name, query=QUERY, documents=DOCUMENTS,
                    return_documents=True)
    assert [r.index for r in got.results] == order
    assert [r.document.text for r in got.results] == [DOCUMENTS[i] for i in order]


def test_info_is_teis_for_a_reranker(server) -> None:
    info = requests.get(f"http://127.0.0.1:{server.http_port}/info", timeout=30).json()
    assert info["model_type"] == {"reranker": {"id2label": {"0": "LABEL_0"},
                                               "label2id": {"LABEL_0": 0}}}
    assert info["max_input_length"] == 128 and info["auto_truncate"] is True


def test_vllms_score_api_pairs_and_scores_as_vllm(server) -> None:
    """vLLM's /score (and /v1/score): one text_1 against each text_2, or pairs in order; the
    CrossEncoder's scores, the logits with use_activation false."""
    import torch

    url = f"http://127.0.0.1:{server.http_port}"
    want, logits = _reference(), _reference(torch.nn.Identity())
    got = requests.post(f"{url}/score", json={"model": server.slot.name, "text_1": QUERY,
                                              "text_2": DOCUMENTS}, timeout=60).json()
    assert got["object"] == "list" and got["usage"]["prompt_tokens"] > 128
    assert [d["index"] for d in got["data"]] == [0, 1, 2, 3]
    assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-5)
    paired = requests.post(f"{url}/v1/score", json={
        "text_1": [QUERY, QUERY], "text_2": DOCUMENTS[2:], "use_activation": False},
        timeout=60).json()
    assert [d["score"] for d in paired["data"]] == pytest.approx(logits[2:], abs=1e-5)
    r = requests.post(f"{url}/score", json={"text_1": [QUERY] * 2, "text_2": DOCUMENTS},
                      timeout=60)
    assert r.status_code == 400 and "as long as each other" in r.json()["error"]["message"]
