"""The server over real gRPC on loopback, driven by the real tritonclient: health, metadata,
config, inference equal to running the ONNX directly, every invalid request answered with
its code, 200 concurrent requests batched and exact, streaming, metrics, health and
reflection services, the accuracy gate at start, shadow checks.

Over 400 lines on purpose: one file per part under test, each test with the model it needs."""

from __future__ import annotations

import re
import urllib.request

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import requests
import tritonclient.grpc as tg
from serving_support import (Answers, assert_close_where_valid, feeds_for, infer_inputs,
                             make_artifact, perturbed_copy)
from tritonclient.utils import InferenceServerException

import serving
from serving.engine import EngineOptions
from serving.server import Server, ServerOptions
from serving.wire import protocol
from serving.wire._generated import inference_pb2 as pb
from serving.wire._generated import inference_pb2_grpc as pb_grpc

ATOL, RTOL = 1e-4, 1e-4


def _start(out, **engine) -> Server:
    server = Server(out, ServerOptions(port=0, metrics_port=0,
                                       engine=EngineOptions(**engine)), say=lambda line: None)
    server.start()
    assert server.wait_ready(120), server.slot.status
    return server


@pytest.fixture(scope="module")
def bert(reference_model, tmp_path_factory):
    model = reference_model("bert", "small", "dynamo")
    # one run at a time (no overlapping sessions): the batcher joins requests, which the
    # tests here check; default delay: none
    server = _start(make_artifact(tmp_path_factory.mktemp("bert"), model), workers=1)
    yield server, model
    server.stop(5)


@pytest.fixture(scope="module")
def gpt2(reference_model, tmp_path_factory):
    model = reference_model("gpt2", "small", "torchscript")
    server = _start(make_artifact(tmp_path_factory.mktemp("gpt2"), model), pad_to="bucket",
                    workers=1)
    yield server, model
    server.stop(5)


def _client(server: Server) -> tg.InferenceServerClient:
    return tg.InferenceServerClient(f"127.0.0.1:{server.port}")


def _direct(model, feeds) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _assert_served_as_direct(server, model, feeds) -> None:
    """One request through gRPC gives what running the ONNX file directly gives."""
    got = _client(server).infer(server.slot.name, infer_inputs(feeds))
    np.testing.assert_allclose(got.as_numpy("last_hidden_state"),
                               _direct(model, feeds)["last_hidden_state"], atol=ATOL, rtol=RTOL)


