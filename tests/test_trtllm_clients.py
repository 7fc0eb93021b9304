"""Clients written for TensorRT-LLM's core model (`tensorrt_llm`, the model inside its
ensemble) against a decoder artifact, over real gRPC and HTTP (tritonclient): the tensors its
example client sends (input_ids INT32 [1, n], input_lengths, request_output_len UINT32,
beam_width, temperature, streaming), read as it reads them (output_ids [1, beam, n], a
search's every beam); its
`stop` request cancelling a running one by request id; its core benchmark's unary HTTP
requests (end_id -1); the packed stop / bad word lists, embedding_bias, log-probs and
TensorRT-LLM's greedy-unless-top-k-or-top-p rule, each against ONNX Runtime's own logits
(its ensemble's client and batches of prompts: tests/test_trtllm_batches.py)."""

from __future__ import annotations

import queue

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import greedy, llama, log_softmax, wait_for  # noqa: F401
from trtllm_support import (LONG, Stream, beams_of, example_inputs, fresh_pair, pack,
                            prompt_ids, slow, stop_inputs, tensor, unary)
from tritonclient.utils import InferenceServerException


def test_the_example_clients_stream_is_greedy_new_tokens_per_response(server, llama) -> None:
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 8)
    s = Stream(server)
    s.send(server.slot.name, example_inputs(prompt, 8, True), "12345")
    results = s.close()
    actual = list(prompt)  # the client starts from its prompt and adds each response's beam 0
    for r in results:
        out = r.as_numpy("output_ids")
        assert out.dtype == np.int32 and out.ndim == 3 and out.shape[:2] == (1, 1)
        assert r.as_numpy("sequence_length").tolist() == [[out.shape[2]]]
        assert r.get_response().id == "12345"
        actual += list(out[0][0])
    # temperature 1 without a top-k or top-p is greedy there, and so here
    assert actual == prompt + want
    assert [r.get_response().parameters["triton_final_response"].bool_param
            for r in results] == [False] * (len(results) - 1) + [True]
    assert results[0].as_numpy("text_output") is None  # the core model sends no text


def test_unary_answers_the_whole_sequence_with_the_prompt_unless_excluded(server,
                                                                         llama) -> None:
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 6)
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    done: queue.Queue = queue.Queue()
    client.async_infer(server.slot.name, example_inputs(prompt, 6, False), request_id="7",
                       callback=lambda result, error: done.put((result, error)),
                       parameters={"Streaming": False})
    result, error = done.get(timeout=60)
    assert error is None, error
    beams = result.as_numpy("output_ids")[0]
    assert [list(b) for b in beams] == [prompt + want]
    assert result.as_numpy("sequence_length").tolist() == [[len(prompt) + 6]]
    excluded = client.infer(server.slot.name, example_inputs(
        prompt, 6, False, exclude_input_in_output=np.array([[True]], bool)))
    assert excluded.as_numpy("output_ids").tolist() == [[want]]
    client.close()


def test_the_core_benchmarks_http_requests(server, llama) -> None:
    """Its benchmark: input_ids, input_lengths and request_output_len INT32 and end_id -1
    (never stop), unary over HTTP; input_lengths cuts the ids."""
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt[:4], 5)
    client = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    inputs = [tensor(th, "input_ids", np.array([prompt], np.int32)),
              tensor(th, "input_lengths", np.array([[4]], np.int32)),
              tensor(th, "request_output_len", np.array([[5]], np.int32)),
              tensor(th, "end_id", np.array([[-1]], np.int32))]
    result = client.async_infer(server.slot.name, inputs, request_id="0").get_result()
    assert result.as_numpy("output_ids").tolist() == [[prompt[:4] + want]]
    client.close()


