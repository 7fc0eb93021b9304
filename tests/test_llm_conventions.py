"""Triton's two LLM request conventions over real gRPC streaming (tritonclient.grpc), sent
exactly as genai-perf's payloads become tensors in perf_analyzer: genai-perf writes
`{"text_input": [...], "max_tokens": [...], ...}` per request (its tensorrtllm and vllm
converters), and perf_analyzer builds each tensor with the datatype the model's metadata
declares, shape [len(values)], over ModelStreamInfer with
`triton_enable_empty_final_response`. Plus: every input optional in ModelConfig, unknown
names refused by name, request ids and `triton_final_response` on every response,
`min_length` suppressing the end token, log-probs against ONNX Runtime's own logits, stop
words across token boundaries, and a cancelled stream freeing its slot."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as tg
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import EOS_PROMPT, PROMPT, greedy, llama, tokenizer, wait_for  # noqa: F401
from tritonclient.utils import InferenceServerException, triton_to_np_dtype


# --------------------------------------------------------------- what the clients send


def trtllm_payload(text: str, tokens: int, deterministic: bool = True) -> dict:
    """genai-perf's tensorrtllm converter: text_input, max_tokens, stream, and min_length
    when the output length is deterministic."""
    payload = {"text_input": [text], "max_tokens": [tokens], "stream": [True]}
    if deterministic:
        payload["min_length"] = [tokens]
    return payload


def vllm_payload(text: str, tokens: int, deterministic: bool = True) -> dict:
    """genai-perf's vllm converter: sampling_parameters as a JSON string of strings."""
    params = {"max_tokens": f"{tokens}"}
    if deterministic:
        params["min_tokens"] = f"{tokens}"
    return {"text_input": [text], "exclude_input_in_output": [True], "stream": [True],
            "sampling_parameters": [json.dumps(params)]}


def perf_analyzer_inputs(client, model: str, payload: dict) -> list:
    """Tensors as perf_analyzer builds them from a payload: the metadata's datatype."""
    declared = {i["name"]: i["datatype"] for i in
                client.get_model_metadata(model, as_json=True)["inputs"]}
    inputs = []
    for name, values in payload.items():
        datatype = declared.get(name, "INT32")
        dtype = object if datatype == "BYTES" else triton_to_np_dtype(datatype)
        array = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype)
        inputs.append(tg.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def stream(server, inputs: list, request_id: str = "req-1", **parameters):
    """Every response of one streamed request (results, raising the first error)."""
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(server.slot.name, inputs, request_id=request_id,
                                  enable_empty_final_response=True,
                                  parameters=parameters or None)
        results = []
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                raise error
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return results
    finally:
        client.stop_stream()
        client.close()


def texts(results) -> list[str]:
    out = []
    for r in results:
        t = r.as_numpy("text_output")
        assert t.shape == (1,), t.shape  # exactly one element per response
        out.append(t[0].decode())
    return out


def ids(results) -> list[int]:
    return [t for r in results for t in r.as_numpy("output_ids").reshape(-1).tolist()]


# ------------------------------------------------------------------------------- tests


def test_config_declares_every_convention_optional_and_decoupled(server) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    config = client.get_model_config(server.slot.name, as_json=True)["config"]
    inputs = {i["name"]: i for i in config["input"]}
    assert config["model_transaction_policy"]["decoupled"] is True
    for name, datatype in (("text_input", "TYPE_STRING"), ("max_tokens", "TYPE_INT32"),
                           ("stream", "TYPE_BOOL"), ("exclude_input_in_output", "TYPE_BOOL"),
                           ("min_length", "TYPE_INT32"), ("end_id", "TYPE_INT32"),
                           ("pad_id", "TYPE_INT32"), ("random_seed", "TYPE_UINT64"),
                           ("temperature", "TYPE_FP32"), ("runtime_top_k", "TYPE_INT32"),
                           ("runtime_top_p", "TYPE_FP32"), ("stop_words", "TYPE_STRING"),
                           ("bad_words", "TYPE_STRING"), ("return_log_probs", "TYPE_BOOL"),
                           ("sampling_parameters", "TYPE_STRING"), ("input_ids", "TYPE_INT64"),
                           ("stop_ids", "TYPE_INT64")):
        assert inputs[name]["data_type"] == datatype, name
    assert all(i.get("optional") is True for i in inputs.values())
    outputs = {o["name"] for o in config["output"]}
    assert {"text_output", "output_ids", "sequence_length", "output_log_probs",
            "cum_log_probs"} <= outputs


@pytest.mark.parametrize("convention", [trtllm_payload, vllm_payload])
def test_genai_perf_payloads_stream_with_ids_and_final_flags(server, llama, convention) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    results = stream(server, perf_analyzer_inputs(client, server.slot.name,
                                                  convention(PROMPT, 12)), "abc-7")
    flags = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert flags == [False] * (len(results) - 1) + [True]
    assert all(r.get_response().id == "abc-7" for r in results)
    assert len(ids(results)) == 12  # min_length/min_tokens: exactly the asked length
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 12)
    assert ids(results) == want
    assert "".join(texts(results)) == tokenizer().decode(want)


