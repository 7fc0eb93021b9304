"""Triton's system shared memory extension, driven by the real tritonclient.grpc,
tritonclient.http and tritonclient.utils.shared_memory on a served BERT encoder: inputs read
from regions and outputs written into them equal ONNX Runtime run in-process, over
ModelInfer, ModelStreamInfer and REST, alone or mixed with inputs in the body; status lists
the regions, unregister (and the server's stop) lets them go. Refusals name their fault and
leave nothing open: a key that is not a plain shm name, a symlink out of /dev/shm, a region
past its object, a tensor past its region, a duplicate name, an unknown region, an output
that does not fit, CUDA shared memory. A decoder reads a generation's prompt from a region."""

from __future__ import annotations

import os
import queue
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from llm_support import bert, decoder, encoder, llama  # noqa: F401 - fixtures
from serving_support import feeds_for, make_artifact
from tritonclient.utils import (InferenceServerException, serialize_byte_tensor,
                               serialized_byte_size)

from serving.server import Server, ServerOptions

OUT = "last_hidden_state"
CLIENT_FDS = 2  # tritonclient's handle: the object's descriptor and its mapping's dup



@pytest.fixture
def regions(encoder):
    """make(size) -> (handle, key) of a fresh POSIX shm object; every one destroyed after
    the test, and every region the test registered unregistered."""
    made = []

    def make(size: int):
        key = f"/tuner_test_{uuid.uuid4().hex[:12]}"
        made.append(shm.create_shared_memory_region(key[1:], key, size))
        return made[-1], key

    yield make
    encoder.slot.regions.unregister()
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _grpc(server) -> tg.InferenceServerClient:
    return tg.InferenceServerClient(f"127.0.0.1:{server.port}")


def _http(server) -> th.InferenceServerClient:
    return th.InferenceServerClient(f"127.0.0.1:{server.http_port}")


def _reference(model, feeds) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run([OUT], feeds)[0]


def _fds_on(key: str) -> int:
    """Descriptors of this process (server and client alike) open on /dev/shm/<key> (the
    client's handle holds two: its own and its mapping's duplicate)."""
    target = f"/dev/shm/{key.lstrip('/')}"
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            pass
    return count


def _staged(make, feeds: dict, names) -> tuple[object, str, dict[str, tuple[int, int]]]:
    """A region holding `names` of `feeds` one after another: (handle, key, name -> (offset,
    byte_size))."""
    spans, offset = {}, 0
    for name in names:
        spans[name] = (offset, feeds[name].nbytes)
        offset += feeds[name].nbytes
    handle, key = make(offset)
    shm.set_shared_memory_region(handle, [feeds[n] for n in names])
    return handle, key, spans


def _inputs(lib, feeds: dict, spans: dict, region: str) -> list:
    made = []
    for name, array in feeds.items():
        made.append(lib.InferInput(name, list(array.shape), "INT64"))
        if name in spans:
            offset, size = spans[name]
            made[-1].set_shared_memory(region, size, offset)
        else:
            made[-1].set_data_from_numpy(array)
    return made


def _output_region(make, client, feeds, name: str = "out"):
    """A region for the encoder's output, registered as `name`; returns (handle, size)."""
    rows, length = feeds["input_ids"].shape
    size = rows * length * 64 * 4  # bert-small's hidden size, float32
    handle, key = make(size)
    client.register_system_shared_memory(name, key, size)
    return handle, size


# ------------------------------------------------------------------------------ gRPC


