"""Sequence classification on an Optimum text-classification export (models/classifier.py: a
BERT with three labels, its tokenizer's pair template) that `tuner optimize` made an artifact
of, served as classifier servers serve it and checked against transformers' pipeline on the
same weights: Text Embeddings Inference's `/predict` (a text, a pair, a batch, raw scores,
truncation) and `/info`, huggingface_hub's InferenceClient.text_classification (the real
client, on `POST /`), vLLM's `/classify`, SageMaker's `/invocations`, a multi-label config's
sigmoid, the errors of each API; and Triton's classification extension (tritonclient's
`InferRequestedOutput(name, class_count=k)`, over gRPC and HTTP): each row's k largest logits
as "value:index:label", highest first."""

from __future__ import annotations

import json
import shutil

import pytest
import requests
from llm_support import optimized_encoder, start

from models.classifier import LABELS, cached

TEXTS = ["A red fox jumps over the lazy dog.", "Cats chase mice at night."]
PAIR = ("Where do foxes live?", "Foxes live in forests and eat mice.")
LONG = "mice " * 200  # past the model's 128 tokens


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return optimized_encoder(cached() / "model.onnx",
                             tmp_path_factory.mktemp("classifier") / "out")


@pytest.fixture(scope="module")
def server(artifact):
    s = start(artifact)
    yield s
    s.stop(5)


def _pipeline(inputs, **options) -> list:
    """transformers' own text-classification pipeline on the weights the export came from:
    a list of [{label, score}] per input, highest first."""
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(cached()), device="cpu")
    got = classify(inputs, top_k=None, **options)
    return [got] if isinstance(got[0], dict) else got


def _same(got: list[dict], want: list[dict]) -> None:
    assert [x["label"] for x in got] == [x["label"] for x in want]
    assert [x["score"] for x in got] == pytest.approx([x["score"] for x in want], abs=1e-4)


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=60)


def test_the_reference_scores_differ_clearly() -> None:
    """The labels' order is a real check only when the scores are far apart."""
    for row in _pipeline(TEXTS):
        assert row[0]["score"] - row[1]["score"] > 0.05


def test_tei_predict_a_text_a_pair_and_a_batch(server) -> None:
    _same(_post(server, "/predict", {"inputs": TEXTS[0]}).json(), _pipeline(TEXTS[0])[0])
    pair = _pipeline({"text": PAIR[0], "text_pair": PAIR[1]})[0]
    _same(_post(server, "/predict", {"inputs": list(PAIR)}).json(), pair)  # [a, b]: a pair
    batch = _post(server, "/predict", {"inputs": [[TEXTS[0]], list(PAIR), [TEXTS[1]]]}).json()
    want = _pipeline(TEXTS)
    for got, expected in zip(batch, [want[0], pair, want[1]], strict=True):
        _same(got, expected)
    # POST / is /predict for a classifier (TEI's route), SageMaker's /invocations too
    assert _post(server, "/", {"inputs": TEXTS[0]}).json() == \
        _post(server, "/predict", {"inputs": TEXTS[0]}).json()
    _same(_post(server, "/invocations", {"inputs": TEXTS[1]}).json(), want[1])
    vllm = _post(server, "/invocations", {"input": [TEXTS[1]]}).json()  # vLLM's classify
    assert vllm["data"][0]["label"] == want[1][0]["label"]


def test_tei_raw_scores_truncation_and_info(server) -> None:
    raw = _post(server, "/predict", {"inputs": TEXTS[0], "raw_scores": True}).json()
    _same(raw, _pipeline(TEXTS[0], function_to_apply="none")[0])
    cut = _post(server, "/predict", {"inputs": LONG})  # cut to the model's length by default
    assert cut.status_code == 200
    r = _post(server, "/predict", {"inputs": LONG, "truncate": False})
    assert r.status_code == 413 and r.json()["error_type"] == "Validation"  # TEI's status
    assert r.json()["error"].startswith("`inputs` must have less than 128 tokens. Given: ")
    info = requests.get(f"http://127.0.0.1:{server.http_port}/info", timeout=10).json()
    assert info["model_type"] == {"classifier": {
        "id2label": {str(i): n for i, n in enumerate(LABELS)},
        "label2id": {n: i for i, n in enumerate(LABELS)}}}
    assert info["max_input_length"] == 128
    from serving.http.hf_routes import text_apis  # what `tuner serve` says when ready

    assert text_apis(server.slot.engine).startswith(
        "a classifier of 3 labels (contradiction, neutral, entailment): TEI's /predict")