def test_unknown_tensor_is_invalid_argument_naming_it(server) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    payload = {**trtllm_payload(PROMPT, 4), "lora_task_id": [3]}
    with pytest.raises(InferenceServerException, match="unexpected input 'lora_task_id'"):
        stream(server, perf_analyzer_inputs(client, server.slot.name, payload))
    with pytest.raises(InferenceServerException, match="sampling parameter 'best_of'"):
        stream(server, perf_analyzer_inputs(client, server.slot.name, {
            "text_input": [PROMPT], "sampling_parameters": [json.dumps({"best_of": 2})]}))


def _scalar(name: str, value, datatype: str):
    array = np.array([value], triton_to_np_dtype(datatype))
    made = tg.InferInput(name, [1], datatype)
    made.set_data_from_numpy(array)
    return made


def _text(text: str):
    made = tg.InferInput("text_input", [1], "BYTES")
    made.set_data_from_numpy(np.array([text.encode()], object))
    return made


@pytest.mark.parametrize("datatype", ["INT8", "UINT16", "INT64", "UINT64"])
def test_integer_controls_take_any_width(server, datatype) -> None:
    results = stream(server, [_text(PROMPT), _scalar("max_tokens", 3, datatype)])
    assert len(ids(results)) == 3


def test_a_float_for_an_integer_is_refused(server) -> None:
    with pytest.raises(InferenceServerException, match="'max_tokens' must be an integer"):
        stream(server, [_text(PROMPT), _scalar("max_tokens", 3.0, "FP32")])


def test_min_length_suppresses_the_end_token_until_reached(server, llama) -> None:
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 16)
    k = next(i for i in range(1, len(want)) if want[i] not in want[:i])  # a new token
    end = want[k]
    early = stream(server, [_text(PROMPT), _scalar("max_tokens", 20, "INT32"),
                            _scalar("end_id", end, "INT32")])
    assert ids(early) == want[:k]
    assert early[-1].get_response().parameters["finish_reason"].string_param == "stop"
    held = stream(server, [_text(PROMPT), _scalar("max_tokens", 20, "INT32"),
                           _scalar("end_id", end, "INT32"),
                           _scalar("min_length", k + 3, "INT32")])
    got = ids(held)
    assert len(got) >= k + 3 and end not in got[:k + 3] and got[:k] == want[:k]


