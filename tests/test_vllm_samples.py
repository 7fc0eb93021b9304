"""The vLLM backend's `n` (serving/samples.py): n samples of one prompt answered in rows, as
that backend answers (`text_output` [n] in every response, a sample's new text at its index,
the outputs asked for a row per sample), over real tritonclient gRPC (streamed and not) and
Triton's generate endpoints over HTTP. Each sample equals a request of n 1 with its seed
(seed + i), run alone."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import PROMPT, llama  # noqa: F401
from test_llm_conventions import _llm_infer, _scalar, _vllm_inputs, stream, texts
from tritonclient.utils import InferenceServerException

SAMPLING = {"temperature": "1", "seed": 11, "max_tokens": "6", "ignore_eos": True}
ASKED = dict(return_finish_reason=True, return_cumulative_logprob=True,
             return_num_input_tokens=True, return_num_output_tokens=True)


def _alone(server, seed: int) -> tuple[str, float]:
    """One sample of n 1 with this seed: its text and cumulative log-probability."""
    results = _llm_infer(server, _vllm_inputs(True, {**SAMPLING, "seed": seed},
                                              return_cumulative_logprob=True), {})
    return "".join(texts(results)), float(results[-1].as_numpy("cumulative_logprob")[0])


def test_n_samples_stream_in_rows_each_equal_to_its_seed_alone(server) -> None:
    """n 3 streamed: every response has 3 rows, a sample's new text at its index (empty
    elsewhere, 0 new tokens there); the final flag on the last response only; each sample's
    text, token count, cumulative log-prob and finish reason are those of n 1 with seed
    11 + i."""
    alone = [_alone(server, 11 + i) for i in range(3)]
    assert len({text for text, _ in alone}) == 3
    results = stream(server, _vllm_inputs(True, {**SAMPLING, "n": 3}, **ASKED))
    rows = [r.as_numpy("text_output") for r in results]
    assert all(row.shape == (3,) for row in rows)
    # each response moves one sample (its own chunk)
    assert all(sum(x != b"" for x in row) <= 1 for row in rows)
    got = ["".join(row[i].decode() for row in rows) for i in range(3)]
    assert got == [text for text, _ in alone]
    counts = np.stack([r.as_numpy("num_output_tokens") for r in results])
    assert counts.sum(axis=0).tolist() == [6, 6, 6]
    assert all(r.as_numpy("num_input_tokens").shape == (1,) for r in results)
    np.testing.assert_allclose(results[-1].as_numpy("cumulative_logprob"),
                               [lp for _, lp in alone], atol=1e-4)
    assert [x.decode() for x in results[-1].as_numpy("finish_reason")] == ["length"] * 3
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False] * (len(results) - 1) + [True]


def test_n_samples_whole_is_one_response_with_the_prompt_first(server) -> None:
    """Not streamed: one response of the 3 whole texts, each after the prompt (the vLLM
    backend's default without exclude_input_in_output)."""
    alone = [_alone(server, 11 + i)[0] for i in range(3)]
    (result,) = _llm_infer(server, _vllm_inputs(False, {**SAMPLING, "n": 3},
                                                return_finish_reason=True), {})
    assert [x.decode() for x in result.as_numpy("text_output")] == [PROMPT + t for t in alone]
    assert [x.decode() for x in result.as_numpy("finish_reason")] == ["length"] * 3


def test_n_over_triton_generate_endpoints(server) -> None:
    """Triton's generate (one JSON response) and generate_stream (an SSE event per chunk,
    each with n rows), n as a parameter, as a vLLM backend's HTTP client sends it."""
    alone = [_alone(server, 11 + i)[0] for i in range(2)]
    base = f"http://127.0.0.1:{server.http_port}/v2/models/{server.slot.name}"
    body = {"text_input": PROMPT, "parameters": {**SAMPLING, "n": 2, "stream": False,
                                                 "exclude_input_in_output": True}}
    assert _post(f"{base}/generate", body)[0]["text_output"] == alone
    body["parameters"]["stream"] = True
    events = _post(f"{base}/generate_stream", body)
    assert len(events) > 2 and all(len(e["text_output"]) == 2 for e in events)
    assert ["".join(e["text_output"][i] for e in events) for i in range(2)] == alone


def _post(url: str, body: dict) -> list[dict]:
    """The JSON answer, or each Server-Sent Event's data, of a POST (stdlib only)."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        lines = [line.strip() for line in answer]
    if lines[0].startswith(b"data: "):
        return [json.loads(line[len(b"data: "):]) for line in lines if line]
    return [json.loads(b"".join(lines))]


def test_n_that_cannot_be_sampled_is_refused(server) -> None:
    for sampling, message in (({"n": 0}, "'n' must be between 1 and 4 .*not 0"),
                              ({"n": 5}, "'n' must be between 1 and 4 .*not 5")):
        with pytest.raises(InferenceServerException, match=message):
            stream(server, _vllm_inputs(True, {**SAMPLING, **sampling}))
    with pytest.raises(InferenceServerException, match="'n' with a beam search"):
        stream(server, _vllm_inputs(True, {**SAMPLING, "n": 2}) + [
            _scalar("beam_width", 2, "INT32")])
