"""KServe v2 over HTTP/REST and Triton's generate extension, driven by the real
tritonclient.http and by curl: health, metadata, configuration, infer with JSON tensors and
the binary-data extension (equal to ONNX Runtime run in-process), errors with their
statuses, the bearer token and TLS on the HTTP port, generate / generate_stream (SSE), a
client that disconnects freeing its slot, and the metrics per endpoint."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import urllib.request

import numpy as np
import pytest
import tritonclient.http as th
from llm_support import (PROMPT, bert, decoder, encoder, greedy, llama,  # noqa: F401
                         start, tokenizer, wait_for)
from serving_support import feeds_for, make_artifact
from tritonclient.utils import InferenceServerException

TOKEN = "s3cret-token"




def _client(server) -> th.InferenceServerClient:
    return th.InferenceServerClient(f"127.0.0.1:{server.http_port}")


def _reference(model, feeds):
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def _inputs(feeds, binary: bool) -> list:
    made = []
    for name, array in feeds.items():
        made.append(th.InferInput(name, list(array.shape), "INT64"))
        made[-1].set_data_from_numpy(array, binary_data=binary)
    return made


def _curl(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    return subprocess.run(["curl", "-s", "--max-time", "60", *args], capture_output=True,
                          timeout=90)


# ------------------------------------------------------------------------------ KServe v2


def test_health_metadata_and_config(encoder) -> None:
    c = _client(encoder)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready(encoder.slot.name) and not c.is_model_ready("nope")
    assert "binary_tensor_data" in c.get_server_metadata()["extensions"]
    meta = c.get_model_metadata(encoder.slot.name)
    assert {i["name"] for i in meta["inputs"]} == {"input_ids", "attention_mask"}
    assert all(isinstance(d, int) for i in meta["inputs"] for d in i["shape"])
    config = c.get_model_config(encoder.slot.name)
    assert config["max_batch_size"] >= 1 and config["input"][0]["dims"] == [-1]
    assert c.get_model_metadata(encoder.slot.name, "1")["name"] == encoder.slot.name


@pytest.mark.parametrize("binary_in,binary_out", [(True, True), (False, False), (True, False)])
def test_infer_equals_onnx_runtime_in_process(encoder, bert, binary_in, binary_out) -> None:
    feeds = feeds_for(12, rows=2, seed=3)
    outputs = [th.InferRequestedOutput(n, binary_data=binary_out)
               for n in ("last_hidden_state",)]
    got = _client(encoder).infer(encoder.slot.name, _inputs(feeds, binary_in), outputs=outputs,
                                 request_id="r-9")
    assert got.get_response()["id"] == "r-9"
    want = _reference(bert, feeds)["last_hidden_state"]
    np.testing.assert_allclose(got.as_numpy("last_hidden_state"), want, atol=1e-4, rtol=1e-4)


def test_infer_with_curl_json(encoder, bert) -> None:
    feeds = feeds_for(8, seed=5)
    body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "INT64",
                        "data": a.reshape(-1).tolist()} for n, a in feeds.items()]}
    r = _curl("-X", "POST", "-H", "Content-Type: application/json", "-d", json.dumps(body),
              f"http://127.0.0.1:{encoder.http_port}/v2/models/{encoder.slot.name}/infer")
    out = {o["name"]: o for o in json.loads(r.stdout)["outputs"]}
    got = np.array(out["last_hidden_state"]["data"], np.float32).reshape(
        out["last_hidden_state"]["shape"])
    np.testing.assert_allclose(got, _reference(bert, feeds)["last_hidden_state"], atol=1e-4)


def _post(server, path: str, body: bytes, headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", path, body, headers or {})
    r = conn.getresponse()
    return r.status, r.read(), dict(r.getheaders())


def test_errors_answer_with_their_status_and_reason(encoder) -> None:
    name = encoder.slot.name
    with pytest.raises(InferenceServerException, match="unknown model: 'nope'"):
        _client(encoder).infer("nope", _inputs(feeds_for(8), True))
    status, body, _ = _post(encoder, f"/v2/models/{name}/infer", b"{not json")
    assert status == 400 and "not JSON" in json.loads(body)["error"]
    head = json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 4], "datatype": "INT64",
                                   "parameters": {"binary_data_size": 32}}]}).encode()
    status, body, _ = _post(encoder, f"/v2/models/{name}/infer", head + b"\0" * 16,
                            {"Inference-Header-Content-Length": str(len(head))})
    assert status == 400 and "runs past" in json.loads(body)["error"]


def test_token_and_tls_on_the_http_port(bert, tmp_path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    server = start(make_artifact(tmp_path / "art", bert), tls_cert=cert, tls_key=key,
                   token=TOKEN)
    try:
        url = f"https://127.0.0.1:{server.http_port}/v2/health/ready"
        no_token = _curl("--cacert", str(cert), "-o", "/dev/null", "-w", "%{http_code}", url)
        assert no_token.stdout == b"401"
        ok = _curl("--cacert", str(cert), "-H", f"Authorization: Bearer {TOKEN}", url)
        assert json.loads(ok.stdout) == {"ready": True}
        plain = _curl("-o", "/dev/null", "-w", "%{http_code}",
                      f"http://127.0.0.1:{server.http_port}/v2/health/ready")
        assert plain.stdout != b"200"
    finally:
        server.stop(5)


# --------------------------------------------------------------------------- a decoder


def test_tritonclient_http_unary_generation(decoder, llama) -> None:
    text = th.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], object))
    n = th.InferInput("max_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([6], np.int32))
    got = _client(decoder).infer(decoder.slot.name, [text, n])
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 6)
    assert got.as_numpy("output_ids").reshape(-1).tolist() == want
    assert got.as_numpy("text_output")[0].decode() == tokenizer().decode(want)


def test_generate_and_generate_stream(decoder, llama) -> None:
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 8)
    base = f"http://127.0.0.1:{decoder.http_port}/v2/models/{decoder.slot.name}"
    body = json.dumps({"text_input": PROMPT, "max_tokens": 8, "bad_words": "",
                       "stop_words": "", "parameters": {"temperature": 0}})
    one = json.loads(_curl("-X", "POST", "-d", body, base + "/generate").stdout)
    assert one["text_output"] == tokenizer().decode(want) and one["output_ids"] == want
    events = _curl("-N", "-X", "POST", "-d", body, base + "/generate_stream").stdout.decode()
    chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e]
    assert "".join(c["text_output"] for c in chunks) == tokenizer().decode(want)
    assert [t for c in chunks for t in c["output_ids"]] == want and len(chunks) >= 8
    bad = _curl("-X", "POST", "-d", json.dumps({"text_input": PROMPT, "top_p": 7.0}),
                base + "/generate_stream")
    assert "top_p must be in (0, 1]" in json.loads(bad.stdout)["error"]


def test_generate_as_the_vllm_backend_answers_it(decoder, llama) -> None:
    """Triton's vLLM quickstart: `stream` false in the parameters (the text comes with its
    prompt first), vLLM's sampling keys as request parameters, the additional outputs asked
    for as inputs (the logprobs listing a JSON string, as that backend's BYTES output)."""
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 4)
    base = f"http://127.0.0.1:{decoder.http_port}/v2/models/{decoder.slot.name}"
    body = json.dumps({"text_input": PROMPT, "return_finish_reason": True,
                       "return_logprobs": True, "parameters": {
                           "stream": False, "temperature": 0, "max_tokens": 4,
                           "logprobs": 1}})
    one = json.loads(_curl("-X", "POST", "-d", body, base + "/generate").stdout)
    assert one["text_output"] == PROMPT + tokenizer().decode(want)
    assert one["finish_reason"] == "length"
    listing = json.loads(one["logprobs"])
    assert [list(position) for position in listing] == [[str(t)] for t in want]  # greedy
    assert all(p[str(t)]["rank"] == 1 for p, t in zip(listing, want))