def test_log_probs_are_onnx_runtimes_own(server, llama) -> None:
    prompt = tokenizer().encode(PROMPT).ids
    want, logits = greedy(llama, prompt, 5)
    results = stream(server, [_text(PROMPT), _scalar("max_tokens", 5, "INT32"),
                              _scalar("return_log_probs", True, "BOOL")])
    got = np.concatenate([r.as_numpy("output_log_probs") for r in results])
    x = [lg.astype(np.float64) for lg in logits]
    expected = [float(v[t] - v.max() - np.log(np.exp(v - v.max()).sum())) for v, t in zip(x, want)]
    np.testing.assert_allclose(got, expected, atol=1e-3)
    assert results[-1].as_numpy("cum_log_probs")[0] == pytest.approx(sum(expected), abs=1e-2)
    assert results[-1].as_numpy("sequence_length")[0] == 5


def test_stop_words_match_across_token_boundaries(server) -> None:
    whole = texts(stream(server, [_text(PROMPT), _scalar("max_tokens", 16, "INT32")]))
    full = "".join(whole)
    # a stop string made of the end of one token's text and the start of the next
    i = next(k for k in range(1, len(whole) - 1) if len(whole[k]) >= 1 and len(whole[k + 1]) >= 2)
    stop = whole[i][-1:] + whole[i + 1][:2]
    words = tg.InferInput("stop_words", [1], "BYTES")
    words.set_data_from_numpy(np.array([stop.encode()], object))
    results = stream(server, [_text(PROMPT), _scalar("max_tokens", 16, "INT32"), words])
    assert "".join(texts(results)) == full[:full.index(stop)]
    assert results[-1].get_response().parameters["finish_reason"].string_param == "stop"


def _words(name: str, words: list[str]):
    made = tg.InferInput(name, [len(words)], "BYTES")
    made.set_data_from_numpy(np.array([w.encode() for w in words], object))
    return made


def _own_tokens(ids: list[int], k: int, n: int) -> bool:
    """Whether the text of ids[k:k+n] tokenizes (alone) to exactly those ids."""
    text = tokenizer().decode(ids[k:k + n])
    return tokenizer().encode(text, add_special_tokens=False).ids == ids[k:k + n]


def test_bad_words_are_never_generated_and_multi_token_ones_only_after_their_start(
        server, llama) -> None:
    want, _ = greedy(llama, tokenizer().encode(PROMPT).ids, 12)
    length = [_scalar("max_tokens", 12, "INT32"), _scalar("min_length", 12, "INT32")]
    sent = lambda *extra: ids(stream(server, [_text(PROMPT), *length, *extra]))  # noqa: E731
    assert sent() == want and sent(_words("bad_words", [""])) == want  # empty: no ban
    k = next(i for i in range(1, 12) if want[i] not in want[:i] and _own_tokens(want, i, 1))
    word = tokenizer().decode([want[k]])
    banned = sent(_words("bad_words", ["", word]))
    assert want[k] not in banned and banned[:k] == want[:k] and banned != want
    # two tokens (a, b): a is still generated; b, which would follow it, is not
    j = next(i for i in range(1, 11) if want[i + 1] not in want[:i + 1]
             and _own_tokens(want, i, 2))
    pair = sent(_words("bad_words", [tokenizer().decode(want[j:j + 2])]))
    assert pair[:j + 1] == want[:j + 1] and pair[j + 1] != want[j + 1]
    vllm = ids(stream(server, [_text(PROMPT), _words("sampling_parameters", [json.dumps(
        {"max_tokens": 12, "min_tokens": 12, "bad_words": [word]})])]))
    assert want[k] not in vllm and vllm[:k] == want[:k]


def test_bad_words_tokenize_as_each_backend_does() -> None:
    from serving.conventions import bad_word_ids

    tok, ids = tokenizer(), lambda text: tuple(tokenizer().encode(text).ids)  # noqa: E731
    assert bad_word_ids(tok, [" fox", ""]) == (ids(" fox"),)  # TensorRT-LLM: as given
    # vLLM: without leading spaces, and after one where that is as many other tokens
    assert len(ids("The")) == len(ids(" The")) == 1 and len(ids("fox")) != len(ids(" fox"))
    assert bad_word_ids(tok, ["The", " fox"], vllm=True) == (ids("The"), ids(" The"), ids("fox"))


