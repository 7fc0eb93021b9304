"""LangChain's client for Triton + TensorRT-LLM (`TritonTensorRTLLM` of the
langchain-nvidia-trt package), unchanged, in an environment of its own (it pins protobuf
< 4 and langchain-core's pydantic v1 namespace), against a decoder served under the name
its users give it (`ensemble`): it sends the ensemble's names (`top_k` 1, `top_p` 0,
`length_penalty`, temperature 1: greedy, as TensorRT-LLM reads them), always on a stream,
reads `text_output` and `triton_final_response`, and cancels a generation it stops early
(at one of its stop words) with a `stop` request to the model `tensorrt_llm`."""

from __future__ import annotations

import json
import subprocess

import pytest
from llm_support import (PROMPT, decoder_artifact, greedy, llama, start,  # noqa: F401
                         tokenizer, wait_for)
from serving_support import scraped_metrics, slowed

from models.venvs import ensure_venv

VENV = ("langchain-trt", ("langchain-nvidia-trt==0.0.1rc0", "langchain-core>=0.2,<0.3"))
pytestmark = pytest.mark.venv(*VENV)  # built beside the first tests (conftest)

# The client's last act, its `__del__` closing the gRPC channel while the interpreter shuts
# down, once kept a CI run's process alive past 120 s after it had printed every answer
# (its streams were closed by then: each call joins its stream's end), so the script ends
# the process itself once the answers are out
CLIENT = """
import json, os, sys
from langchain_nvidia_trt.llms import TritonTensorRTLLM
url, prompt, tokens, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
llm = TritonTensorRTLLM(server_url=url, model_name="ensemble", tokens=tokens, stop=stop)
print(json.dumps({"invoke": llm.invoke(prompt), "stream": list(llm.stream(prompt))}),
      flush=True)
os._exit(0)
"""


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):  # noqa: F811
    s = start(decoder_artifact(tmp_path_factory.mktemp("lc-trt"), llama), model_name="ensemble",
              generate={"max_streams": 4, "max_tokens": 64})
    yield s
    s.stop(5)


def _client(server, tokens: int, stop: list[str]) -> dict:
    python = ensure_venv(*VENV)
    r = subprocess.run([str(python), "-P", "-c", CLIENT, f"127.0.0.1:{server.port}", PROMPT,
                        str(tokens), json.dumps(stop)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_invoke_and_stream_are_greedy(server, llama) -> None:  # noqa: F811
    want = tokenizer().decode(greedy(llama, tokenizer().encode(PROMPT).ids, 8)[0])
    got = _client(server, 8, [])
    assert got["invoke"] == PROMPT + want  # not streamed: the prompt first, as the ensemble
    assert "".join(got["stream"]) == want and len(got["stream"]) > 1


def _aborted(server) -> float:
    return scraped_metrics(server).get(("vllm:request_success_total",
                                        (("finished_reason", "abort"),)), 0.0)


def test_a_stop_word_ends_the_stream_and_its_stop_request_frees_the_slot(server,
                                                                         llama) -> None:  # noqa: F811
    """The client stops reading at a streamed piece equal to one of its stop words and sends
    `stop` (to `tensorrt_llm`, the request's id): the server cancels the generation."""
    ids, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 12)
    pieces = [tokenizer().decode(ids[:k + 1])[len(tokenizer().decode(ids[:k])):]
              for k in range(12)]
    k = next(k for k in range(1, 12) if pieces[k] and pieces[k] not in pieces[:k])
    before = _aborted(server)
    generator, fast = slowed(server, 0.02)  # 60 tokens: over a second, so the stop lands
    try:
        got = _client(server, 60, [pieces[k]])
        assert wait_for(lambda: server.slot.engine.active() == 0, 30)
    finally:
        generator.runner = fast
    assert "".join(got["stream"]) == "".join(pieces[:k])
    # the streamed generation was cancelled (not run to its 60 tokens: the client's
    # stop_stream waits for the server to end it), its invoke ran whole
    assert _aborted(server) == before + 1
