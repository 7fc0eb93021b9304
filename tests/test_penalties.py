"""Logit bias and the repetition, presence and frequency penalties, as clients send them
(OpenAI's `frequency_penalty` / `presence_penalty` / `logit_bias`, vLLM's
`repetition_penalty`, TensorRT-LLM's penalty tensors, the vLLM backend's
`sampling_parameters`): the engine's greedy output equal to transformers' generate with its
own logits processors, and every client name reaching the same tokens as an independent
reference on ONNX Runtime's logits."""

from __future__ import annotations

import json
import queue

import numpy as np
import openai
import pytest
import tritonclient.grpc as tg
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import PROMPT, llama, logits_of, openai_client, tokenizer  # noqa: F401

from models.build import cached
from serving.generation import GenerateOptions, Generator
from serving.errors import InvalidArgument
from serving.sampling import GenerationRequest, Sampling, adjust
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

VOCAB = 1003  # the llama-kv test model's


def test_adjust_is_transformers_bias_then_repetition_and_openais_penalties() -> None:
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    rng = np.random.default_rng(0)
    row = rng.normal(size=40).astype(np.float32)
    prompt, output = [1, 2, 3, 5, 2], [3, 9, 9, 9, 11]
    s = Sampling(repetition_penalty=1.3, logit_bias=((5, 3.0), (7, -2.0), (9, 0.5)))
    ours = row.copy()
    adjust(ours, s, prompt, output)
    ids = torch.tensor([prompt + output])
    theirs = SequenceBiasLogitsProcessor({(5,): 3.0, (7,): -2.0, (9,): 0.5})(
        ids, torch.from_numpy(row.copy())[None])
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(ids, theirs)[0].numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)
    assert not np.allclose(ours, row)

    counted = row.copy()
    adjust(counted, Sampling(presence_penalty=0.5, frequency_penalty=0.25), prompt, output)
    want = row.copy()
    want[3] -= 0.25 + 0.5
    want[9] -= 3 * 0.25 + 0.5
    want[11] -= 0.25 + 0.5  # the prompt's ids (1, 2, 5) are not the output's: untouched
    np.testing.assert_array_equal(counted, want)
    assert not Sampling().adjusts and Sampling(frequency_penalty=-1).adjusts


@pytest.mark.parametrize("bad", [dict(repetition_penalty=0.0), dict(presence_penalty=np.inf),
                                 dict(logit_bias=((3, 1.0), (3, 2.0))),
                                 dict(logit_bias=((-1, 1.0),)), dict(logit_bias=((3, np.nan),))])
def test_bad_adjustments_are_refused(bad) -> None:
    with pytest.raises(InvalidArgument):
        Sampling(**bad)


# ------------------------------------------------------------ the engine vs transformers


@pytest.fixture(scope="module")
def engine():
    path = cached("llama-kv", "awkward", "torchscript")
    gen = Generator(OrtRunner(load_cpu(path)), cache_record(load_model(path)), VOCAB,
                    GenerateOptions(prefill_tokens=8), max_positions=256)
    yield gen
    gen.close()


def _generate(gen: Generator, request: GenerationRequest) -> list[int]:
    got: queue.Queue = queue.Queue()
    gen.submit(request, got.put)
    ids, chunk = [], None
    while chunk is None or not chunk.final:
        chunk = got.get(timeout=120)
        ids += chunk.ids
    return ids


def _transformers(prompt: list[int], n: int, **processors) -> list[int]:
    import torch

    from models.build import build_torch_model, spec

    model = build_torch_model(spec("llama-kv", "awkward"))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                             eos_token_id=None, **processors)
    return out[0, len(prompt):].tolist()


def test_the_engine_is_transformers_with_bias_and_repetition_penalty(engine) -> None:
    prompt = np.random.default_rng(7).integers(0, VOCAB, 20).tolist()
    plain = _generate(engine, GenerationRequest(tuple(prompt), 24))
    assert plain == _transformers(prompt, 24)
    liked = plain[3]  # a token greedy picks anyway, pushed down; another pulled up
    bias = {(liked,): -4.0, (17,): 2.5}
    s = Sampling(repetition_penalty=1.8, logit_bias=((liked, -4.0), (17, 2.5)))
    got = _generate(engine, GenerationRequest(tuple(prompt), 24, s))  # prefilled in chunks
    assert got == _transformers(prompt, 24, repetition_penalty=1.8, sequence_bias=bias)
    assert got != plain


def test_the_engine_refuses_a_bias_outside_the_vocabulary(engine) -> None:
    with pytest.raises(InvalidArgument, match=f"token id {VOCAB} is outside the vocabulary"):
        engine.submit(GenerationRequest((1, 2), 2, Sampling(logit_bias=((VOCAB, 1.0),))),
                      lambda chunk: None)