def test_exclude_input_in_output_false_sends_the_prompt_first(server) -> None:
    results = stream(server, [_text(PROMPT), _scalar("max_tokens", 3, "INT32"),
                              _scalar("exclude_input_in_output", False, "BOOL")])
    assert "".join(texts(results)).startswith(PROMPT)


def test_vllm_stops_at_the_end_token_unless_ignore_eos_and_counts(server, llama) -> None:
    eos = server.slot.engine.text.eos_ids[0]
    k = greedy(llama, tokenizer().encode(EOS_PROMPT).ids, 16)[0].index(eos)
    params = lambda **p: {"text_input": [EOS_PROMPT], "return_num_input_tokens": [True],  # noqa: E731
                          "return_num_output_tokens": [True],
                          "sampling_parameters": [json.dumps({"max_tokens": "20", **p})]}
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    stopped = stream(server, perf_analyzer_inputs(client, server.slot.name, params()))
    assert len(ids(stopped)) == k  # the end token itself is not sent
    assert stopped[0].as_numpy("num_input_tokens")[0] == len(tokenizer().encode(EOS_PROMPT).ids)
    assert sum(int(r.as_numpy("num_output_tokens")[0]) for r in stopped) == k
    going = stream(server, perf_analyzer_inputs(client, server.slot.name,
                                                params(ignore_eos="true")))
    assert len(ids(going)) == 20


def test_a_cancelled_stream_frees_its_slot(server) -> None:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(server.slot.name, [_text(PROMPT), _scalar("max_tokens", 60,
                                                                         "INT32")])
    got.get(timeout=30)  # it is running
    assert server.slot.engine.active() == 1
    client.stop_stream(cancel_requests=True)
    assert wait_for(lambda: server.slot.engine.active() == 0)
    client.close()


def _word_level():
    """A real tokenizer that makes no tokens of blanks (words split on whitespace)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "no": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_parse_request_names_what_is_wrong() -> None:
    from serving.conventions import parse_request
    from serving.errors import InvalidArgument

    ids = {"input_ids": np.array([[1, 2, 3]], np.int32)}
    assert parse_request(ids, {}).generation.prompt == (1, 2, 3)  # INT32 ids too
    with pytest.raises(InvalidArgument, match="beam_width 2 is not supported"):
        parse_request({**ids, "beam_width": np.array([2], np.int32)}, {})
    with pytest.raises(InvalidArgument, match="bad words need a tokenizer"):
        parse_request({**ids, "bad_words": np.array([b"no"], object)}, {})
    with pytest.raises(InvalidArgument, match="bad word '  ' makes no tokens"):
        parse_request({**ids, "bad_words": np.array([b"", b"  "], object)}, {},
                      tokenizer=_word_level())
    with pytest.raises(InvalidArgument, match="stop strings need a tokenizer"):
        parse_request({**ids, "stop_words": np.array([b"."], object)}, {})
    with pytest.raises(InvalidArgument, match="'max_tokens' must be an integer, not 'ten'"):
        parse_request({**ids, "sampling_parameters": np.array([b'{"max_tokens": "ten"}'],
                                                              object)}, {})
    got = parse_request({**ids, "sampling_parameters": np.array(
        [b'{"max_tokens": "9", "temperature": "0.5", "top_k": -1, "stop": "END"}'], object)},
        {}, tokenizer=object())
    assert (got.generation.max_tokens, got.generation.sampling.temperature,
            got.generation.sampling.top_k, got.generation.stop_strings) == (9, 0.5, 0, ("END",))


# ------------------------- the vLLM backend's additional outputs, asked as its own tests ask


def _vllm_inputs(stream_: bool, sampling: dict, **asked) -> list:
    """As the vLLM backend's own test of its additional outputs builds them: text_input,
    stream, sampling_parameters, then each return_* BOOL that is not None."""
    made = [_text(PROMPT), _scalar("stream", stream_, "BOOL"),
            _words("sampling_parameters", [json.dumps(sampling)])]
    return made + [_scalar(k, v, "BOOL") for k, v in asked.items() if v is not None]


def _llm_infer(server, inputs: list, parameters: dict) -> list:
    """That test's client: sampling parameters also as request parameters, no empty final."""
    got: list = []
    with tg.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        client.start_stream(lambda result, error: got.append((result, error)))
        client.async_stream_infer(server.slot.name, inputs=inputs, parameters=parameters)
        client.stop_stream()
    assert got and all(error is None for _, error in got), got
    return [result for result, _ in got]


