"""Clients written for TensorRT-LLM's Triton backend against a decoder artifact, over real
gRPC and HTTP (tritonclient). Its ensemble's example client: temperature 1 by default and
greedy all the same (TensorRT-LLM samples only with a top-k or top-p), bias words. Its core
model (`tensorrt_llm`, the model inside the ensemble): the tensors its example client sends (input_ids INT32 [1, n], input_lengths, request_output_len UINT32,
beam_width, temperature, streaming), read as it reads them (output_ids [1, beam, n]); its
`stop` request cancelling a running one by request id; its core benchmark's unary HTTP
requests (end_id -1); the packed stop / bad word lists, embedding_bias, log-probs and
TensorRT-LLM's greedy-unless-top-k-or-top-p rule, each against ONNX Runtime's own logits."""

from __future__ import annotations

import queue
from contextlib import contextmanager

import numpy as np
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import PROMPT, greedy, llama, log_softmax, tokenizer, wait_for  # noqa: F401
from serving_support import slowed
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

LONG = 60  # tokens: a generation that runs long enough to be stopped


def _tensor(module, name: str, array: np.ndarray):
    made = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    made.set_data_from_numpy(array)
    return made


def example_inputs(prompt: list[int], tokens: int, streaming: bool, module=tg, **extra):
    """What TensorRT-LLM's example client sends: every control [1, 1], its dtypes."""
    arrays = {"input_ids": np.array([prompt], np.int32),
              "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[tokens]], np.uint32),
              "beam_width": np.array([[1]], np.uint32),
              "temperature": np.array([[1.0]], np.float32),
              "streaming": np.array([[streaming]], bool), **extra}
    return [_tensor(module, n, a) for n, a in arrays.items()]


def stop_inputs(module=tg):
    """Its stop request: a placeholder prompt, nothing to generate, `stop` true."""
    return [_tensor(module, "input_ids", np.empty([1, 1], np.int32)),
            _tensor(module, "input_lengths", np.zeros([1, 1], np.int32)),
            _tensor(module, "request_output_len", np.array([[0]], np.uint32)),
            _tensor(module, "stop", np.array([[True]], bool))]


class Stream:
    """A tritonclient gRPC stream whose responses (or errors) queue up."""

    def __init__(self, server) -> None:
        self.client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))

    def send(self, model: str, inputs, request_id: str, **parameters) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id,
                                       parameters=parameters or None)

    def close(self) -> list:
        """Wait for the server to end the stream (as the example client does); every
        response, an error raised."""
        self.client.stop_stream()
        self.client.close()
        out = []
        while not self.got.empty():
            result, error = self.got.get()
            if error is not None:
                raise error
            out.append(result)
        return out


@contextmanager
def slow(server):
    """Decode steps of 10 ms: a stop request lands while its target still runs."""
    generator, fast = slowed(server, 0.01)
    try:
        yield
    finally:
        generator.runner = fast


def prompt_ids() -> list[int]:
    return tokenizer().encode(PROMPT).ids


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
    inputs = [_tensor(th, "input_ids", np.array([prompt], np.int32)),
              _tensor(th, "input_lengths", np.array([[4]], np.int32)),
              _tensor(th, "request_output_len", np.array([[5]], np.int32)),
              _tensor(th, "end_id", np.array([[-1]], np.int32))]
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


def pack(words: list[list[int]]) -> np.ndarray:
    """A word list as TensorRT-LLM packs it: [1, 2, n], ids then end offsets, -1 padded."""
    ids = [t for w in words for t in w]
    ends = np.cumsum([len(w) for w in words]).tolist()
    return np.array([[ids, ends + [-1] * (len(ids) - len(ends))]], np.int32)


def _unary(server, prompt: list[int], tokens: int, **extra) -> tuple[list[int], object]:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    result = client.infer(server.slot.name, example_inputs(
        prompt, tokens, False, exclude_input_in_output=np.array([[True]], bool), **extra))
    client.close()
    return result.as_numpy("output_ids")[0][0].tolist(), result


