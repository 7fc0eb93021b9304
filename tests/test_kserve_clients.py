"""KServe's own clients, unchanged, in an environment of their own (kserve pins a newer
starlette and pulls kubernetes and pandas): `InferenceRESTClient` in its default V1 protocol
(`/v1/models/{m}:predict`, `instances` and `inputs`) and in V2 (JSON and binary tensors),
`InferenceGRPCClient`, and LangChain's KServe provider (langchain-kserve: it probes
`/v1/models`, then chats over the OpenAI API or V2's `text_input`); and the OpenAI client
pointed at `/openai/v1`, where KServe's Hugging Face runtime serves that API. Each answer
is checked against ONNX Runtime run here (tensors), sentence-transformers' pooling (texts)
or a plain greedy loop (a decoder)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request

import numpy as np
import pytest
from llm_support import (CHAT, PROMPT, bert, decoder, encoder, greedy,  # noqa: F401
                         llama, openai_client, rendered_ids, start, tokenizer)
from serving_support import make_artifact

from models.venvs import ensure_venv

VENV = ("kserve-clients", ("kserve==0.21.0", "langchain-kserve==0.2.3"))
pytestmark = pytest.mark.venv(*VENV)  # built beside the first tests (conftest)

# KServe's clients as their users call them: asyncio, one client per protocol
TENSORS = """
import asyncio, json, sys
import numpy as np
from kserve import (InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest,
                    RESTConfig)
http, grpc_url, model, bodies = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])

def request(feeds, binary):
    inputs = []
    for name, rows in feeds.items():
        array = np.array(rows, dtype=np.int64)
        inputs.append(InferInput(name, list(array.shape), "INT64"))
        inputs[-1].set_data_from_numpy(array, binary_data=binary)
    return InferRequest(model_name=model, infer_inputs=inputs, request_id="r1")

def named(response):
    return {o.name: o.as_numpy().tolist() for o in response.outputs}

async def main():
    v1 = InferenceRESTClient(RESTConfig(protocol="v1"))
    v2 = InferenceRESTClient(RESTConfig(protocol="v2"))
    out = {"v1_live": await v1.is_server_live(http),
           "v1_ready": await v1.is_model_ready(http, model),
           "v2_ready": await v2.is_model_ready(http, model)}
    for key, body in bodies.items():
        out[key] = await v1.infer(http, body, model_name=model)
    feeds = bodies["instances"]["instances"][0]
    feeds = {k: [v] for k, v in feeds.items()}
    out["v2_json"] = named(await v2.infer(http, request(feeds, False), model_name=model))
    out["v2_binary"] = named(await v2.infer(http, request(feeds, True), model_name=model))
    grpc = InferenceGRPCClient(grpc_url)
    out["grpc_ready"] = await grpc.is_model_ready(model)
    out["grpc"] = named(await grpc.infer(request(feeds, True)))
    print(json.dumps(out))

asyncio.run(main())
"""

LANGCHAIN = """
import json, sys
from langchain_kserve import ChatKServe, KServeLLM
base, model, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
out = {}
for protocol in ("auto", "v2"):
    chat = ChatKServe(base_url=base, model_name=model, protocol=protocol, temperature=0.0,
                      max_tokens=8)
    llm = KServeLLM(base_url=base, model_name=model, protocol=protocol, temperature=0.0,
                    max_tokens=8)
    out[protocol] = {"chat": chat.invoke([("system", "You are terse."), ("user", "Name a fox.")]
                                         ).content,
                     "chat_stream": [c.content for c in chat.stream([("user", "Name a fox.")])],
                     "llm": llm.invoke(prompt), "llm_stream": list(llm.stream(prompt))}