def test_a_stop_request_cancels_the_running_one_by_its_id(server) -> None:
    s = Stream(server)
    with slow(server):
        s.send(server.slot.name, example_inputs(prompt_ids(), LONG, True), "stop-me")
        first, error = s.got.get(timeout=60)
        assert error is None and server.slot.engine.active() == 1
        s.got.put((first, None))
        s.send(server.slot.name, stop_inputs(), "stop-me", Streaming=True)
        results = s.close()
    answer = [r for r in results if r.as_numpy("output_ids") is None]
    assert len(answer) == 1  # the stop request's own answer: no outputs, final
    assert answer[0].get_response().parameters["triton_final_response"].bool_param
    generated = [r for r in results if r.as_numpy("output_ids") is not None]
    last = generated[-1].get_response().parameters
    assert last["triton_final_response"].bool_param
    assert last["finish_reason"].string_param == "cancelled"
    assert sum(r.as_numpy("output_ids").shape[2] for r in generated) < LONG
    assert wait_for(lambda: server.slot.engine.active() == 0)


def test_a_stop_request_over_http_and_its_refusals(server) -> None:
    s = Stream(server)
    other = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    with slow(server):
        s.send(server.slot.name, example_inputs(prompt_ids(), LONG, False), "other")
        assert wait_for(lambda: server.slot.engine.active() == 1, 30)
        rest = th.InferenceServerClient(f"127.0.0.1:{server.http_port}")  # over HTTP
        answer = rest.infer(server.slot.name, stop_inputs(th), request_id="other")
        assert answer.as_numpy("output_ids") is None
        rest.close()
        (held,) = s.close()  # not streamed: one response, what was generated before the stop
    assert 0 < held.as_numpy("output_ids").shape[2] < len(prompt_ids()) + LONG
    with pytest.raises(InferenceServerException, match="A request id must be provided"):
        other.infer(server.slot.name, stop_inputs())
    # a stop for a request that has ended (or never ran) is answered all the same
    assert other.infer(server.slot.name, stop_inputs(), request_id="gone").as_numpy(
        "output_ids") is None
    other.close()


def test_stop_words_list_ends_on_the_sequence_and_sends_it(server, llama) -> None:
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 16)
    j = fresh_pair(want)
    never = [want[0], want[0], want[0], want[0]]  # a word greedy does not write
    got, result = unary(server, prompt, 16, stop_words_list=pack([never, want[j:j + 2]]))
    assert got == want[:j + 2]
    assert result.get_response().parameters["finish_reason"].string_param == "stop"
    assert unary(server, prompt, 16, stop_words_list=pack([never]))[0] == want
    # not before min_length
    held, _ = unary(server, prompt, 16, stop_words_list=pack([want[j:j + 2]]),
                     min_length=np.array([[j + 3]], np.int32))
    assert held[:j + 2] == want[:j + 2] and len(held) > j + 2


def test_bad_words_list_and_embedding_bias_against_onnx_runtimes_logits(server,
                                                                      llama) -> None:
    prompt = prompt_ids()
    want, logits = greedy(llama, prompt, 6)
    k = next(i for i in range(1, 6) if want[i] not in want[:i])
    banned, _ = unary(server, prompt, 6, bad_words_list=pack([[want[k]]]))
    assert banned[:k] == want[:k] and want[k] not in banned
    assert banned[k] == int(np.argsort(-logits[k])[1])  # the runner-up there
    # a bias that takes the likeliest first token down to below the runner-up
    bias = np.zeros([1, logits[0].size], np.float32)
    second = int(np.argsort(-logits[0])[1])
    bias[0, want[0]] = float(logits[0][second] - logits[0][want[0]]) - 1.0
    biased, _ = unary(server, prompt, 1, embedding_bias=bias)
    assert biased == [int(np.argmax(logits[0] + bias[0]))] == [second]