def _fresh_pair(want: list[int]) -> int:
    """A position j whose pair (want[j], want[j + 1]) does not occur before it."""
    return next(j for j in range(1, len(want) - 1)
                if (want[j], want[j + 1]) not in zip(want[:j], want[1:j + 1]))


def test_stop_words_list_ends_on_the_sequence_and_sends_it(server, llama) -> None:
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 16)
    j = _fresh_pair(want)
    never = [want[0], want[0], want[0], want[0]]  # a word greedy does not write
    got, result = _unary(server, prompt, 16, stop_words_list=pack([never, want[j:j + 2]]))
    assert got == want[:j + 2]
    assert result.get_response().parameters["finish_reason"].string_param == "stop"
    assert _unary(server, prompt, 16, stop_words_list=pack([never]))[0] == want
    # not before min_length
    held, _ = _unary(server, prompt, 16, stop_words_list=pack([want[j:j + 2]]),
                     min_length=np.array([[j + 3]], np.int32))
    assert held[:j + 2] == want[:j + 2] and len(held) > j + 2


def test_bad_words_list_and_embedding_bias_against_onnx_runtimes_logits(server,
                                                                      llama) -> None:
    prompt = prompt_ids()
    want, logits = greedy(llama, prompt, 6)
    k = next(i for i in range(1, 6) if want[i] not in want[:i])
    banned, _ = _unary(server, prompt, 6, bad_words_list=pack([[want[k]]]))
    assert banned[:k] == want[:k] and want[k] not in banned
    assert banned[k] == int(np.argsort(-logits[k])[1])  # the runner-up there
    # a bias that takes the likeliest first token down to below the runner-up
    bias = np.zeros([1, logits[0].size], np.float32)
    second = int(np.argsort(-logits[0])[1])
    bias[0, want[0]] = float(logits[0][second] - logits[0][want[0]]) - 1.0
    biased, _ = _unary(server, prompt, 1, embedding_bias=bias)
    assert biased == [int(np.argmax(logits[0] + bias[0]))] == [second]


def test_log_probs_in_the_core_models_shapes(server, llama) -> None:
    prompt = prompt_ids()
    want, logits = greedy(llama, prompt, 5)
    expected = [float(log_softmax(row)[t]) for row, t in zip(logits, want)]
    _, result = _unary(server, prompt, 5, return_log_probs=np.array([[True]], bool))
    np.testing.assert_allclose(result.as_numpy("output_log_probs"), [[expected]], atol=1e-3)
    assert result.as_numpy("cum_log_probs").shape == (1, 1)
    assert result.as_numpy("cum_log_probs")[0, 0] == pytest.approx(sum(expected), abs=1e-2)
    assert _unary(server, prompt, 5)[1].as_numpy("output_log_probs") is None  # not asked


def test_sampling_with_a_top_k_is_seeded_and_greedy_without(server, llama) -> None:
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 8)
    top_k = {"runtime_top_k": np.array([[50]], np.int32),
             "random_seed": np.array([[7]], np.uint64)}
    first, _ = _unary(server, prompt, 8, **top_k)
    assert first == _unary(server, prompt, 8, **top_k)[0] != want
    assert _unary(server, prompt, 8, runtime_top_k=np.array([[0]], np.int32))[0] == want


@pytest.mark.parametrize("extra, message", [
    ({"num_return_sequences": np.array([[2]], np.int32)}, "'num_return_sequences' 2"),
    ({"return_generation_logits": np.array([[True]], bool)}, "'return_generation_logits'"),
    ({"runtime_top_p_decay": np.array([[0.9]], np.float32)}, "'runtime_top_p_decay'"),
    ({"input_lengths": np.array([[99]], np.int32)}, "'input_lengths' 99"),
    ({"stop_words_list": np.array([[[5, 6], [3, -1]]], np.int32)}, "end offset"),
    ({"beam_width": np.array([[2]], np.uint32)}, "beam_width 2"),
])
def test_what_the_core_model_cannot_take_is_refused_by_name(server, extra, message) -> None:
    with pytest.raises(InferenceServerException, match=message):
        _unary(server, prompt_ids(), 4, **extra)