def test_grpc_inputs_and_output_in_shared_memory_equal_onnx_runtime(encoder, bert, regions):
    client, feeds = _grpc(encoder), feeds_for(12, rows=2, seed=11)
    handle, key, spans = _staged(regions, feeds, ["input_ids", "attention_mask"])
    client.register_system_shared_memory("in", key, sum(s for _, s in spans.values()))
    out, size = _output_region(regions, client, feeds)
    output = tg.InferRequestedOutput(OUT)
    output.set_shared_memory("out", size)
    result = client.infer(encoder.slot.name, _inputs(tg, feeds, spans, "in"), outputs=[output])
    tensor = result.get_output(OUT)
    assert list(tensor.shape) == [2, 12, 64] and tensor.datatype == "FP32"
    assert result.get_response().raw_output_contents == [b""]  # the data is in the region
    got = shm.get_contents_as_numpy(out, np.float32, list(tensor.shape))
    np.testing.assert_allclose(got, _reference(bert, feeds), atol=1e-4, rtol=1e-4)
    status = client.get_system_shared_memory_status().regions
    assert sorted(status) == ["in", "out"] and status["out"].byte_size == size
    assert (status["in"].key, status["in"].offset, status["in"].byte_size) == (
        key, 0, 2 * feeds["input_ids"].nbytes)
    client.unregister_system_shared_memory("in")
    assert list(client.get_system_shared_memory_status().regions) == ["out"]
    assert _fds_on(key) == CLIENT_FDS  # the client's own: the server let its descriptor go
    client.unregister_system_shared_memory()
    assert not client.get_system_shared_memory_status().regions