def _log_softmax(row: np.ndarray) -> np.ndarray:
    return (x := row.astype(np.float64)) - x.max() - np.log(np.exp(x - x.max()).sum())


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize("logprobs", [None, 0, 2])
def test_vllm_additional_outputs_as_its_backend_sends_them(server, llama, streamed,
                                                          logprobs) -> None:
    sampling = {"temperature": "0", "top_p": "1", "max_tokens": "6"}
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    results = _llm_infer(server, _vllm_inputs(
        streamed, sampling, return_finish_reason=True, return_cumulative_logprob=True,
        return_logprobs=True, return_num_input_tokens=True, return_num_output_tokens=True),
        sampling)
    want, logits = greedy(llama, tokenizer().encode(PROMPT).ids, 6)
    expected = [_log_softmax(row) for row in logits]
    assert len(results) == (6 if streamed else 1)
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in results]
    assert reasons == ["None"] * (len(results) - 1) + ["length"]
    sums = [float(r.as_numpy("cumulative_logprob")[0]) for r in results]
    running = np.cumsum([e[t] for e, t in zip(expected, want)])
    np.testing.assert_allclose(sums, running if streamed else running[-1:], atol=1e-3)
    assert [int(r.as_numpy("num_input_tokens")[0]) for r in results] == [
        len(tokenizer().encode(PROMPT).ids)] * len(results)
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r in results]
    listings = [json.loads(r.as_numpy("logprobs")[0].decode()) for r in results]
    text = "".join(texts(results))
    if not streamed:  # no exclude_input_in_output, no streaming: the prompt comes first
        assert text.startswith(PROMPT)
        text = text[len(PROMPT):]
    if logprobs is None:  # asked for the listing, but vLLM's `logprobs` was not set
        assert listings == [None] * len(results)
        return
    assert [len(listing) for listing in listings] == counts  # one entry per token sent
    positions = [p for listing in listings for p in listing]
    assert len(positions) == 6
    ranked_first = ""
    for position, token, e in zip(positions, want, expected):
        order = np.argsort(-e, kind="stable")
        # the sampled id first, then the most likely (vLLM's dict: a repeat keeps its place)
        assert list(position) == list(dict.fromkeys(str(t) for t in [token, *order[:logprobs]]))
        for key, entry in position.items():
            assert set(entry) == {"logprob", "rank", "decoded_token"}
            assert entry["logprob"] == pytest.approx(e[int(key)], abs=1e-3)
            assert entry["rank"] == int((e >= e[int(key)]).sum())
            assert entry["decoded_token"] == tokenizer().decode([int(key)])
        ranked_first += next(v["decoded_token"] for v in position.values() if v["rank"] == 1)
    assert ranked_first == text  # greedy: the rank-1 tokens are the text


def test_vllm_outputs_only_when_asked_and_its_logprobs_bounded(server) -> None:
    sampling = {"temperature": "0", "max_tokens": "3", "logprobs": 2}
    results = _llm_infer(server, _vllm_inputs(True, sampling, return_logprobs=False), sampling)
    for name in ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                 "num_output_tokens"):
        assert all(r.as_numpy(name) is None for r in results), name
    assert all(r.as_numpy("text_output") is not None for r in results)
    with pytest.raises(InferenceServerException, match="'logprobs' must be between 0 and 20"):
        stream(server, _vllm_inputs(True, {"logprobs": 21}, return_logprobs=True))
