"""Clients written for TensorRT-LLM's ensemble against a decoder artifact over real gRPC
(tritonclient): its example client (temperature 1 by default and greedy all the same, as
TensorRT-LLM samples only with a top-k or top-p; bias words; a beam width's texts; its
`--batch-inputs`), a batch of prompts to the core model, and model names on a stream."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as tg
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import PROMPT, greedy, llama, tokenizer, wait_for  # noqa: F401
from trtllm_support import (Stream, bytes_input, example_inputs, prompt_ids, slow, stop_inputs,
                            tensor)
from tritonclient.utils import InferenceServerException, np_to_triton_dtype


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


def test_the_ensembles_beam_width_answers_a_text_per_beam(server) -> None:
    """beam_width 3 through the ensemble's names, as its postprocessing answers it: one
    response, text_output [3] (the prompt first, as that client asks), the search's three
    best sequences, best first, output_ids [3, n] (transformers' num_return_sequences)."""
    from test_decoder_beams import transformers_returns

    want = transformers_returns(prompt_ids(), 3, 6, returns=3)
    s = Stream(server)
    s.send(server.slot.name, ensemble_request(6, beam_width=np.array([[3]], np.int32)), "")
    (result,) = s.close()
    texts = [t.decode() for t in result.as_numpy("text_output")]
    assert texts == [PROMPT + tokenizer().decode(w) for w in want]
    assert result.as_numpy("output_ids").tolist() == want
    assert result.as_numpy("sequence_length").tolist() == [6, 6, 6]


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
    inputs = [tensor(tg, n, a) if a.dtype != object else bytes_input(n, a)
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


def test_a_core_batch_streams_each_row_cut_to_its_length(server, llama) -> None:
    rows = [prompt_ids(), tokenizer().encode(OTHER).ids]
    width = max(map(len, rows))
    padded = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)  # [2, n]
    inputs = [tensor(tg, "input_ids", padded),
              tensor(tg, "input_lengths", np.array([[len(r)] for r in rows], np.int32)),
              tensor(tg, "request_output_len", np.array([[5]], np.int32)),  # one for all
              tensor(tg, "streaming", np.array([[True], [True]], bool))]
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
    two = bytes_input("text_input", np.array([[PROMPT.encode()], [OTHER.encode()]], object))
    with pytest.raises(InferenceServerException, match="answered on a stream"):
        client.infer(server.slot.name, [two])
    client.close()
    with pytest.raises(InferenceServerException, match="'max_tokens' has 3 rows for a batch "
                                                       "of 2 prompts"):
        s = Stream(server)
        s.send(server.slot.name, [two, tensor(tg, "max_tokens",
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


def test_rows_split_only_batched_inputs() -> None:
    from serving.trtllm_core import rows

    two = {"text_input": np.array([[b"a"], [b"b"]], object),
           "max_tokens": np.array([[3], [5]], np.int32),  # one each
           "temperature": np.array([[0.5]], np.float32),  # [1, 1]: the same for all
           "stop_words": np.array([b"x", b"y"], object)}  # 1-D: no batch axis, for all
    got = rows(two)
    assert [r["max_tokens"].tolist() for r in got] == [[[3]], [[5]]]
    assert all(r["temperature"].tolist() == [[0.5]] for r in got)
    assert all(r["stop_words"].tolist() == [b"x", b"y"] for r in got)
    assert [r["text_input"].tolist() for r in got] == [[[b"a"]], [[b"b"]]]
    one = {"text_input": np.array([[b"a"]], object)}
    assert rows(one) == [one]


def test_a_batch_the_server_cannot_hold_whole_is_refused_whole(server) -> None:
    """More rows than the server runs and queues (4 + 256 here): RESOURCE_EXHAUSTED as the
    one answer, and the rows that had started are cancelled (their chunks, held until every
    row started, never go out; the rows start faster than a first token here, so this test
    does not force that hold)."""
    capacity = server.slot.engine.options.max_streams + server.slot.engine.options.max_queue
    many = bytes_input("text_input", np.array([[PROMPT.encode()]] * (capacity + 1), object))
    s = Stream(server)
    # decode steps of 10 ms and 50 tokens a row: no row ends (freeing its place) while the
    # batch's rows are being started
    with slow(server):
        s.send(server.slot.name, [many, tensor(tg, "max_tokens", np.array([[50]], np.int32))],
               "big")
        s.client.stop_stream()
        assert wait_for(lambda: server.slot.engine.active() == 0, 30)
    got = []
    while not s.got.empty():
        got.append(s.got.get())
    s.client.close()
    assert len(got) == 1 and got[0][0] is None and "the server is full" in str(got[0][1])
