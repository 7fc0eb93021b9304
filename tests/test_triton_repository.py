"""Triton's model repository extension on a server that serves one model for its lifetime,
driven by the real tritonclient.grpc and tritonclient.http: the index lists the model
(READY, or UNAVAILABLE with the reason while it loads), a load of it is answered OK once
it is ready, a load of any other model is NOT_FOUND, an unload is refused saying why."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from llm_support import bert, encoder  # noqa: F401 - fixtures
from serving_support import make_artifact
from tritonclient.utils import InferenceServerException

from serving.server import Server, ServerOptions



def _clients(server) -> tuple[tg.InferenceServerClient, th.InferenceServerClient]:
    return (tg.InferenceServerClient(f"127.0.0.1:{server.port}"),
            th.InferenceServerClient(f"127.0.0.1:{server.http_port}"))


def _refused(call, grpc_code: grpc.StatusCode | None, http_status: str | None, *words):
    with pytest.raises(InferenceServerException) as info:
        call()
    if grpc_code is not None:
        assert info.value.status() == f"StatusCode.{grpc_code.name}", info.value
    if http_status is not None:
        assert info.value.status() == http_status, info.value
    for word in words:
        assert word in info.value.message(), info.value.message()


def test_index_lists_the_served_model(encoder) -> None:
    g, h = _clients(encoder)
    name = encoder.slot.name
    index = g.get_model_repository_index()
    assert [(m.name, m.version, m.state, m.reason) for m in index.models] == [
        (name, "1", "READY", "")]
    assert h.get_model_repository_index() == [{"name": name, "version": "1", "state": "READY"}]


def test_load_of_the_served_model_is_answered_and_others_are_not_found(encoder) -> None:
    g, h = _clients(encoder)
    name = encoder.slot.name
    g.load_model(name)
    h.load_model(name)
    assert g.is_model_ready(name)
    _refused(lambda: g.load_model("other"), grpc.StatusCode.NOT_FOUND, None,
             "'other'", "serves one model", f"'{name}'")
    _refused(lambda: h.load_model("other"), None, "404", "'other'", "serves one model")
    _refused(lambda: g.load_model(name, config='{"backend": "python"}'),
             grpc.StatusCode.INVALID_ARGUMENT, None, "cannot change it")


def test_unload_is_refused_saying_why(encoder) -> None:
    g, h = _clients(encoder)
    name = encoder.slot.name
    _refused(lambda: g.unload_model(name), grpc.StatusCode.INVALID_ARGUMENT, None,
             "cannot be unloaded", "for its lifetime")
    _refused(lambda: h.unload_model(name), None, "400", "cannot be unloaded")
    _refused(lambda: g.unload_model("other"), grpc.StatusCode.NOT_FOUND, None, "'other'")
    assert g.is_model_ready(name)  # still served


def test_a_model_still_loading_is_unavailable_with_its_reason(bert, tmp_path) -> None:
    server = Server(make_artifact(tmp_path / "a", bert),
                    ServerOptions(port=0, http_port=0, metrics_port=None), say=lambda _: None)
    server.start(load=False)
    try:
        g, h = _clients(server)
        (model,) = g.get_model_repository_index().models
        assert (model.state, model.reason) == ("UNAVAILABLE", "loading and checking accuracy")
        ready_only = urllib.request.Request(  # tritonclient cannot ask for ready ones only
            f"http://127.0.0.1:{server.http_port}/v2/repository/index", b'{"ready": true}')
        assert json.loads(urllib.request.urlopen(ready_only, timeout=30).read()) == []
        assert h.get_model_repository_index()[0]["state"] == "UNAVAILABLE"
        _refused(lambda: g.load_model(server.slot.name), grpc.StatusCode.UNAVAILABLE, None,
                 "not ready", "loading")
    finally:
        server.stop(1)
