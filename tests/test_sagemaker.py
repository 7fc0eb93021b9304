"""Amazon SageMaker's container contract (serving/http/sagemaker.py), with the bodies
SageMaker's runtime forwards as they came (JSON, `InvokeEndpointWithResponseStream` reading
the same bytes as a stream): `/ping`, and `/invocations` routing each body to the API that
takes it, answered as that API answers at its own path, the model's own greedy text, errors
in that API's shape; and the image's entrypoint started as SageMaker starts a container
(deploy/docker-entrypoint.sh: `serve`, the model's folder, port 8080's variable, options
from SM_TUNER_* variables)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from llm_support import (CHAT, NO_EOS, PROMPT, decoder, decoder_artifact, greedy,  # noqa: F401
                         llama, rendered_ids, start, tokenizer)
from serving_support import free_port

ENTRYPOINT = Path(__file__).resolve().parent.parent / "deploy" / "docker-entrypoint.sh"

NEW = 8


def _post(port: int, path: str, body: dict, stream: bool = False) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=60,
                         stream=stream)


def _greedy_text(llama, ids: list[int]) -> str:
    return tokenizer().decode(greedy(llama, ids, NEW)[0])


def test_ping_answers_as_health_does(decoder) -> None:
    for method in (requests.get, requests.post):
        assert method(f"http://127.0.0.1:{decoder.http_port}/ping", timeout=10).status_code == 200


def test_chat_and_completion_bodies_answer_as_the_openai_api(decoder, llama) -> None:
    chat = {"messages": CHAT, "max_tokens": NEW, "temperature": 0, **NO_EOS}
    got = _post(decoder.http_port, "/invocations", chat).json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"]["content"] == _greedy_text(llama, rendered_ids(CHAT))
    direct = _post(decoder.http_port, "/v1/chat/completions", chat).json()
    assert got["choices"] == direct["choices"]  # (the second one finds the first's prefix)
    assert got["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    completion = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, **NO_EOS}
    got = _post(decoder.http_port, "/invocations", completion).json()
    assert got["object"] == "text_completion"
    assert got["choices"][0]["text"] == _greedy_text(llama, tokenizer().encode(PROMPT).ids)


def test_a_streamed_chat_body_streams_server_sent_events(decoder, llama) -> None:
    body = {"messages": CHAT, "max_tokens": NEW, "temperature": 0, "stream": True, **NO_EOS}
    with _post(decoder.http_port, "/invocations", body, stream=True) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                   for e in events[:-1] if json.loads(e)["choices"])
    assert text == _greedy_text(llama, rendered_ids(CHAT))


def test_an_inputs_body_answers_as_text_generation_inference(decoder, llama) -> None:
    want = _greedy_text(llama, tokenizer().encode(PROMPT).ids)
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": NEW, **NO_EOS}}
    assert _post(decoder.http_port, "/invocations", body).json() == [{"generated_text": want}]
    with _post(decoder.http_port, "/invocations", {**body, "stream": True}, stream=True) as r:
        events = [json.loads(line[len("data:"):]) for line in r.iter_lines(decode_unicode=True)
                  if line.startswith("data:")]
    assert len(events) == NEW and events[-1]["generated_text"] == want


@pytest.mark.parametrize("body, status, says", [
    ({"messages": "hello"}, 400, "'messages' must be"),  # OpenAI's error object
    ({"inputs": PROMPT, "parameters": {"best_of": 2}}, 422, "best_of"),  # TGI's
    ({"input": ["a fox"]}, 400, "embeddings come from an encoder"),  # asked of a decoder
    ({"text": "hello"}, 400, "the body names no API"),
])
def test_errors_come_in_the_chosen_apis_shape(decoder, body, status, says) -> None:
    r = _post(decoder.http_port, "/invocations", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert says in message, message
    if status == 422:
        assert r.json()["error_type"] == "validation"


def test_a_query_body_reranks_as_the_rerank_api(cross_encoder_artifact) -> None:
    server = start(cross_encoder_artifact)
    try:
        body = {"query": "Where do foxes live?",
                "documents": ["Foxes live in forests.", "The dog sleeps all day."]}
        got = _post(server.http_port, "/invocations", body)
        assert got.status_code == 200, got.text
        direct = _post(server.http_port, "/v1/rerank", body).json()
        assert got.json()["results"] == direct["results"]
    finally:
        server.stop(5)


def _ping(port: int) -> int | None:
    try:
        return requests.get(f"http://127.0.0.1:{port}/ping", timeout=5).status_code
    except requests.ConnectionError:
        return None


def test_the_entrypoint_serves_on_sagemakers_terms(llama, tmp_path) -> None:
    """`docker run IMAGE serve`, as SageMaker runs it: the artifact from SM_MODEL_DIR, HTTP on
    SAGEMAKER_BIND_TO_PORT, SM_TUNER_* as options (a value, and `true` for a bare flag); the
    test's own arguments after `serve` keep it on loopback without gRPC or a metrics port."""
    port = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SM_MODEL_DIR": str(decoder_artifact(tmp_path, llama)),
           "SAGEMAKER_BIND_TO_PORT": str(port), "SM_TUNER_MAX_STREAMS": "2",
           "SM_TUNER_SPIN": "true"}
    proc = subprocess.Popen(["sh", str(ENTRYPOINT), "serve", "--host", "127.0.0.1", "--port",
                             "-1", "--metrics-port", "-1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while _ping(port) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.2)
        # (exec: the entrypoint's process is the server's)
        argv = Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0")
        assert argv[argv.index("--max-streams") + 1] == "2" and "--spin" in argv
        body = {"messages": CHAT, "max_tokens": NEW, "temperature": 0, **NO_EOS}
        got = _post(port, "/invocations", body).json()
        assert got["choices"][0]["message"]["content"] == _greedy_text(llama,
                                                                        rendered_ids(CHAT))
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def test_the_entrypoint_passes_any_other_arguments_to_tuner_serve() -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run(["sh", str(ENTRYPOINT), "--help"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "Usage: tuner serve" in r.stdout, r.stderr