def test_core_names_need_request_output_len_and_beam_only_controls_are_taken(server,
                                                                             llama) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    with pytest.raises(InferenceServerException, match="needs 'request_output_len'"):
        client.infer(server.slot.name, [_tensor(tg, "input_ids", np.array([[1, 2]], np.int32)),
                                        _tensor(tg, "streaming", np.array([[False]], bool))])
    client.close()
    prompt = prompt_ids()
    want, _ = greedy(llama, prompt, 4)
    beam = {"len_penalty": np.array([[1.5]], np.float32),
            "early_stopping": np.array([[True]], bool),
            "beam_search_diversity_rate": np.array([[0.5]], np.float32)}
    assert _unary(server, prompt, 4, **beam)[0] == want  # nothing to do at beam width 1


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


# ---------------------------------------------------------------- the ensemble's client


def ensemble_request(tokens: int, **extra) -> list:
    """What TensorRT-LLM's ensemble example client sends: [1, 1] tensors, temperature 1
    (its default), streaming off, the prompt in the output."""
    arrays = {"text_input": np.array([[PROMPT.encode()]], object),
              "max_tokens": np.array([[tokens]], np.int32),
              "stream": np.array([[False]], bool), "beam_width": np.array([[1]], np.int32),
              "temperature": np.array([[1.0]], np.float32),
              "exclude_input_in_output": np.array([[False]], bool), **extra}
    made = []
    for name, array in arrays.items():
        made.append(tg.InferInput(name, list(array.shape), "BYTES" if array.dtype == object
                                  else np_to_triton_dtype(array.dtype)))
        made[-1].set_data_from_numpy(array)
    return made


def ensemble_text(server, **extra) -> list[str]:
    """The one response's text_output of a request on a stream, as that client reads it."""
    s = Stream(server)
    s.send(server.slot.name, ensemble_request(**extra), "")
    (result,) = s.close()
    return [t.decode() for t in result.as_numpy("text_output").reshape(-1)]


def test_the_ensemble_clients_temperature_1_is_greedy_as_tensorrt_llm(server, llama) -> None:
    """TensorRT-LLM samples only with a runtime_top_k or runtime_top_p above 0 (its decoder
    falls back to top-k 1): its example client checks its outputs at temperature 1."""
    want, _ = greedy(llama, prompt_ids(), 8)
    whole = ensemble_text(server, tokens=8)
    assert whole == [PROMPT + tokenizer().decode(want)]
    top_k = {"runtime_top_k": np.array([[50]], np.int32),
             "random_seed": np.array([[3]], np.uint64)}
    sampled = [ensemble_text(server, tokens=8, **top_k) for _ in range(2)]
    assert sampled[0] == sampled[1] != whole


def test_the_ensembles_bias_words_and_shared_core_names(server, llama) -> None:
    """embedding_bias_words / _weights: each token of a word gets its weight (here: the
    greedy first token pushed below the runner-up); num_return_sequences 1 and beam search's
    own controls are taken, 2 sequences refused by name."""
    want, logits = greedy(llama, prompt_ids(), 1)
    second = int(np.argsort(-logits[0])[1])
    word = tokenizer().decode([want[0]])
    assert tokenizer().encode(word, add_special_tokens=False).ids == [want[0]]
    weight = float(logits[0][second] - logits[0][want[0]]) - 1.0
    extra = {"embedding_bias_words": np.array([[word.encode()]], object),
             "embedding_bias_weights": np.array([[weight]], np.float32),
             "num_return_sequences": np.array([[1]], np.int32),
             "len_penalty": np.array([[1.0]], np.float32),
             "exclude_input_in_output": np.array([[True]], bool)}
    assert ensemble_text(server, tokens=1, **extra) == [tokenizer().decode([second])]
    with pytest.raises(InferenceServerException, match="'num_return_sequences' 2"):
        ensemble_text(server, tokens=1, num_return_sequences=np.array([[2]], np.int32))