def test_log_probs_in_the_core_models_shapes(server, llama) -> None:
    prompt = prompt_ids()
    want, logits = greedy(llama, prompt, 5)
    expected = [float(log_softmax(row)[t]) for row, t in zip(logits, want)]
    _, result = unary(server, prompt, 5, return_log_probs=np.array([[True]], bool))
    np.testing.assert_allclose(result.as_numpy("output_log_probs"), [[expected]], atol=1e-3)
    assert result.as_numpy("cum_log_probs").shape == (1, 1)
    assert result.as_numpy("cum_log_probs")[0, 0] == pytest.approx(sum(expected), abs=1e-2)
    assert unary(server, prompt, 5)[1].as_numpy("output_log_probs") is None  # not asked


def test_sampling_with_a_top_k_is_seeded_and_greedy_without(server, llama) -> None:
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 8)
    top_k = {"runtime_top_k": np.array([[50]], np.int32),
             "random_seed": np.array([[7]], np.uint64)}
    first, _ = unary(server, prompt, 8, **top_k)
    assert first == unary(server, prompt, 8, **top_k)[0] != want
    assert unary(server, prompt, 8, runtime_top_k=np.array([[0]], np.int32))[0] == want


@pytest.mark.parametrize("extra, message", [
    ({"num_return_sequences": np.array([[2]], np.int32)},
     "'num_return_sequences' 2 is not supported: only 1 without a beam search"),
    ({"return_generation_logits": np.array([[True]], bool)}, "'return_generation_logits'"),
    ({"runtime_top_p_decay": np.array([[0.9]], np.float32)}, "'runtime_top_p_decay'"),
    ({"input_lengths": np.array([[99]], np.int32)}, "'input_lengths' 99"),
    ({"stop_words_list": np.array([[[5, 6], [3, -1]]], np.int32)}, "end offset"),
    ({"beam_width": np.array([[17]], np.uint32)}, "beam_width 17 is not supported: 1 to 16"),
    ({"beam_width": np.array([[2]], np.uint32), "return_log_probs": np.array([[True]], bool)},
     "beam search \\(2 beams\\) is greedy"),
    ({"beam_width": np.array([[2]], np.uint32),
      "beam_search_diversity_rate": np.array([[0.5]], np.float32)},
     "'beam_search_diversity_rate' 0.5 is not supported"),
    ({"beam_width": np.array([[2]], np.uint32),
      "num_return_sequences": np.array([[3]], np.int32)},
     "'num_return_sequences' 3 is not supported: 1 to the beam width \\(2\\)"),
])
def test_what_the_core_model_cannot_take_is_refused_by_name(server, extra, message) -> None:
    with pytest.raises(InferenceServerException, match=message):
        unary(server, prompt_ids(), 4, **extra)


def test_a_beam_width_answers_every_beam_best_first(server) -> None:
    """beam_width 3, as TensorRT-LLM answers it and its example client reads it (each row of
    output_ids[0] a beam): transformers' search's 3 best sequences, best first, in one
    response, output_ids [1, 3, n]; with an end_id that the search meets, the beams that end
    there shorter, their lengths in sequence_length, padded with the end id;
    num_return_sequences 2 the best two; len_penalty and early_stopping the search's own."""
    from test_decoder_beams import transformers_beams, transformers_returns

    prompt, width = prompt_ids(), {"beam_width": np.array([[3]], np.uint32)}
    got, result = unary(server, prompt, 6, **width)
    assert beams_of(result) == transformers_returns(prompt, 3, 6, returns=3)
    assert result.as_numpy("output_ids").shape == (1, 3, 6) and got == beams_of(result)[0]
    end = got[3]
    ended = {"end_id": np.array([[end]], np.int32), **width}
    want = transformers_returns(prompt, 3, 6, end, returns=3)
    assert len({len(w) for w in want}) > 1  # beams of different lengths
    _, result = unary(server, prompt, 6, **ended)
    assert beams_of(result) == want
    rows, lengths = result.as_numpy("output_ids")[0], result.as_numpy("sequence_length")[0]
    assert all((row[n:] == end).all() for row, n in zip(rows, lengths))
    _, result = unary(server, prompt, 6, num_return_sequences=np.array([[2]], np.int32),
                      **ended)
    assert beams_of(result) == want[:2]
    end = got[2]
    settings = {"len_penalty": np.array([[2.0]], np.float32),  # the search's own settings
                "early_stopping": np.array([[True]], bool), "end_id": np.array([[end]], np.int32)}
    got, _ = unary(server, prompt, 6, **width, **settings)
    assert got == transformers_beams(prompt, 3, 6, end, length_penalty=2.0, early_stopping=True)


