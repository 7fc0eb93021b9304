"""Sparse (SPLADE) embeddings: a masked LM's repository as sentence-transformers' SparseEncoder
saves it (models/classifier.splade_repo: modules.json naming SpladePooling, Optimum's export
under onnx/), made an artifact by `tuner optimize` and served on Text Embeddings Inference's
`/embed_sparse` (and `POST /`, `/info`, as TEI serves a model run with `--pooling splade`):
the entries equal SparseEncoder's own `encode` of the repository; max_active_dims, prompts
and truncation as TEI reads them; the dense endpoints refused."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import requests
from llm_support import optimized_encoder, start

from models.classifier import splade_repo

TEXTS = ["A red fox jumps over the lazy dog.", "Cats chase mice at night."]
LONG = "mice " * 200  # past the model's 128 tokens


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return optimized_encoder(splade_repo() / "onnx" / "model.onnx",
                             tmp_path_factory.mktemp("splade") / "out")


@pytest.fixture(scope="module")
def server(artifact):
    s = start(artifact)
    yield s
    s.stop(5)


def _reference(texts: list[str], **options) -> list[np.ndarray]:
    from sentence_transformers import SparseEncoder

    model = SparseEncoder(str(splade_repo()), device="cpu", **options)
    return [v.to_dense().numpy() for v in model.encode(texts, convert_to_tensor=True)]


def _dense(entries: list[dict], size: int) -> np.ndarray:
    vector = np.zeros(size, np.float32)
    for e in entries:
        vector[e["index"]] = e["value"]
    return vector


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=60)


def test_embed_sparse_equals_sparse_encoder(server) -> None:
    want = _reference(TEXTS)
    got = _post(server, "/embed_sparse", {"inputs": TEXTS}).json()
    for entries, vector in zip(got, want, strict=True):
        assert [e["index"] for e in entries] == np.flatnonzero(vector).tolist()
        assert _dense(entries, len(vector)) == pytest.approx(vector, abs=1e-4)
    # TEI's POST / for a SPLADE model is embed_sparse; /info names the pooling
    assert _post(server, "/", {"inputs": TEXTS[0]}).json() == got[:1]
    info = requests.get(f"http://127.0.0.1:{server.http_port}/info", timeout=10).json()
    assert info["model_type"] == {"embedding": {"pooling": "splade"}}
    from serving.http.hf_routes import text_apis  # what `tuner serve` says when ready

    assert text_apis(server.slot.engine) == "a SPLADE model: TEI's /embed_sparse"


def test_truncation_and_the_dense_endpoints(server) -> None:
    assert _post(server, "/embed_sparse", {"inputs": LONG}).status_code == 200
    r = _post(server, "/embed_sparse", {"inputs": LONG, "truncate": False})
    assert r.status_code == 413 and "must have less than" in r.json()["error"]
    r = _post(server, "/embed", {"inputs": TEXTS[0]})
    assert r.status_code == 422 and "POST /embed_sparse" in r.json()["error"]


def test_max_active_dims_and_a_prompt(artifact, tmp_path) -> None:
    out = tmp_path / "top"
    shutil.copytree(artifact, out)
    config = json.loads((out / "config_sentence_transformers.json").read_text())
    (out / "config_sentence_transformers.json").write_text(json.dumps(
        {**config, "max_active_dims": 8, "prompts": {"query": "Where do foxes live? "}}))
    s = start(out)
    try:
        got = _post(s, "/embed_sparse", {"inputs": [TEXTS[0]], "prompt_name": "query"}).json()
        bad = _post(s, "/embed_sparse", {"inputs": [TEXTS[0]], "prompt_name": "passage"})
    finally:
        s.stop(5)
    [want] = _reference(["Where do foxes live? " + TEXTS[0]], max_active_dims=8)
    assert len(got[0]) == 8
    assert _dense(got[0], len(want)) == pytest.approx(want, abs=1e-4)
    assert bad.status_code == 413 and "'prompt_name' 'passage'" in bad.json()["error"]


def test_a_model_without_splade_pooling_gives_no_sparse_vectors(tmp_path) -> None:
    from models.classifier import cached

    out = optimized_encoder(cached() / "model.onnx", tmp_path / "out")  # a classifier
    s = start(out)
    try:
        r = _post(s, "/embed_sparse", {"inputs": TEXTS[0]})
    finally:
        s.stop(5)
    assert r.status_code == 422 and "gives no sparse embeddings" in r.json()["error"]