# --------------------------------------------------------------- what the clients send


def reference(model, prompt: list[int], n: int, repetition: float = 1.0,
              presence: float = 0.0, frequency: float = 0.0, bias: dict | None = None
              ) -> list[int]:
    """Greedy with the adjustments written out plainly, on ONNX Runtime's logits of the
    whole sequence each step (nothing of the server's code)."""
    ids, out = list(prompt), []
    for _ in range(n):
        row = logits_of(model, ids)[-1].astype(np.float64)
        for t, b in (bias or {}).items():
            row[t] += b
        for t in set(ids):
            row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
        for t in set(out):
            row[t] -= frequency * out.count(t) + presence
        ids.append(int(np.argmax(row)))
        out.append(ids[-1])
    return out


ASKED = dict(repetition=1.05, presence=0.1, frequency=0.3)


@pytest.fixture(scope="module")
def want(llama):
    prompt = tokenizer().encode(PROMPT).ids
    plain = reference(llama, prompt, 12)
    penalized = reference(llama, prompt, 12, **ASKED)
    # each part changes this output: the repetition penalty, and the counts (the output
    # repeats a token, so a swapped presence and frequency would show)
    assert penalized != plain and penalized != reference(llama, prompt, 12, presence=0.1,
                                                          frequency=0.3)
    assert len(set(penalized)) < len(penalized)
    return penalized



def test_openai_penalties_and_bias(server, llama, want) -> None:
    c = openai_client(server)
    got = c.completions.create(model=server.slot.name, prompt=PROMPT, max_tokens=12,
                               temperature=0, presence_penalty=0.1, frequency_penalty=0.3,
                               extra_body={"repetition_penalty": 1.05, "ignore_eos": True})
    assert got.choices[0].text == tokenizer().decode(want)
    prompt = tokenizer().encode(PROMPT).ids
    pushed = reference(llama, prompt, 6)[0]
    bias = {pushed: -100.0, 42: 7.5}
    biased = c.completions.create(model=server.slot.name, prompt=prompt, max_tokens=6,
                                  temperature=0, logprobs=0, logit_bias={str(t): b for t, b in
                                                                         bias.items()},
                                  extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer().decode(reference(llama, prompt, 6, bias=bias))
    assert pushed not in tokenizer().encode(biased.choices[0].text).ids


@pytest.mark.parametrize("body, says", [
    ({"frequency_penalty": 2.5}, "'frequency_penalty' must be between -2 and 2"),
    ({"logit_bias": {"5": 101}}, "'logit_bias' values must be numbers between -100 and 100"),
    ({"logit_bias": {"x": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"99999": 1}}, "token id 99999 is outside the vocabulary"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0"),
])
def test_openai_bad_adjustments_are_400(server, body, says) -> None:
    with pytest.raises(openai.BadRequestError, match=says):
        openai_client(server).completions.create(model=server.slot.name, prompt=PROMPT,
                                           max_tokens=2, extra_body=body)


def _tensor(name: str, value, datatype: str):
    array = np.array([value.encode() if isinstance(value, str) else value],
                     object if datatype == "BYTES" else None)
    if datatype == "FP32":
        array = array.astype(np.float32)
    elif datatype == "INT32":
        array = array.astype(np.int32)
    made = tg.InferInput(name, list(array.shape), datatype)
    made.set_data_from_numpy(array)
    return made


def _stream_ids(server, inputs: list) -> list[int]:
    got: queue.Queue = queue.Queue()
    with tg.InferenceServerClient(f"127.0.0.1:{server.port}") as client:
        client.start_stream(lambda result, error: got.put((result, error)))
        client.async_stream_infer(server.slot.name, inputs)
        ids = []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error
            ids += result.as_numpy("output_ids").reshape(-1).tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                client.stop_stream()
                return ids


def test_tensorrt_llm_penalty_tensors(server, want) -> None:
    inputs = [_tensor("text_input", PROMPT, "BYTES"), _tensor("max_tokens", 12, "INT32"),
              _tensor("repetition_penalty", 1.05, "FP32"),
              _tensor("presence_penalty", 0.1, "FP32"),
              _tensor("frequency_penalty", 0.3, "FP32")]
    assert _stream_ids(server, inputs) == want


def test_vllm_backend_sampling_parameters_as_strings(server, want) -> None:
    sampling = {"max_tokens": "12", "repetition_penalty": "1.05", "presence_penalty": "0.1",
                "frequency_penalty": 0.3, "ignore_eos": "true"}
    inputs = [_tensor("text_input", PROMPT, "BYTES"),
              _tensor("sampling_parameters", json.dumps(sampling), "BYTES")]
    assert _stream_ids(server, inputs) == want