print(json.dumps(out))
"""


def _client(script: str, *args: str) -> dict:
    python = ensure_venv(*VENV)
    r = subprocess.run([str(python), "-P", "-c", script, *args], capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])



def _reference(model, feeds: dict[str, list]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    arrays = {k: np.array(v, np.int64) for k, v in feeds.items()}
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, arrays)))


def _example(length: int, seed: int) -> dict[str, list]:
    ids = np.random.default_rng(seed).integers(5, 1000, length).tolist()
    return {"input_ids": ids, "attention_mask": [1] * length}


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}",
                                     json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_kserve_clients_v1_v2_and_grpc_equal_onnx_runtime(encoder, bert) -> None:
    """V1's examples of different lengths each run alone (no padding: each equals ONNX
    Runtime at batch 1); V1's columnar batch, V2 over REST (JSON and binary) and over gRPC
    each equal ONNX Runtime on the same tensors."""
    examples = [_example(7, 0), _example(12, 1), _example(3, 2)]
    batch = {k: [e[k] for e in [_example(9, 3), _example(9, 4)]] for k in examples[0]}
    got = _client(TENSORS, f"http://127.0.0.1:{encoder.http_port}", f"127.0.0.1:{encoder.port}",
                  encoder.slot.name, json.dumps({"instances": {"instances": examples},
                                                 "columns": {"inputs": batch}}))
    assert got["v1_live"] and got["v1_ready"] and got["v2_ready"] and got["grpc_ready"]
    predictions = got["instances"]["predictions"]
    assert len(predictions) == len(examples)
    for example, prediction in zip(examples, predictions):
        (want,) = _reference(bert, {k: [v] for k, v in example.items()}).values()
        # the model's one output: the prediction itself (more would be a dict by name)
        assert np.shape(prediction) == want.shape[1:]
        np.testing.assert_allclose(prediction, want[0], atol=1e-4)
    (want,) = _reference(bert, batch).values()
    np.testing.assert_allclose(got["columns"]["outputs"], want, atol=1e-4)
    first = _reference(bert, {k: [v] for k, v in examples[0].items()})
    for key in ("v2_json", "v2_binary", "grpc"):
        assert set(got[key]) == set(first), key
        for name, array in first.items():
            np.testing.assert_allclose(got[key][name], array, atol=1e-4)


def test_v1_bad_bodies_are_400_naming_the_fault(encoder) -> None:
    ragged = {"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]}
    for body, words in (({"inputs": ragged}, "rows differ in length"),
                        ({"instances": [{"input_ids": [1.5, 2]}]}, "must be ints"),
                        ({"instances": [{"pixel_values": [1]}]}, "unexpected inference input"),
                        ({"instances": [[1, 2, 3]]}, "send each example as an object"),
                        ({"instances": []}, "'instances' must be a list"),
                        ({"examples": [1]}, "'instances'")):
        status, answer = _post(encoder, f"/v1/models/{encoder.slot.name}:predict", body)
        assert status == 400 and words in answer["error"], (body, answer)
    status, answer = _post(encoder, "/v1/models/nope:predict", {"instances": [{}]})
    assert status == 404, answer


def test_v1_texts_on_an_encoder_are_its_embeddings(tmp_path) -> None:
    """An encoder with a tokenizer takes texts as V1 examples, as KServe's Hugging Face runtime
    does for an embedding model: each the vector `/v1/embeddings` answers (their own test
    compares those with sentence-transformers)."""
    from test_embeddings import TEXTS, _package_dir

    from models.build import cached
    from tuner.artifact.records import Buckets
    from tuner.jobs.optimize import _copy_text_files

    out = make_artifact(tmp_path / "out", cached("minilm", "real", "torchscript"),
                        Buckets(batch=(1, 2), seq=(16, 64)))
    _copy_text_files(_package_dir(), out)
    s = start(out)
    try:
        texts = TEXTS[:3]
        status, v1 = _post(s, f"/v1/models/{s.slot.name}:predict", {"instances": texts})
        assert status == 200, v1
        want = openai_client(s).embeddings.create(model=s.slot.name, input=texts,
                                                  encoding_format="float")
        np.testing.assert_allclose(v1["predictions"], [d.embedding for d in want.data],
                                   atol=1e-6)
        status, columns = _post(s, f"/v1/models/{s.slot.name}:predict", {"inputs": texts})
        assert status == 200 and np.allclose(columns["outputs"], v1["predictions"], atol=1e-6)
    finally:
        s.stop(5)


def _greedy_text(llama, ids: list[int], n: int) -> str:
    return tokenizer().decode(greedy(llama, ids, n)[0])


def test_langchain_kserve_chats_over_openai_and_v2(decoder, llama) -> None:  # noqa: F811
    """LangChain's KServe provider finds the OpenAI API by its probe of /v1/models, and in
    V2 mode sends `text_input` with `max_tokens` among the request's parameters: both greedy
    (temperature 0), whole and streamed."""
    got = _client(LANGCHAIN, f"http://127.0.0.1:{decoder.http_port}", decoder.slot.name, PROMPT)
    plain = _greedy_text(llama, tokenizer().encode(PROMPT).ids, 8)
    chat = _greedy_text(llama, rendered_ids(CHAT), 8)
    auto = got["auto"]
    assert auto["chat"] == chat and auto["llm"] == plain
    assert "".join(auto["llm_stream"]) == plain and len(auto["llm_stream"]) > 1
    assert "".join(got["v2"]["llm_stream"]) == plain and got["v2"]["llm"] == plain
    assert got["v2"]["chat"] and "".join(got["v2"]["chat_stream"])  # its own prompt format


def test_openai_client_under_kserves_prefix(decoder, llama) -> None:  # noqa: F811
    """`OpenAI(base_url=host + "/openai/v1")`, as KServe's documentation sets it up: the same
    API as /v1, streamed and whole; and V1 predict on a decoder says where it generates."""
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{decoder.http_port}/openai/v1", api_key="x")
    assert [m.id for m in c.models.list().data] == [decoder.slot.name]
    assert c.models.retrieve(decoder.slot.name).id == decoder.slot.name
    want = _greedy_text(llama, rendered_ids(CHAT), 6)
    whole = c.chat.completions.create(model=decoder.slot.name, messages=CHAT, max_tokens=6,
                                      temperature=0)
    assert whole.choices[0].message.content == want
    stream = c.chat.completions.create(model=decoder.slot.name, messages=CHAT, max_tokens=6,
                                       temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want
    status, answer = _post(decoder, f"/v1/models/{decoder.slot.name}:predict",
                           {"instances": [PROMPT]})
    assert status == 400 and "/v1/completions" in answer["error"]
