"""Token classification on Optimum's token-classification export of a BERT tagger (models/
classifier.py: labels O, B-PER, I-PER, B-LOC, I-LOC; WordPiece, so words split into "##"
pieces and unknown characters into [UNK]) made an artifact by `tuner optimize`: the entities
huggingface_hub's InferenceClient.token_classification gets from `POST /` equal transformers'
own pipeline on the same weights under every aggregation strategy; and neither the tagger's
nor a masked LM's `logits` are served as embeddings."""

from __future__ import annotations

import pytest
import requests
from llm_support import optimized_encoder, start

from models.classifier import cached

TEXT = "Foxes live in forests and the mice hide, near Paris at night."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = optimized_encoder(cached("token-classification") / "model.onnx",
                            tmp_path_factory.mktemp("tagger") / "out")
    s = start(out)
    yield s
    s.stop(5)


@pytest.fixture(scope="module")
def reference():
    from transformers import pipeline

    return pipeline("token-classification", model=str(cached("token-classification")),
                    device="cpu")


@pytest.fixture
def client(server, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    # the suite runs in Hugging Face's offline mode, which also stops the client reaching a
    # local server: a user's own client runs online
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return InferenceClient(model=f"http://127.0.0.1:{server.http_port}", timeout=60)


def _same(got: list, want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.entity_group or g.entity) == w.get("entity_group", w.get("entity"))
        assert (g.word, g.start, g.end) == (w["word"], w["start"], w["end"])
        assert g.score == pytest.approx(float(w["score"]), abs=1e-4)


def test_the_text_has_subwords_and_unknown_pieces(reference) -> None:
    tokens = reference.tokenizer.tokenize(TEXT)
    assert any(t.startswith("##") for t in tokens) and "[UNK]" in tokens


@pytest.mark.parametrize("strategy", ["none", "simple", "first", "average", "max"])
def test_entities_equal_transformers_pipeline(client, reference, strategy) -> None:
    want = reference(TEXT, aggregation_strategy=strategy)
    assert want  # the random tagger finds entities in this text
    _same(client.token_classification(TEXT, aggregation_strategy=strategy), want)


def test_no_strategy_is_the_pipelines_default_and_ignore_labels(client, reference) -> None:
    _same(client.token_classification(TEXT), reference(TEXT))
    fewer = reference(TEXT, ignore_labels=["O", "B-LOC"])
    got = client.token_classification(TEXT, ignore_labels=["O", "B-LOC"])
    _same(got, fewer)
    assert 0 < len(got) < len(reference(TEXT))


def test_kserve_v1_texts_get_each_tokens_best_label_id(server, reference) -> None:
    """What KServe's Hugging Face runtime answers a token classifier's texts (special
    tokens included)."""
    import torch

    encoded = reference.tokenizer([TEXT], return_tensors="pt")
    with torch.no_grad():
        want = reference.model(**encoded).logits.argmax(-1).tolist()
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/models/{server.slot.name}"
                      ":predict", json={"instances": [TEXT]}, timeout=60)
    assert r.json() == {"predictions": want}


@pytest.mark.parametrize("parameters, says", [
    ({"aggregation_strategy": "longest"}, "'aggregation_strategy' must be one of"),
    ({"stride": 16}, "'stride' .* is not served"),
    ({"ignore_labels": "O"}, "'ignore_labels' must be a list"),
])
def test_bad_parameters_are_refused(server, parameters, says) -> None:
    import re

    r = requests.post(f"http://127.0.0.1:{server.http_port}/", timeout=60,
                      json={"inputs": TEXT, "parameters": parameters})
    assert r.status_code == 422 and re.search(says, r.json()["error"])


def test_a_tagger_is_not_an_embedding_model(server) -> None:
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v1/embeddings", timeout=60,
                      json={"model": server.slot.name, "input": TEXT})
    assert r.status_code == 400
    assert "'logits' are a token classifier's or a masked LM's" in r.json()["error"]["message"]


def test_a_masked_lm_is_not_an_embedding_model(tmp_path) -> None:
    """Its logits (batch, sequence, vocabulary) were pooled into a 'sentence embedding'."""
    out = optimized_encoder(cached("fill-mask") / "model.onnx", tmp_path / "out")
    s = start(out)
    try:
        r = requests.post(f"http://127.0.0.1:{s.http_port}/embed", json={"inputs": TEXT},
                          timeout=60)
    finally:
        s.stop(5)
    assert r.status_code == 422 and "no output of token embeddings" in r.json()["error"]