def test_grpc_mixed_inputs_over_a_stream(encoder, bert, regions):
    """input_ids from a region, attention_mask in the body, on ModelStreamInfer."""
    client, feeds = _grpc(encoder), feeds_for(9, seed=4, pad_right=2)
    _, key, spans = _staged(regions, feeds, ["input_ids"])
    client.register_system_shared_memory("ids", key, spans["input_ids"][1])
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(encoder.slot.name, _inputs(tg, feeds, spans, "ids"))
        result, error = answers.get(timeout=60)
    finally:
        client.stop_stream()
    assert error is None
    want = _reference(bert, feeds)
    np.testing.assert_allclose(result.as_numpy(OUT)[:, :7], want[:, :7], atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ HTTP


@pytest.mark.parametrize("in_region", [("input_ids", "attention_mask"), ("attention_mask",)])
def test_http_inputs_and_output_in_shared_memory_equal_onnx_runtime(encoder, bert, regions,
                                                                    in_region):
    client, feeds = _http(encoder), feeds_for(10, rows=2, seed=7)
    _, key, spans = _staged(regions, feeds, in_region)
    client.register_system_shared_memory("in", key, sum(s for _, s in spans.values()))
    out, size = _output_region(regions, client, feeds)
    output = th.InferRequestedOutput(OUT)
    output.set_shared_memory("out", size)
    result = client.infer(encoder.slot.name, _inputs(th, feeds, spans, "in"), outputs=[output])
    entry = result.get_output(OUT)
    assert entry["shape"] == [2, 10, 64] and "data" not in entry
    got = shm.get_contents_as_numpy(out, np.float32, entry["shape"])
    np.testing.assert_allclose(got, _reference(bert, feeds), atol=1e-4, rtol=1e-4)
    status = client.get_system_shared_memory_status()
    assert sorted(r["name"] for r in status) == ["in", "out"]
    assert client.get_system_shared_memory_status("in")[0]["key"] == key
    client.unregister_system_shared_memory("out")
    assert [r["name"] for r in client.get_system_shared_memory_status()] == ["in"]
    client.unregister_system_shared_memory()
    assert client.get_system_shared_memory_status() == []


def test_both_ports_advertise_the_extensions(encoder):
    for extensions in (_grpc(encoder).get_server_metadata().extensions,
                       _http(encoder).get_server_metadata()["extensions"]):
        assert {"system_shared_memory", "model_repository"} <= set(extensions)
        assert "cuda_shared_memory" not in extensions


# ------------------------------------------------------------------------------ refusals


def _refused_grpc(call, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == f"StatusCode.{code.name}", info.value
    for word in words:
        assert word in info.value.message(), info.value.message()


def test_keys_that_are_not_plain_shm_names_are_refused(encoder, regions, tmp_path):
    client, http = _grpc(encoder), _http(encoder)
    _, key = regions(64)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 64)
    link = Path(f"/dev/shm/tuner_test_link_{uuid.uuid4().hex[:8]}")
    link.symlink_to(secret)
    try:
        for bad in (f"/{secret}", "/../" + str(secret), key[1:], f"{key}/..", "/..", "/",
                    key + "/x"):
            _refused_grpc(lambda: client.register_system_shared_memory("r", bad, 8),
                          grpc.StatusCode.INVALID_ARGUMENT, "invalid shm key")
            with pytest.raises(InferenceServerException, match="invalid shm key"):
                http.register_system_shared_memory("r", bad, 8)
        # a symlink in /dev/shm is not followed out of it
        _refused_grpc(lambda: client.register_system_shared_memory("r", f"/{link.name}", 8),
                      grpc.StatusCode.INVALID_ARGUMENT, "Unable to open", link.name)
        _refused_grpc(lambda: client.register_system_shared_memory("r", "/no_such_obj_x", 8),
                      grpc.StatusCode.INVALID_ARGUMENT, "Unable to open", "/no_such_obj_x")
        # Triton's own backends' objects, refused as Triton refuses them, before any open
        reserved = "/triton_python_backend_shm_region_1"
        _refused_grpc(lambda: client.register_system_shared_memory("r", reserved, 8),
                      grpc.StatusCode.INVALID_ARGUMENT, "reserved prefix", reserved)
        with pytest.raises(InferenceServerException, match="reserved prefix"):
            http.register_system_shared_memory("r", reserved, 8)
    finally:
        link.unlink()
    assert not client.get_system_shared_memory_status().regions
    assert _fds_on(key) == CLIENT_FDS


def test_spans_names_and_sizes_are_checked(encoder, regions):
    client, name = _grpc(encoder), encoder.slot.name
    feeds = feeds_for(8, seed=2)
    _, key, spans = _staged(regions, feeds, ["input_ids", "attention_mask"])
    size = sum(s for _, s in spans.values())
    _refused_grpc(lambda: client.register_system_shared_memory("r", key, size + 1),
                  grpc.StatusCode.INVALID_ARGUMENT, "runs past the end", key)
    _refused_grpc(lambda: client.register_system_shared_memory("r", key, 8, offset=size),
                  grpc.StatusCode.INVALID_ARGUMENT, "runs past the end")
    assert not client.get_system_shared_memory_status().regions and _fds_on(key) == CLIENT_FDS
    client.register_system_shared_memory("r", key, size)
    _refused_grpc(lambda: client.register_system_shared_memory("r", key, size),
                  grpc.StatusCode.ALREADY_EXISTS, "'r' already in manager")
    assert _fds_on(key) == CLIENT_FDS + 1  # the client's and the one region's
    past = _inputs(tg, feeds, {"input_ids": (0, 64), "attention_mask": (64, size)}, "r")
    _refused_grpc(lambda: client.infer(name, past), grpc.StatusCode.INVALID_ARGUMENT,
                  "input 'attention_mask'", "runs past", "region 'r'")
    unknown = _inputs(tg, feeds, spans, "nope")
    _refused_grpc(lambda: client.infer(name, unknown), grpc.StatusCode.NOT_FOUND,
                  "Unable to find shared memory region: 'nope'")
    _refused_grpc(lambda: client.get_system_shared_memory_status("nope"),
                  grpc.StatusCode.NOT_FOUND, "'nope'")
    short = tg.InferRequestedOutput(OUT)
    short.set_shared_memory("r", 16)  # the output needs 8 * 64 * 4 bytes
    _refused_grpc(lambda: client.infer(name, _inputs(tg, feeds, spans, "r"), outputs=[short]),
                  grpc.StatusCode.INVALID_ARGUMENT, f"output '{OUT}'", "(16 bytes)",
                  "at least 2048 bytes")
    with pytest.raises(InferenceServerException, match="runs past") as info:
        _http(encoder).infer(name, _inputs(th, feeds, {"input_ids": (72, 64)}, "r"))
    assert info.value.status() == "400"
    with pytest.raises(InferenceServerException, match="already in manager"):
        _http(encoder).register_system_shared_memory("r", key, size)
    client.unregister_system_shared_memory("r")
    client.unregister_system_shared_memory("never-registered")  # no error, as Triton
    assert _fds_on(key) == CLIENT_FDS


def test_cuda_shared_memory_is_refused_naming_the_alternative(encoder):
    _refused_grpc(lambda: _grpc(encoder).get_cuda_shared_memory_status(),
                  grpc.StatusCode.UNAVAILABLE, "CUDA shared memory is not supported",
                  "system shared memory")
    _refused_grpc(lambda: _grpc(encoder).unregister_cuda_shared_memory("x"),
                  grpc.StatusCode.UNAVAILABLE, "system shared memory")
    with pytest.raises(InferenceServerException, match="system shared memory") as info:
        _http(encoder).get_cuda_shared_memory_status()
    assert info.value.status() == "503"


def test_stop_lets_every_region_go(bert, tmp_path, regions):
    """A server that never loads its model still takes registrations; its stop closes them."""
    server = Server(make_artifact(tmp_path / "a", bert),
                    ServerOptions(port=0, http_port=0, metrics_port=None), say=lambda _: None)
    server.start(load=False)
    _, key = regions(128)
    try:
        _grpc(server).register_system_shared_memory("a", key, 128)
        _http(server).register_system_shared_memory("b", key, 64, offset=64)
        assert _fds_on(key) == CLIENT_FDS + 2
    finally:
        server.stop(1)
    assert _fds_on(key) == CLIENT_FDS and server.slot.regions.status() == []


# ------------------------------------------------------------------------------ decoder


def _generated(stream: tg.InferenceServerClient, answers: queue.Queue) -> list[int]:
    ids = []
    while True:
        result, error = answers.get(timeout=60)
        assert error is None, error
        ids += result.as_numpy("output_ids").reshape(-1).tolist()
        if result.get_response().parameters["triton_final_response"].bool_param:
            return ids


def test_a_generation_reads_its_prompt_from_shared_memory(decoder, regions):
    """input_ids from a region over ModelStreamInfer, text_input (BYTES, length-prefixed)
    from one over ModelInfer: each the same generation as the prompt sent in the body."""
    client, name = _grpc(decoder), decoder.slot.name
    prompt = np.array([[5, 17, 42, 7]], np.int64)
    text = serialize_byte_tensor(np.array([b"The quick brown fox"], dtype=object))
    text_size = serialized_byte_size(text)
    handle, key = regions(prompt.nbytes + text_size)
    shm.set_shared_memory_region(handle, [prompt, text])
    client.register_system_shared_memory("prompt", key, prompt.nbytes + text_size)
    steps = tg.InferInput("max_tokens", [1], "INT32")
    steps.set_data_from_numpy(np.array([6], np.int32))

    def prompt_input(in_region: bool) -> tg.InferInput:
        ids = tg.InferInput("input_ids", [1, 4], "INT64")
        return ids.set_shared_memory("prompt", prompt.nbytes) if in_region else \
            ids.set_data_from_numpy(prompt)

    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer(name, [prompt_input(True), steps])
        from_region = _generated(client, answers)
        client.async_stream_infer(name, [prompt_input(False), steps])
        assert from_region == _generated(client, answers) and len(from_region) == 6
    finally:
        client.stop_stream()

    def text_input(in_region: bool) -> tg.InferInput:
        t = tg.InferInput("text_input", [1], "BYTES")
        return t.set_shared_memory("prompt", text_size, prompt.nbytes) if in_region else \
            t.set_data_from_numpy(np.array([b"The quick brown fox"], dtype=object))

    texts = [client.infer(name, [text_input(r), steps]).as_numpy("text_output")
             for r in (True, False)]
    assert texts[0].tolist() == texts[1].tolist() and texts[0].reshape(-1)[0]
    output = tg.InferRequestedOutput("text_output")
    output.set_shared_memory("prompt", 8)
    _refused_grpc(lambda: client.infer(name, [text_input(True), steps], outputs=[output]),
                  grpc.StatusCode.INVALID_ARGUMENT, "output 'text_output'",
                  "not written to shared memory")