@pytest.mark.parametrize("bench", ["vllm", "sglang"])
def test_generate_stream_as_the_llm_benchmarks_trtllm_backends_send_it(decoder, llama,
                                                                        bench) -> None:
    """vLLM's benchmark_serving (backend tensorrt-llm) and SGLang's bench_serving (backend
    trt) POST these bodies to generate_stream and add up each event's text_output: their
    `accumulate_tokens` names no input, so it is a parameter, as Triton passes it."""
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 8)
    body = {"accumulate_tokens": True, "text_input": PROMPT, "temperature": 0.0,
            "top_p": 1.0, "max_tokens": 8, "stream": True}
    if bench == "sglang":  # its payload: a near-zero temperature, every token generated
        body.update(temperature=0.000001, min_length=8, end_id=1048576)
    base = f"http://127.0.0.1:{decoder.http_port}/v2/models/{decoder.slot.name}"
    events = _curl("-N", "-X", "POST", "-d", json.dumps(body),
                   base + "/generate_stream").stdout.decode()
    chunks = [json.loads(e[len("data: "):]) for e in events.split("\n\n") if e]
    assert "".join(c["text_output"] for c in chunks) == tokenizer().decode(want)
    bad = _curl("-X", "POST", "-d", json.dumps({**body, "extra": {"a": 1}}),
                base + "/generate_stream")
    assert "'extra' is not an input" in json.loads(bad.stdout)["error"]


def test_a_client_that_disconnects_frees_its_slot(decoder) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", decoder.http_port, timeout=60)
    conn.request("POST", f"/v2/models/{decoder.slot.name}/generate_stream",
                 json.dumps({"text_input": PROMPT, "max_tokens": 60}))
    r = conn.getresponse()
    assert r.readline().startswith(b"data: ")
    assert decoder.slot.engine.active() == 1
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    assert wait_for(lambda: decoder.slot.engine.active() == 0)