def test_huggingface_hubs_inference_client(server, monkeypatch) -> None:
    from huggingface_hub import InferenceClient, constants

    # the suite runs in Hugging Face's offline mode, which also stops the client reaching a
    # local server: a user's own client runs online
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(model=f"http://127.0.0.1:{server.http_port}", timeout=60)
    got = client.text_classification(TEXTS[0])
    _same([{"label": x.label, "score": x.score} for x in got], _pipeline(TEXTS[0])[0])
    top = client.text_classification(TEXTS[1], top_k=1, function_to_apply="sigmoid")
    want = _pipeline(TEXTS[1], function_to_apply="sigmoid")[0][:1]
    _same([{"label": x.label, "score": x.score} for x in top], want)


def test_zero_shot_classification_through_the_inference_client(server, monkeypatch) -> None:
    """The NLI labels make the classifier a zero-shot one: each candidate label's hypothesis
    paired with the text, scored as transformers' zero-shot pipeline scores it."""
    from huggingface_hub import InferenceClient, constants
    from transformers import pipeline

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    client = InferenceClient(model=f"http://127.0.0.1:{server.http_port}", timeout=60)
    reference = pipeline("zero-shot-classification", model=str(cached()), device="cpu")
    labels = ["foxes", "dogs", "cats at night"]
    for options in ({}, {"multi_label": True},
                    {"hypothesis_template": "This is about {}.", "multi_label": False}):
        got = client.zero_shot_classification(TEXTS[0], labels, **options)
        want = reference(TEXTS[0], labels, **options)
        assert [x.label for x in got] == want["labels"]
        assert [x.score for x in got] == pytest.approx(want["scores"], abs=1e-4)
    assert sum(x.score for x in client.zero_shot_classification(TEXTS[1], labels)) == \
        pytest.approx(1.0)  # one label true: a softmax over the labels


def test_vllms_classify(server) -> None:
    body = _post(server, "/classify", {"model": server.slot.name, "input": TEXTS}).json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(TEXTS)
    for row, want in zip(body["data"], _pipeline(TEXTS), strict=True):
        assert row["num_classes"] == 3 and row["label"] == want[0]["label"]
        by_label = {x["label"]: x["score"] for x in want}
        assert row["probs"] == pytest.approx([by_label[n] for n in LABELS], abs=1e-4)
    logits = _post(server, "/v1/classify", {"input": TEXTS[0], "use_activation": False}).json()
    by_label = {x["label"]: x["score"] for x in _pipeline(TEXTS[0], function_to_apply="none")[0]}
    assert logits["data"][0]["probs"] == pytest.approx([by_label[n] for n in LABELS], abs=1e-4)
    kept = _post(server, "/classify", {"input": LONG, "truncate_prompt_tokens": 5}).json()
    assert kept["usage"]["prompt_tokens"] == 5


def test_kserve_v1_texts_get_the_best_label_id(server) -> None:
    """What KServe's Hugging Face runtime answers a sequence classifier's texts."""
    want = [LABELS.index(row[0]["label"]) for row in _pipeline(TEXTS)]
    path = f"/v1/models/{server.slot.name}:predict"
    assert _post(server, path, {"instances": TEXTS}).json() == {"predictions": want}
    assert _post(server, path, {"inputs": TEXTS}).json() == {"outputs": want}


