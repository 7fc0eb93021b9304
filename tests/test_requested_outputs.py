"""A decoder answers with the outputs a request names (KServe v2's `outputs`: those, in that
order; none named: all), through real tritonclient over gRPC (streamed and unary) and HTTP:
the tokens are the same either way, a name the model never answers with is refused by name
before anything runs, and one that the request's flags leave out (a `return_*` output not
asked for) stays out rather than failing the request."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import PROMPT, greedy, llama, tokenizer  # noqa: F401
from tritonclient.utils import InferenceServerException


def _inputs(module, tokens: int) -> list:
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], object))
    n = module.InferInput("max_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([tokens], np.int32))
    return [text, n]


def _streamed(server, outputs: list[str] | None, tokens: int = 6) -> list:
    """Every response of one streamed request, each as {output name: array}."""
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        asked = None if outputs is None else [tg.InferRequestedOutput(n) for n in outputs]
        client.async_stream_infer(server.slot.name, _inputs(tg, tokens), outputs=asked)
        responses = []
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                raise error
            response = result.get_response()
            responses.append({o.name: result.as_numpy(o.name) for o in response.outputs})
            if response.parameters["triton_final_response"].bool_param:
                return responses
    finally:
        client.stop_stream()
        client.close()


def _ids(responses: list) -> list[int]:
    return [t for r in responses for t in r["output_ids"].reshape(-1).tolist()]


def test_a_streamed_request_gets_only_the_outputs_it_names(server, llama) -> None:
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 6)
    everything = _streamed(server, None)
    assert {"output_ids", "text_output", "sequence_length"} <= set(everything[0])
    named = _streamed(server, ["sequence_length", "output_ids"])
    assert all(list(r) == ["sequence_length", "output_ids"] for r in named)
    assert _ids(named) == _ids(everything) == want
    assert [int(r["sequence_length"][0]) for r in named] == list(range(1, 7))
    # asked for, but its flag (return_num_input_tokens) not set: left out, not an error
    quiet = _streamed(server, ["output_ids", "num_input_tokens"])
    assert all(list(r) == ["output_ids"] for r in quiet) and _ids(quiet) == want


def test_an_output_the_model_never_answers_with_is_refused_by_name(server) -> None:
    with pytest.raises(InferenceServerException, match="unexpected inference output 'logits'"):
        _streamed(server, ["output_ids", "logits"])
    client = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    with pytest.raises(InferenceServerException, match="unexpected inference output 'logits'"):
        client.infer(server.slot.name, _inputs(th, 2),
                     outputs=[th.InferRequestedOutput("logits")])
    assert server.slot.engine.active() == 0


def test_unary_grpc_and_http_get_only_the_outputs_they_name(server, llama) -> None:
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 5)
    grpc = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    one = grpc.infer(server.slot.name, _inputs(tg, 5),
                     outputs=[tg.InferRequestedOutput("output_ids")])
    assert [o.name for o in one.get_response().outputs] == ["output_ids"]
    assert one.as_numpy("output_ids").reshape(-1).tolist() == want
    http = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    got = http.infer(server.slot.name, _inputs(th, 5),
                     outputs=[th.InferRequestedOutput("text_output", binary_data=False)])
    assert [o["name"] for o in got.get_response()["outputs"]] == ["text_output"]
    assert got.as_numpy("text_output")[0] == tokenizer().decode(want)  # JSON: a str