def test_health_metadata_and_config(bert) -> None:
    server, _ = bert
    client, name = _client(server), server.slot.name
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(name) and not client.is_model_ready("nope")
    assert client.get_server_metadata().name == "shapetuner"
    meta = client.get_model_metadata(name)
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [
        ("input_ids", "INT64", [-1, -1]), ("attention_mask", "INT64", [-1, -1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [
        ("last_hidden_state", "FP32", [-1, -1, 64])]
    config = client.get_model_config(name).config
    assert config.max_batch_size == 8 and list(config.input[0].dims) == [-1]
    assert list(config.output[0].dims) == [-1, 64]
    assert config.parameters["served_variant"].string_value == "original"
    assert config.parameters["pad_to"].string_value == "longest"  # auto, on a CPU backend


@pytest.mark.parametrize("which", ["bert", "gpt2"])
@pytest.mark.parametrize("length, pad_right", [(5, 0), (16, 0), (32, 0), (11, 4)])
def test_infer_equals_the_onnx_run_directly(which, length, pad_right, request) -> None:
    server, model = request.getfixturevalue(which)
    feeds = feeds_for(length, rows=2, vocab=1000, seed=length, pad_right=pad_right)
    result = _client(server).infer(server.slot.name, infer_inputs(feeds))
    for name, expected in _direct(model, feeds).items():
        assert_close_where_valid(result.as_numpy(name), expected, feeds["attention_mask"],
                                 ATOL, RTOL)


def test_typed_contents_and_requested_outputs(bert) -> None:
    server, model = bert
    feeds = feeds_for(6, seed=3)
    request = pb.ModelInferRequest(model_name=server.slot.name, id="typed-1")
    for name, array in feeds.items():
        t = request.inputs.add(name=name, datatype="INT64", shape=array.shape)
        t.contents.int64_contents.extend(array.ravel().tolist())
    request.outputs.add(name="last_hidden_state")
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert response.id == "typed-1" and len(response.raw_output_contents) == 1
    got = protocol.decode_outputs(response)["last_hidden_state"]
    np.testing.assert_allclose(got, _direct(model, feeds)["last_hidden_state"], atol=ATOL,
                               rtol=RTOL)


def _raw_call(server: Server, request: pb.ModelInferRequest, text: str) -> grpc.RpcError:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.RpcError, match=re.escape(text)) as info:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    return info.value


def _bad_requests(name: str) -> dict[str, tuple[pb.ModelInferRequest, grpc.StatusCode, str]]:
    ok = feeds_for(4)
    enc = protocol.encode_inputs
    short = enc(ok, name)
    short.raw_input_contents[0] = short.raw_input_contents[0][:-8]
    both = enc(ok, name)
    both.inputs[0].contents.int64_contents.extend(ok["input_ids"].ravel().tolist())
    versioned = enc(ok, name)
    versioned.model_version = "7"
    bad = grpc.StatusCode.INVALID_ARGUMENT
    return {
        "unknown input": (enc({**ok, "token_type_ids": ok["input_ids"]}, name), bad,
                          "unexpected inference input 'token_type_ids'"),
        "missing input": (enc({"input_ids": ok["input_ids"]}, name), bad,
                          "expected 2 inputs but got 1 inputs"),
        "wrong dtype": (enc({k: v.astype(np.int32) for k, v in ok.items()}, name), bad,
                        "data-type is 'INT32', but model"),
        "wrong rank": (enc({k: v[0] for k, v in ok.items()}, name), bad,
                       "unexpected shape for input 'input_ids'"),
        "empty sequence": (enc({k: v[:, :0] for k, v in ok.items()}, name), bad,
                           "Expected [-1,-1], got [1,0]"),
        "byte size": (short, bad, "unexpected total byte size 24 for input 'input_ids', "
                                  "expecting 32"),
        "token out of vocab": (enc({**ok, "input_ids": ok["input_ids"] + 1000}, name), bad,
                               "outside the vocabulary [0, 1000)"),
        "negative token": (enc({**ok, "input_ids": -ok["input_ids"] - 1}, name), bad,
                           "outside the vocabulary"),
        "batch over limit": (enc(feeds_for(4, rows=9), name), bad,
                             "batch-size must be <= 8"),
        "longer than buckets": (enc(feeds_for(33), name), bad, "longer than the largest bucket"),
        "lengths disagree": (enc({**ok, "attention_mask": np.ones((1, 5), np.int64)}, name),
                             bad, "disagree on the sequence length"),
        "raw and typed": (both, bad, "contents field must not be specified"),
        "unknown output": (enc(ok, name, outputs=["logits"]), bad,
                           "unexpected inference output 'logits'"),
        "unknown model": (enc(ok, "no-such-model"), grpc.StatusCode.NOT_FOUND,
                          "Request for unknown model: 'no-such-model' is not found"),
        "unknown version": (versioned, grpc.StatusCode.NOT_FOUND, "version 7"),
    }


def test_every_invalid_request_gets_its_code_and_the_server_lives_on(bert) -> None:
    server, model = bert
    failures_before = server.stats.fail.count
    for case, (request, code, text) in _bad_requests(server.slot.name).items():
        error = _raw_call(server, request, text)
        assert error.code() == code, f"{case}: {error.code()} {error.details()}"
        assert text in error.details(), f"{case}: {error.details()!r}"
    assert server.stats.fail.count > failures_before
    feeds = feeds_for(4)
    result = _client(server).infer(server.slot.name, infer_inputs(feeds))
    np.testing.assert_allclose(result.as_numpy("last_hidden_state"),
                               _direct(model, feeds)["last_hidden_state"], atol=ATOL, rtol=RTOL)


def test_tritonclient_sees_the_same_codes(bert) -> None:
    server, _ = bert
    client = _client(server)
    with pytest.raises(InferenceServerException, match="unknown model: 'no-such-model'") as info:
        client.infer("no-such-model", infer_inputs(feeds_for(4)))
    assert "NOT_FOUND" in str(info.value.status())
    with pytest.raises(InferenceServerException,
                       match="sequence length 40 is longer than the largest bucket 32") as info:
        client.infer(server.slot.name, infer_inputs(feeds_for(40)))
    assert "INVALID_ARGUMENT" in str(info.value.status())


def test_200_concurrent_requests_of_mixed_lengths_are_each_exact(bert) -> None:
    server, model = bert
    client = _client(server)
    rng = np.random.default_rng(7)
    requests = [feeds_for(int(rng.integers(1, 33)), rows=int(rng.integers(1, 3)), seed=i,
                          pad_right=int(rng.integers(0, 2))) for i in range(200)]
    executions_before = server.stats.execution_count
    answers = Answers()
    for i, feeds in enumerate(requests):
        client.async_infer(server.slot.name, infer_inputs(feeds), answers.callback(i))
    answers.wait(len(requests), timeout=120)
    results = answers.results
    runs = server.stats.execution_count - executions_before
    assert runs < 200, "no two requests shared a model run: batching did not happen"
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    compared = 0
    for i, feeds in enumerate(requests):
        result = results[i]
        assert not isinstance(result, Exception), f"request {i}: {result}"
        if not feeds["attention_mask"].any(axis=1).all():
            continue  # a row the client masked out entirely has no valid position to compare
        assert_close_where_valid(result.as_numpy("last_hidden_state"),
                                 session.run(None, feeds)[0], feeds["attention_mask"], ATOL,
                                 RTOL, what=f"request {i}")
        compared += 1
    assert compared > 150


def test_stream_infer_answers_in_order_and_survives_a_bad_request(bert) -> None:
    server, model = bert
    client = _client(server)
    answers: list = []
    import threading

    done = threading.Semaphore(0)

    def on_answer(result, error):
        answers.append(error if error is not None else result)
        done.release()

    client.start_stream(on_answer)
    try:
        good = [feeds_for(n, seed=n) for n in (3, 9)]
        client.async_stream_infer(server.slot.name, infer_inputs(good[0]))
        client.async_stream_infer(server.slot.name, infer_inputs(feeds_for(50)))
        client.async_stream_infer(server.slot.name, infer_inputs(good[1]))
        for _ in range(3):
            assert done.acquire(timeout=60)
    finally:
        client.stop_stream()
    assert isinstance(answers[1], InferenceServerException)
    assert "longer than the largest bucket" in str(answers[1])
    for result, feeds in zip((answers[0], answers[2]), good):
        np.testing.assert_allclose(result.as_numpy("last_hidden_state"),
                                   _direct(model, feeds)["last_hidden_state"], atol=ATOL,
                                   rtol=RTOL)


def test_statistics_and_prometheus_metrics(bert) -> None:
    server, _ = bert
    client = _client(server)
    client.infer(server.slot.name, infer_inputs(feeds_for(4)))
    stats = client.get_inference_statistics(server.slot.name).model_stats[0]
    assert stats.inference_stats.success.count >= 1 and stats.execution_count >= 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    label = f'model="{server.slot.name}"'
    success = [l for l in text.splitlines()
               if l.startswith("nv_inference_request_success{") and label in l]
    assert success and float(success[0].split()[-1]) >= 1
    for metric in ("nv_inference_request_failure{", "nv_inference_queue_duration_us{",
                   "nv_inference_compute_infer_duration_us{", "tuner_batch_size_bucket{"):
        assert metric in text, metric


def test_health_and_reflection_services(bert) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
        ProtoReflectionDescriptorDatabase

    server, _ = bert
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService"), timeout=10)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
        file = db.FindFileContainingSymbol("inference.ModelInferRequest")
        assert any(m.name == "ModelInferRequest" for m in file.message_type)


def test_gate_failure_serves_the_original(reference_model, tmp_path) -> None:
    model = reference_model("bert", "small", "torchscript")
    wrong = perturbed_copy(model, tmp_path / "wrong.onnx")
    out = make_artifact(tmp_path / "art", model, variant=wrong, variant_name="wrong")
    lines: list[str] = []
    server = Server(out, ServerOptions(port=0, metrics_port=None), say=lines.append).start()
    try:
        assert server.wait_ready(120)
        assert server.slot.engine.model.served == "original"
        assert any("FAILED the accuracy gate" in line for line in lines)
        feeds = feeds_for(7, seed=1)
        _assert_served_as_direct(server, model, feeds)
    finally:
        server.stop(5)


def test_exact_variant_is_served_and_shadow_checks_agree(reference_model, tmp_path) -> None:
    from tuner.jobs.pad import pad_file
    from tuner.rewrite.compose import PadRequest

    model = reference_model("gpt2", "small", "torchscript")
    out = tmp_path / "art"
    padded = out / "variants" / "vocab50304" / "model.onnx"
    padded.parent.mkdir(parents=True)
    pad_file(model, padded, PadRequest(vocab_size=50304))  # logits sliced back to 50257
    make_artifact(out, model, variant=padded, variant_name="vocab50304")
    server = _start(out, shadow_fraction=1.0)
    try:
        assert server.slot.engine.model.served == "vocab50304"
        client = _client(server)
        for n in (4, 9, 16):
            feeds = feeds_for(n, seed=n)
            got = client.infer(server.slot.name, infer_inputs(feeds)).as_numpy("logits")
            np.testing.assert_allclose(got, _direct(model, feeds)["logits"], atol=ATOL,
                                       rtol=1e-3)
        server.slot.engine._shadow.submit(lambda: None).result(60)  # shadow queue flushed
        assert server.stats.shadow["agree"] == 3 and server.stats.shadow["disagree"] == 0
    finally:
        server.stop(5)


def test_not_ready_until_the_model_is_loaded_and_checked(reference_model, tmp_path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    out = make_artifact(tmp_path / "art", reference_model("bert", "small", "torchscript"))
    server = Server(out, ServerOptions(port=0, http_port=0, metrics_port=None),
                    say=lambda line: None)
    server.start(load=False)  # listening, nothing loaded yet
    try:
        client, name = _client(server), server.slot.name
        assert client.is_server_live()
        assert not client.is_server_ready() and not client.is_model_ready(name)
        http = f"http://127.0.0.1:{server.http_port}"
        # vLLM's probe, as its deployments send it: 503 until the model serves
        assert requests.get(f"{http}/health", timeout=10).status_code == 503
        assert requests.get(f"{http}/v2/health/ready", timeout=10).status_code == 503
        with pytest.raises(InferenceServerException,
                           match=f"model '{name}' is not ready: loading and checking") as info:
            client.infer(name, infer_inputs(feeds_for(4)))
        assert "UNAVAILABLE" in str(info.value.status()) and "is not ready" in str(info.value)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="inference.GRPCInferenceService")
            assert health.Check(request, timeout=10).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            server.load()
            assert health.Check(request, timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
        assert client.is_model_ready(name)
        assert requests.get(f"{http}/health", timeout=10).status_code == 200
        assert requests.get(f"{http}/version", timeout=10).json() == {
            "version": serving.__version__}
        got = client.infer(name, infer_inputs(feeds_for(4))).as_numpy("last_hidden_state")
        want = ort.InferenceSession(str(reference_model("bert", "small", "torchscript")),
                                    providers=["CPUExecutionProvider"]).run(None, feeds_for(4))[0]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)  # (1, 4, hidden)
    finally:
        server.stop(5)


def test_metadata_and_config_of_an_unknown_model_are_not_found(bert) -> None:
    server, _ = bert
    client = _client(server)
    for call in (client.get_model_metadata, client.get_model_config,
                 client.get_inference_statistics):
        with pytest.raises(InferenceServerException,
                           match="unknown model: 'no-such-model'") as info:
            call("no-such-model")
        assert "NOT_FOUND" in str(info.value.status()), call


def test_runs_with_the_session_settings_the_artifact_was_timed_with(reference_model,
                                                                    tmp_path) -> None:
    from serving.model import load_artifact
    from tuner.errors import BadInput

    model = reference_model("bert", "small", "torchscript")
    out = make_artifact(tmp_path / "a", model, settings={"intra_op_threads": 1,
                                                         "graph_optimization": "basic"})
    loaded = load_artifact(out)
    options = loaded.runner.session.get_session_options()
    assert options.intra_op_num_threads == 1
    bad = make_artifact(tmp_path / "b", model, settings={"graph_optimization": "max"})
    with pytest.raises(BadInput, match="manifest: settings: graph_optimization must be"):
        load_artifact(bad)


def test_batching_that_does_not_pay_still_takes_batched_requests(reference_model,
                                                                 tmp_path) -> None:
    """Timings showing a batch costs more than single runs turn dynamic batching off, but
    a client may still send several rows in one request, up to the largest batch bucket."""
    import dataclasses

    from tuner.artifact.records import Latency
    from tuner.artifact.store import read_manifest, write_manifest

    model = reference_model("bert", "small", "torchscript")
    out = make_artifact(tmp_path / "art", model)
    manifest = read_manifest(out)
    slow = {f"{b}x{s}": Latency(*(1.1 * b,) * 5, 5) for b in (1, 4, 8) for s in (8, 16, 32)}
    original = dataclasses.replace(manifest.variants[0], latency=slow)
    write_manifest(out, dataclasses.replace(manifest, variants=(original,)))
    server = _start(out, workers=1)  # one run at a time: the timings decide
    try:
        engine = server.slot.engine
        assert (engine.max_batch, engine.join_rows) == (8, 1)
        assert "does not pay" in engine.batch_note
        config = _client(server).get_model_config(server.slot.name).config
        assert config.max_batch_size == 8
        assert list(config.dynamic_batching.preferred_batch_size) == [1]
        feeds = feeds_for(6, rows=4)
        _assert_served_as_direct(server, model, feeds)
    finally:
        server.stop(5)
