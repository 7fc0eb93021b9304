"""A full server (every stream slot and the queue taken) as each API's own client sees it:
the answer the original server gives, which each client raises as its typed error, and
Retry-After, which the openai and anthropic clients wait before they send again, and gRPC's
retry pushback, which gRPC's own retries wait (RESOURCE_EXHAUSTED itself:
tests/test_serving_generate.py)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import requests
from llm_support import decoder_artifact, start, wait_for
from serving_support import scraped_metrics, slowed


@pytest.fixture(scope="module")
def server(reference_model, tmp_path_factory):
    out = decoder_artifact(tmp_path_factory.mktemp("full"),
                           reference_model("llama-kv", "awkward", "torchscript"))
    s = start(out, generate={"max_streams": 1, "max_queue": 1, "max_tokens": 200,
                             "speculate": 0})
    slowed(s, 0.03)  # a stream of 200 tokens runs ~6 s
    yield s
    s.stop(5)


@contextmanager
def _held(server):
    """The server running one stream and queueing another (streamed completions, closed
    at the end: their slots free at the next step); yields the two responses."""
    body = {"model": server.slot.name, "prompt": "hello", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    held = [requests.post(f"http://127.0.0.1:{server.http_port}/v1/completions", json=body,
                          stream=True, timeout=60) for _ in range(2)]
    try:
        assert wait_for(lambda: _occupancy(server) == (1, 1)), _occupancy(server)
        yield held
    finally:
        for r in held:
            r.close()
        assert wait_for(lambda: _occupancy(server) == (0, 0)), _occupancy(server)


@pytest.fixture
def full(server):
    with _held(server):
        yield server


def _occupancy(server) -> tuple[float, float]:
    scraped = scraped_metrics(server)
    return (scraped[("vllm:num_requests_running", ())],
            scraped[("vllm:num_requests_waiting", ())])


def test_openai_429_rate_limit_with_retry_after(full) -> None:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{full.http_port}/v1", api_key="x",
                           max_retries=0)
    with pytest.raises(openai.RateLimitError, match="the server is full") as e:
        client.completions.create(model=full.slot.name, prompt="hi", max_tokens=2)
    assert e.value.response.headers["retry-after"] == "1"


def test_anthropic_529_overloaded(full) -> None:
    """Anthropic's API answers its own overload 529 overloaded_error (429 is a caller's rate
    limit)."""
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{full.http_port}", api_key="x",
                                 max_retries=0)
    with pytest.raises(anthropic.OverloadedError, match="the server is full") as e:
        client.messages.create(model=full.slot.name, max_tokens=2,
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.response.headers["retry-after"] == "1"


def test_tgi_429_overloaded(full, monkeypatch) -> None:
    """TGI's `error_type` "overloaded", which huggingface_hub raises as OverloadedError."""
    from huggingface_hub import InferenceClient, constants
    from huggingface_hub.errors import OverloadedError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's offline mode
    client = InferenceClient(model=f"http://127.0.0.1:{full.http_port}", timeout=60)
    with pytest.raises(OverloadedError, match="the server is full"):
        client.text_generation("hi", max_new_tokens=2)


def test_ollama_503_server_busy(full) -> None:
    import ollama

    client = ollama.Client(host=f"http://127.0.0.1:{full.http_port}", timeout=60)
    with pytest.raises(ollama.ResponseError, match="the server is full") as e:
        client.generate(model=full.slot.name, prompt="hi", options={"num_predict": 2})
    assert e.value.status_code == 503


def test_triton_generate_429(full) -> None:
    r = requests.post(f"http://127.0.0.1:{full.http_port}/v2/models/{full.slot.name}/generate",
                      json={"text_input": "hi", "parameters": {"max_tokens": 2}}, timeout=60)
    assert r.status_code == 429 and "the server is full" in r.json()["error"]
    assert r.headers["retry-after"] == "1"


def test_grpc_retries_wait_the_pushback(server) -> None:
    """gRPC's own retries (a retryPolicy in the channel's service config, here through
    tritonclient's channel_args) wait the refusal's pushback (`grpc-retry-pushback-ms`, 1 s)
    instead of their own backoff (10 ms, which would find the server still full): the held
    streams closed meanwhile, the one retry is served."""
    import tritonclient.grpc as tg

    policy = {"methodConfig": [{"name": [{"service": "inference.GRPCInferenceService"}],
                                "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.01s",
                                                "maxBackoff": "0.01s", "backoffMultiplier": 1,
                                                "retryableStatusCodes": ["RESOURCE_EXHAUSTED"]}}]}
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}", channel_args=[
        ("grpc.service_config", json.dumps(policy)), ("grpc.enable_retries", 1)])
    text, tokens = tg.InferInput("text_input", [1], "BYTES"), tg.InferInput("max_tokens", [1],
                                                                            "INT32")
    text.set_data_from_numpy(np.array([b"hi"], np.object_))
    tokens.set_data_from_numpy(np.array([2], np.int32))
    with _held(server) as held:
        threading.Timer(0.3, lambda: [r.close() for r in held]).start()
        began = time.monotonic()
        answer = client.infer(server.slot.name, [text, tokens])
        waited = time.monotonic() - began
    assert answer.as_numpy("text_output").size == 1 and waited >= 1.0, waited