def test_a_unary_client_that_disconnects_frees_its_slot(decoder) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", decoder.http_port, timeout=60)
    conn.request("POST", f"/v2/models/{decoder.slot.name}/generate",
                 json.dumps({"text_input": PROMPT, "max_tokens": 60}))
    assert wait_for(lambda: decoder.slot.engine.active() == 1)
    conn.sock.close()
    conn.close()
    assert wait_for(lambda: decoder.slot.engine.active() == 0)


def test_metrics_count_calls_per_endpoint(encoder) -> None:
    _client(encoder).infer(encoder.slot.name, _inputs(feeds_for(8), True))
    text = urllib.request.urlopen(f"http://127.0.0.1:{encoder.metrics_port}/metrics",
                                  timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("tuner_endpoint_requests_total{")
                and 'endpoint="v2/models/infer"' in x and 'status="200"' in x)
    assert float(line.split()[-1]) >= 1


def test_the_http_port_serves_the_same_metrics(encoder) -> None:
    """Where vLLM serves them, and where tools that scrape a server beside its API look."""
    _client(encoder).infer(encoder.slot.name, _inputs(feeds_for(8), True))
    r = urllib.request.urlopen(f"http://127.0.0.1:{encoder.http_port}/metrics", timeout=10)
    assert r.headers["content-type"].startswith("text/plain")
    names = {line.split("{")[0] for line in r.read().decode().splitlines()
             if not line.startswith("#")}
    same = urllib.request.urlopen(f"http://127.0.0.1:{encoder.metrics_port}/metrics",
                                  timeout=10).read().decode()
    assert names == {line.split("{")[0] for line in same.splitlines() if not line.startswith("#")}
    assert {"nv_inference_request_success", "tuner_endpoint_requests_total"} <= names


def test_metrics_count_grpc_calls_per_method_too(encoder) -> None:
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(f"127.0.0.1:{encoder.port}")
    client.is_model_ready(encoder.slot.name)
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")
    text = urllib.request.urlopen(f"http://127.0.0.1:{encoder.metrics_port}/metrics",
                                  timeout=10).read().decode()
    lines = [x for x in text.splitlines() if x.startswith("tuner_endpoint_requests_total{")
             and 'protocol="grpc"' in x]
    assert any('endpoint="ModelReady"' in x and 'status="OK"' in x for x in lines), lines
    assert any('endpoint="ModelMetadata"' in x and 'status="NOT_FOUND"' in x for x in lines)


def test_metadata_versions_stay_strings_and_stats_are_numbers(encoder) -> None:
    c = _client(encoder)
    assert c.get_model_metadata(encoder.slot.name)["versions"] == ["1"]
    c.infer(encoder.slot.name, _inputs(feeds_for(8), True))
    stats = c.get_inference_statistics(encoder.slot.name)["model_stats"][0]
    assert stats["version"] == "1" and isinstance(stats["inference_count"], int)
    assert stats["inference_count"] >= 1


def test_each_port_can_be_turned_off(bert, tmp_path) -> None:
    from serving.server import ServerOptions
    from tuner.errors import BadInput

    http_only = start(make_artifact(tmp_path / "art", bert), port=None)
    try:
        assert http_only.port is None and _client(http_only).is_server_ready()
    finally:
        http_only.stop(5)
    with pytest.raises(BadInput, match="both gRPC and HTTP are turned off"):
        ServerOptions(port=None, http_port=None)


def _endless_request(content_type: bytes, first: bytes = b""):
    """A real Starlette request whose body (`first`, then 1 KiB chunks) never ends (chunked,
    no Content-Length), and how many chunks were pulled from it."""
    from starlette.requests import Request

    pulled = [0]

    async def receive():
        pulled[0] += 1
        body = first if pulled[0] == 1 and first else b"x" * 1024
        return {"type": "http.request", "body": body, "more_body": True}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-type", content_type), (b"transfer-encoding", b"chunked")]}
    return Request(scope, receive), pulled


def test_a_body_without_a_length_is_read_no_further_than_the_limit():
    """JSON bodies and forms alike stop at the limit (a chunked body was read whole
    before its size was checked)."""
    import asyncio

    from serving.errors import InvalidArgument
    from serving.http.app import Frontend

    frontend = Frontend(slot=None, max_body_bytes=10 * 1024)
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n'
    for read, kind, first in ((frontend.body, b"application/json", b""),
                              (lambda r: frontend.form(r, 1, 8),
                               b"multipart/form-data; boundary=b", part)):
        request, pulled = _endless_request(kind, first)
        with pytest.raises(InvalidArgument, match="over the limit 10240"):
            asyncio.run(read(request))
        assert pulled[0] == 11
    request, _ = _endless_request(b"text/plain")
    with pytest.raises(InvalidArgument, match="multipart/form-data"):
        asyncio.run(frontend.form(request, 1, 8))
