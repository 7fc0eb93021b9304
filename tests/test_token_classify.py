"""Token classification on Optimum's token-classification export of a BERT tagger (models/
classifier.py: labels O, B-PER, I-PER, B-LOC, I-LOC; WordPiece, so words split into "##"
pieces and unknown characters into [UNK]) made an artifact by `tuner optimize`: the entities
huggingface_hub's InferenceClient.token_classification gets from `POST /` equal transformers'
own pipeline on the same weights under every aggregation strategy; a masked LM's fills
(InferenceClient.fill_mask) equal the fill-mask pipeline's; and neither the tagger's nor the
masked LM's `logits` are served as embeddings."""

from __future__ import annotations

import pytest
import requests
from llm_support import optimized_encoder, start

from models.classifier import ENTITIES, cached

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


@pytest.mark.filterwarnings("ignore:Tokenizer does not support real words")  # the reference's
def test_a_deberta_tagger_with_a_unigram_tokenizer(client, tmp_path) -> None:
    """DeBERTa-v3's kind of tokenizer (no subword prefix: words told apart by spaces; unknown
    characters as [UNK], whose entity shows the text they stand for)."""
    from transformers import pipeline

    folder = cached("deberta-token-classification")
    reference = pipeline("token-classification", model=str(folder), device="cpu")
    text = "Foxes live in forests near Paris, qq!"
    assert reference.tokenizer.unk_token_id in reference.tokenizer(text)["input_ids"]
    out = optimized_encoder(folder / "model.onnx", tmp_path / "out")
    s = start(out)
    try:
        client.model = f"http://127.0.0.1:{s.http_port}"
        for strategy in ("none", "simple", "first", "average", "max"):
            _same(client.token_classification(text, aggregation_strategy=strategy),
                  reference(text, aggregation_strategy=strategy))
    finally:
        s.stop(5)


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
    info = requests.get(f"http://127.0.0.1:{server.http_port}/info", timeout=60).json()
    assert info["model_type"] == {"token_classifier": {  # TEI's shape, a kind of its own
        "id2label": {str(i): name for i, name in enumerate(ENTITIES)},
        "label2id": {name: i for i, name in enumerate(ENTITIES)}}}
    assert info["max_input_length"] == 128


@pytest.fixture(scope="module")
def masked_lm(tmp_path_factory):
    out = optimized_encoder(cached("fill-mask") / "model.onnx",
                            tmp_path_factory.mktemp("mlm") / "out")
    s = start(out)
    yield s
    s.stop(5)


def test_a_masked_lm_is_not_an_embedding_model(masked_lm) -> None:
    """Its logits (batch, sequence, vocabulary) were pooled into a 'sentence embedding'."""
    r = requests.post(f"http://127.0.0.1:{masked_lm.http_port}/embed", json={"inputs": TEXT},
                      timeout=60)
    assert r.status_code == 422 and "no output of token embeddings" in r.json()["error"]
    info = requests.get(f"http://127.0.0.1:{masked_lm.http_port}/info", timeout=60).json()
    assert info["model_type"] == {"masked_lm": {"mask_token": "[MASK]"}}  # a kind of its own


@pytest.mark.parametrize("text, options", [
    ("The [MASK] sleeps all day.", {}),
    ("The [MASK] sleeps all day.", {"top_k": 2, "targets": ["dog", "fox", "cats"]}),
    ("A [MASK] fox jumps over the [MASK] dog.", {"top_k": 3}),  # a list per mask
])
def test_fill_mask_equals_transformers_pipeline(masked_lm, monkeypatch, text, options) -> None:
    from huggingface_hub import InferenceClient, constants
    from transformers import pipeline

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    want = pipeline("fill-mask", model=str(cached("fill-mask")), device="cpu")(text, **options)
    if "targets" not in options and text.count("[MASK]") == 1:  # the real client's own call
        client = InferenceClient(model=f"http://127.0.0.1:{masked_lm.http_port}", timeout=60)
        got = [dict(x) for x in client.fill_mask(text, **options)]
    else:
        got = requests.post(f"http://127.0.0.1:{masked_lm.http_port}/", timeout=60, json={
            "inputs": text, "parameters": options}).json()
    def per_mask(fills: list) -> list[list[dict]]:  # one mask: a flat list
        return fills if isinstance(fills[0], list) else [fills]

    for g_row, w_row in zip(per_mask(got), per_mask(want), strict=True):
        for g, w in zip(g_row, w_row, strict=True):
            assert (g["token"], g["token_str"], g["sequence"]) == \
                (w["token"], w["token_str"], w["sequence"])
            assert g["score"] == pytest.approx(w["score"], abs=1e-4)


def test_inspect_calls_a_masked_lm_an_encoder(capsys) -> None:
    """Its vocabulary head reads a transform of its own (dense, activation, norm); a decoder
    without a cache (GPT-2's, tests/test_inspect.py) stays a decoder."""
    from tuner.cli import main
    from tuner.graph.inspect import inspect_path

    path = cached("fill-mask") / "model.onnx"
    shape = inspect_path(path)
    assert shape.kind == "encoder" and shape.vocab_size and shape.sites.tied
    assert main(["inspect", str(path)]) == 0
    assert "encoder transformer with a masked LM's head" in capsys.readouterr().out


def test_fill_mask_refuses_a_text_without_the_mask(masked_lm) -> None:
    r = requests.post(f"http://127.0.0.1:{masked_lm.http_port}/", timeout=60,
                      json={"inputs": TEXT, "parameters": {}})
    assert r.status_code == 422 and "holds no mask token ([MASK])" in r.json()["error"]