def test_core_names_need_request_output_len_and_beam_only_controls_are_taken(server,
                                                                             llama) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    with pytest.raises(InferenceServerException, match="needs 'request_output_len'"):
        client.infer(server.slot.name, [tensor(tg, "input_ids", np.array([[1, 2]], np.int32)),
                                        tensor(tg, "streaming", np.array([[False]], bool))])
    client.close()
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 4)
    beam = {"len_penalty": np.array([[1.5]], np.float32),
            "early_stopping": np.array([[True]], bool),
            "beam_search_diversity_rate": np.array([[0.5]], np.float32)}
    assert unary(server, prompt, 4, **beam)[0] == want  # nothing to do at beam width 1


def test_config_declares_the_core_inputs_optional(server) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    config = client.get_model_config(server.slot.name, as_json=True)["config"]
    inputs = {i["name"]: i for i in config["input"]}
    for name in ("input_lengths", "request_output_len", "streaming", "stop",
                 "stop_words_list", "bad_words_list", "embedding_bias"):
        assert inputs[name].get("optional") is True, name
    client.close()


def test_word_lists_unpack_as_tensorrt_llm_packs_them() -> None:
    from serving.errors import InvalidArgument
    from serving.trtllm_core import read, sampling_rule

    base = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    packed = pack([[5, 6], [7], [8, 9, 10]])
    assert read({**base, "stop_words_list": packed}).stop_sequences == ((5, 6), (7,), (8, 9, 10))
    assert read({**base, "bad_words_list": packed[0]}).bad_words[1] == (7,)  # [2, n] too
    assert read({**base, "stop_words_list": np.zeros([1, 2, 0], np.int32)}).stop_sequences == ()
    with pytest.raises(InvalidArgument, match="must be \\[1, 2, n\\]"):
        read({**base, "stop_words_list": np.array([[5, 6, 7]], np.int32)})
    with pytest.raises(InvalidArgument, match="must be integers"):
        read({**base, "bad_words_list": packed.astype(np.float32)})
    # greedy unless a top-k or a top-p; sampling at temperature 1 unless given
    assert sampling_rule({"temperature": 0.8})["temperature"] == 0.0
    assert sampling_rule({"top_k": 4}) == {"top_k": 4, "temperature": 1.0}
    assert sampling_rule({"top_p": 0.0, "temperature": 0.5}) == {"temperature": 0.0}
    assert sampling_rule({"top_p": 0.9, "temperature": 0.5})["temperature"] == 0.5
    assert sampling_rule({"temperature": -1.0})["temperature"] == -1.0  # left to be refused


def test_stop_during_many_streams_cancels_only_its_own(server, llama) -> None:
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 12)
    s = Stream(server)
    with slow(server):
        s.send(server.slot.name, example_inputs(prompt, LONG, True), "a")
        s.send(server.slot.name, example_inputs(prompt, 12, True), "b")
        assert wait_for(lambda: server.slot.engine.active() == 2, 30)
        s.send(server.slot.name, stop_inputs(), "a")
        results = s.close()
    by_id: dict[str, list[int]] = {"a": [], "b": []}
    for r in results:
        out = r.as_numpy("output_ids")
        if out is not None:
            by_id[r.get_response().id] += out[0][0].tolist()
    assert by_id["b"] == want and len(by_id["a"]) < LONG