@pytest.mark.parametrize("path, body, status, says", [
    ("/predict", {"inputs": ["a", "b", "c"]}, 422, "a pair \\[string, string\\]"),
    ("/predict", {"inputs": ""}, 400, "'inputs' cannot be empty"),
    ("/classify", {"input": []}, 400, "'input' must be a non-empty string"),
    ("/classify", {"input": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/classify", {"input": "a", "model": "other"}, 404, "other"),
    ("/", {"inputs": "a", "parameters": {"function_to_apply": "tanh"}}, 422,
     "'function_to_apply' must be one of"),
    ("/v1/rerank", {"query": "a", "documents": ["b"]}, 400, "is not a reranker"),
    ("/", {"inputs": "a", "parameters": {"candidate_labels": []}}, 422, "candidate_labels"),
    ("/", {"inputs": "a", "parameters": {"candidate_labels": ["x"],
                                         "hypothesis_template": "no slot"}}, 422, "with a \\{\\}"),
    ("/v1/embeddings", {"input": "a"}, 400, "it is a classifier: its scores come from"),
])
def test_bad_requests_name_the_fault(server, path, body, status, says) -> None:
    import re

    r = _post(server, path, body)
    error = r.json()["error"]
    assert r.status_code == status, r.text
    assert re.search(says, error if isinstance(error, str) else error["message"])


def test_a_multi_label_config_scores_each_label_by_sigmoid(artifact, tmp_path) -> None:
    out = tmp_path / "multi"
    shutil.copytree(artifact, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config,
                                                 "problem_type": "multi_label_classification"}))
    s = start(out)
    try:
        got = _post(s, "/predict", {"inputs": TEXTS[0]}).json()
    finally:
        s.stop(5)
    _same(got, _pipeline(TEXTS[0], function_to_apply="sigmoid")[0])
    assert sum(x["score"] for x in got) != pytest.approx(1.0, abs=1e-2)  # not a softmax


def _feeds(module, texts: list[str]) -> list:
    """tritonclient's inputs for `texts` (one row each, as long as each other)."""
    import numpy as np
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(cached() / "tokenizer.json"))
    ids = np.array([tokenizer.encode(t).ids for t in texts], np.int64)
    inputs = []
    for name, value in (("input_ids", ids), ("attention_mask", np.ones_like(ids)),
                        ("token_type_ids", np.zeros_like(ids))):
        tensor = module.InferInput(name, list(value.shape), "INT64")
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return inputs


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritons_classification_extension(server, protocol) -> None:
    import importlib

    module = importlib.import_module(f"tritonclient.{protocol}")
    port = server.port if protocol == "grpc" else server.http_port
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    assert "classification" in client.get_server_metadata(**(
        {"as_json": True} if protocol == "grpc" else {}))["extensions"]
    texts = ["A red fox jumps over the lazy dog.", "The dog sleeps all day, lazy dog."]
    feeds = _feeds(module, texts)
    logits = client.infer(server.slot.name, feeds).as_numpy("logits")
    got = client.infer(server.slot.name, feeds, outputs=[
        module.InferRequestedOutput("logits", class_count=2)]).as_numpy("logits")
    assert got.shape == (2, 2)
    for row, classes in zip(logits, got, strict=True):
        top = sorted(range(3), key=lambda i: -row[i])[:2]
        assert [c.decode() for c in classes] == [f"{row[i]:f}:{i}:{LABELS[i]}" for i in top]
    want = _pipeline(texts, function_to_apply="none")
    assert [c.decode().split(":")[2] for c in got[:, 0]] == [w[0]["label"] for w in want]


def test_classification_of_an_unordered_type_is_refused() -> None:
    import numpy as np

    from serving.classify import top_classes
    from serving.errors import InvalidArgument

    assert top_classes(np.array([[1, 3, 2]], np.int32), 5, True).tolist() == \
        [[b"3:1", b"2:2", b"1:0"]]  # k past the elements: all of them
    with pytest.raises(InvalidArgument, match="unsupported type 'FP16'"):
        top_classes(np.zeros((1, 3), np.float16), 1, True)


def test_a_bad_class_count_is_refused(server) -> None:
    r = requests.post(f"http://127.0.0.1:{server.http_port}/v2/models/{server.slot.name}/infer",
                      timeout=60, json={
                          "inputs": [{"name": n, "shape": [1, 3], "datatype": "INT64",
                                      "data": [2, 9, 3] if n == "input_ids" else [1, 1, 1]}
                                     for n in ("input_ids", "attention_mask", "token_type_ids")],
                          "outputs": [{"name": "logits", "parameters": {"classification": 0}}]})
    assert r.status_code == 400 and "'classification' must be a positive integer" in \
        r.json()["error"]