# ------------------------------------------------------------------ batches of prompts


OTHER = "A lazy dog sleeps"  # a second prompt for a batch


def test_the_ensemble_clients_batch_inputs_answer_per_row(server, llama) -> None:
    """Its `--batch-inputs`: every [1, 1] input stacked into [B, 1], `batch_index` asked
    for; each row's whole answer (not streamed: its prompt first) in a response of its own
    with its batch_index, triton_final_response on the request's last response only."""
    prompts = [PROMPT, OTHER]
    want = [p + tokenizer().decode(greedy(llama, tokenizer().encode(p).ids, 6)[0])
            for p in prompts]
    stacked = {"text_input": np.array([[p.encode()] for p in prompts], object),
               "max_tokens": np.array([[6], [6]], np.int32),
               "stream": np.array([[False], [False]], bool),
               "temperature": np.array([[1.0], [1.0]], np.float32)}
    inputs = [_tensor(tg, n, a) if a.dtype != object else _bytes(n, a)
              for n, a in stacked.items()]
    s = Stream(server)
    s.client.async_stream_infer(server.slot.name, inputs, request_id="b", outputs=[
        tg.InferRequestedOutput("text_output"), tg.InferRequestedOutput("batch_index")])
    results = s.close()
    got = {int(r.as_numpy("batch_index")[0, 0]): r.as_numpy("text_output")[0].decode()
           for r in results}
    assert got == dict(enumerate(want)) and len(results) == 2
    assert [r.get_response().parameters["triton_final_response"].bool_param
            for r in results] == [False, True]


def _bytes(name: str, array: np.ndarray):
    made = tg.InferInput(name, list(array.shape), "BYTES")
    made.set_data_from_numpy(array)
    return made


def test_a_core_batch_streams_each_row_cut_to_its_length(server, llama) -> None:
    rows = [prompt_ids(), tokenizer().encode(OTHER).ids]
    width = max(map(len, rows))
    padded = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)  # [2, n]
    inputs = [_tensor(tg, "input_ids", padded),
              _tensor(tg, "input_lengths", np.array([[len(r)] for r in rows], np.int32)),
              _tensor(tg, "request_output_len", np.array([[5]], np.int32)),  # one for all
              _tensor(tg, "streaming", np.array([[True], [True]], bool))]
    s = Stream(server)
    s.send(server.slot.name, inputs, "core-batch")
    results = s.close()
    got: dict[int, list[int]] = {0: [], 1: []}
    for r in results:
        got[int(r.as_numpy("batch_index")[0, 0])] += r.as_numpy("output_ids")[0][0].tolist()
    assert got == {i: greedy(llama, row, 5)[0] for i, row in enumerate(rows)}
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals.count(True) == 1 and finals[-1]


def test_a_batch_is_refused_unary_and_with_rows_that_do_not_match(server) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    two = _bytes("text_input", np.array([[PROMPT.encode()], [OTHER.encode()]], object))
    with pytest.raises(InferenceServerException, match="answered on a stream"):
        client.infer(server.slot.name, [two])
    client.close()
    with pytest.raises(InferenceServerException, match="'max_tokens' has 3 rows for a batch "
                                                       "of 2 prompts"):
        s = Stream(server)
        s.send(server.slot.name, [two, _tensor(tg, "max_tokens",
                                               np.array([[4], [4], [4]], np.int32))], "x")
        s.close()


def test_a_stream_request_for_another_model_is_refused_but_its_stop_is_honoured(server) -> None:
    s = Stream(server)
    s.send("no-such-model", example_inputs(prompt_ids(), 4, True), "m")
    with pytest.raises(InferenceServerException, match="unknown model: 'no-such-model'"):
        s.close()
    s = Stream(server)  # a stop names the request's id; LangChain's client sends it to
    s.send("tensorrt_llm", stop_inputs(), "any-id")  # `tensorrt_llm` whatever it served
    (answer,) = s.close()
    assert answer.as_numpy("output_ids") is None
