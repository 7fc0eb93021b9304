"""Beam search on a decoder with its KV cache (serving/generation/beam_decode.py), on a real
exported Llama through the engine: the searched answer equals transformers' generate with
the same beams on the torch model the export was made of (ending at the length limit, and at
an end token); a search beside plain streams leaves each as it is alone, and searches at once
share runs, each as it is alone; what a search cannot give is refused; a cancelled search
frees the engine; on onnxruntime-genai's graph (its cache rows at the start) searches equal
ones that keep no cache; a length penalty and early stopping, the request's or the model's
generation config's, give transformers' answer under them. TensorRT-LLM clients'
`beam_width` over gRPC: tests/test_trtllm_clients.py."""

from __future__ import annotations

import queue
from functools import lru_cache

import numpy as np
import pytest
from serving_support import collect

from models import genai_builder
from models.build import build_torch_model, cached, spec
from serving.errors import InvalidArgument
from serving.generation import GenerateOptions, Generator
from serving.generation.beams import BeamConfig, BeamSearch, log_softmax
from serving.sampling import GenerationRequest, Sampling
from tuner.gate.decode_step import empty_past, last_only, step_feeds
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

VOCAB = 1003
PROMPT = tuple(int(t) for t in np.random.default_rng(11).integers(3, VOCAB, 9))


@pytest.fixture(scope="module")
def gen():
    path = cached("llama-kv", "awkward", "torchscript")
    g = Generator(OrtRunner(load_cpu(path)), cache_record(load_model(path)), VOCAB,
                  GenerateOptions(max_streams=4), max_positions=256)
    yield g
    g.close()


@lru_cache(maxsize=1)
def _torch_model():
    return build_torch_model(spec("llama-kv", "awkward"))


def transformers_beams(prompt, beams: int, max_tokens: int, eos: int | None = None,
                       **settings) -> list[int]:
    """transformers' beam search (its defaults, unless `settings` say: length penalty 1,
    early_stopping False), the end token and what pads after it cut off, as the server
    sends no end token."""
    return transformers_returns(prompt, beams, max_tokens, eos, 1, **settings)[0]


def transformers_returns(prompt, beams: int, max_tokens: int, eos: int | None = None,
                         returns: int = 1, **settings) -> list[list[int]]:
    """Its `returns` best sequences (num_return_sequences), best first, each cut so."""
    import torch

    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = _torch_model().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      num_beams=beams, max_new_tokens=max_tokens,
                                      pad_token_id=0, eos_token_id=eos,
                                      num_return_sequences=returns, **settings)
    rows = [row[len(prompt):] for row in out.tolist()]
    return [row[:row.index(eos)] if eos in row else row[:max_tokens] for row in rows]


def _ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.ids]


@pytest.mark.parametrize("beams", [2, 4])
def test_the_search_is_transformers_at_the_length_limit_and_at_an_end_token(gen, beams):
    want = transformers_beams(PROMPT, beams, 10)
    (chunks,) = collect(gen, [GenerationRequest(PROMPT, 10, beams=beams)])
    assert _ids(chunks) == want and chunks[-1].reason == "length"
    assert want != transformers_beams(PROMPT, 1, 10) or beams == 2  # 4 beams: not greedy's
    # the third token is an end token: hypotheses end there while others run on
    eos = want[2]
    want = transformers_beams(PROMPT, beams, 10, eos)
    (chunks,) = collect(gen, [GenerationRequest(PROMPT, 10, beams=beams,
                                                stop_ids=frozenset({eos}))])
    assert _ids(chunks) == want


def test_the_n_best_sequences_are_transformers_num_return_sequences(gen):
    """returns 3 of 4 beams: one final chunk carrying transformers' num_return_sequences 3,
    best first, the chunk's own ids the first's; with an end token met mid-search too, the
    sequences that end there cut before it ("stop"), the others at the limit ("length")."""
    eos = transformers_beams(PROMPT, 4, 10)[2]
    for stops in (frozenset(), frozenset({eos})):
        want = transformers_returns(PROMPT, 4, 10, min(stops, default=None), returns=3)
        assert len({tuple(w) for w in want}) == 3  # three answers to tell apart
        (chunks,) = collect(gen, [GenerationRequest(PROMPT, 10, beams=4, returns=3,
                                                    stop_ids=stops)])
        (whole,) = chunks
        assert whole.final and [list(b.ids) for b in whole.beams] == want
        assert list(whole.ids) == want[0]
        assert [b.reason for b in whole.beams] == ["stop" if len(w) < 10 else "length"
                                                   for w in want]
    assert {b.reason for b in whole.beams} == {"stop", "length"}
    with pytest.raises(InvalidArgument, match="4 sequences asked of a search of 3 beams"):
        GenerationRequest(PROMPT, 10, beams=3, returns=4)


@pytest.mark.parametrize("at, settings, other", [
    (2, {"length_penalty": 2.0}, {}),
    (4, {"length_penalty": 2.0, "early_stopping": True}, {"length_penalty": 2.0})])
def test_a_requests_length_penalty_and_early_stopping_are_transformers(gen, at, settings,
                                                                       other):
    """A request's own search settings (TensorRT-LLM's len_penalty and early_stopping): with
    the end token met mid-search, each gives transformers' answer under the same settings,
    which here differs from its answer under the `other` ones."""
    eos = transformers_beams(PROMPT, 3, 10)[at]
    want = transformers_beams(PROMPT, 3, 10, eos, **settings)
    assert want != transformers_beams(PROMPT, 3, 10, eos, **other)
    (chunks,) = collect(gen, [GenerationRequest(PROMPT, 10, beams=3, stop_ids=frozenset({eos}),
                                                **settings)])
    assert _ids(chunks) == want


def test_tensorrt_llms_names_give_the_search_its_settings():
    """The ensemble's length_penalty (the core's len_penalty: tests/test_trtllm_clients.py)
    and early_stopping become the request's; a request that names none leaves the model's."""
    from serving.conventions import parse_request

    ids = {"input_ids": np.array([PROMPT], np.int32), "beam_width": np.array([3], np.int32)}
    search = parse_request({**ids, "length_penalty": np.array([0.5], np.float32),
                            "early_stopping": np.array([True])}, {}, max_beams=16).generation
    assert (search.beams, search.length_penalty, search.early_stopping) == (3, 0.5, True)
    plain = parse_request(ids, {}, max_beams=16).generation
    assert (plain.beams, plain.length_penalty, plain.early_stopping) == (3, None, None)


def test_a_search_beside_plain_streams_leaves_each_as_it_is_alone(gen):
    plain = [GenerationRequest(PROMPT[:5], 12), GenerationRequest(PROMPT[3:], 7)]
    searched = GenerationRequest(PROMPT, 8, beams=3)
    alone = [_ids(collect(gen, [r])[0]) for r in [*plain, searched]]
    together = [_ids(c) for c in collect(gen, [searched, *plain])]
    assert together == [alone[2], *alone[:2]]
    assert alone[2] == transformers_beams(PROMPT, 3, 8)
    assert gen.active == 0 and gen.occupancy() == (0, 0)


def _runs_of(gen, requests) -> tuple[list[list[int]], list[int]]:
    """Each request's ids, all submitted at once, and the rows of every search run."""
    rows: list[int] = []
    counted, gen.beams.on_run = gen.beams.on_run, lambda n, seconds: rows.append(n)
    try:
        return [_ids(c) for c in collect(gen, requests)], rows
    finally:
        gen.beams.on_run = counted


def test_searches_at_once_share_runs_and_each_is_as_it_is_alone(gen):
    """Three searches of their own prompts, widths and lengths (one ending at an end token)
    at once: their beams decode in shared runs (rows of several searches, each widened to the
    longest past), and each answers what it answers alone; where the engine runs one stream
    at a time, one search runs at a time."""
    eos = transformers_beams(PROMPT, 4, 10)[3]
    searches = [GenerationRequest(PROMPT, 8, beams=3), GenerationRequest(PROMPT[:4], 12, beams=2),
                GenerationRequest(PROMPT[2:], 10, beams=4, stop_ids=frozenset({eos}))]
    alone = [_runs_of(gen, [r])[0][0] for r in searches]
    together, rows = _runs_of(gen, searches)
    assert together == alone and max(rows) > 4  # some run held beams of two searches
    assert alone[2] == transformers_beams(PROMPT[2:], 4, 10, eos)
    path = cached("llama-kv", "awkward", "torchscript")
    one = Generator(OrtRunner(load_cpu(path)), cache_record(load_model(path)), VOCAB,
                    GenerateOptions(max_streams=1), max_positions=256)
    try:
        got, rows = _runs_of(one, searches)
    finally:
        one.close()
    assert got == alone and max(rows) == 4


def test_searches_that_would_overrun_the_budget_together_take_turns():
    """A byte budget of 80 entries: a search of 3 x 17 fits, beside it one of 2 more rows
    (5 rows, each as long as the longer search's 17: 85) does not, so that one waits."""
    path = cached("llama-kv", "awkward", "torchscript")
    record = cache_record(load_model(path))
    g = Generator(OrtRunner(load_cpu(path)), record, VOCAB,
                  GenerateOptions(max_streams=4, kv_cache_bytes=80 * record.bytes_per_token),
                  max_positions=256)
    searches = [GenerationRequest(PROMPT, 8, beams=3), GenerationRequest(PROMPT[:4], 12, beams=2)]
    try:
        got, rows = _runs_of(g, searches)
    finally:
        g.close()
    assert got == [transformers_beams(PROMPT, 3, 8), transformers_beams(PROMPT[:4], 2, 12)]
    assert max(rows) == 3


@pytest.mark.parametrize("request_, message", [
    (GenerationRequest(PROMPT, 4, beams=2, sampling=Sampling(temperature=0.7)), "greedy"),
    (GenerationRequest(PROMPT, 4, beams=2, logprobs=True), "log-probs"),
    (GenerationRequest(PROMPT, 4, beams=17), "1 to 16"),
    (GenerationRequest(PROMPT, 200, beams=16), "byte budget"),
])
def test_what_a_search_cannot_give_is_refused(request_, message):
    path = cached("llama-kv", "awkward", "torchscript")
    record = cache_record(load_model(path))
    # a budget that holds one stream's 209 entries, not 16 beams' of them
    g = Generator(OrtRunner(load_cpu(path)), record, VOCAB,
                  GenerateOptions(kv_cache_bytes=1024 * record.bytes_per_token),
                  max_positions=256)
    try:
        with pytest.raises(InvalidArgument, match=message):
            g.validate(request_)
        g.validate(GenerationRequest(PROMPT, 200))  # one beam of it fits
    finally:
        g.close()


def test_a_cancelled_search_ends_and_frees_the_engine(gen):
    chunks: queue.Queue = queue.Queue()
    handle = gen.submit(GenerationRequest(PROMPT, 64, beams=4), chunks.put)
    handle.cancel()
    last = chunks.get(timeout=30)
    while not last.final:
        last = chunks.get(timeout=30)
    assert last.reason == "cancelled"
    assert gen.active == 0
    (after,) = collect(gen, [GenerationRequest(PROMPT, 6, beams=2)])  # the next one runs
    assert _ids(after) == transformers_beams(PROMPT, 2, 6)


def _recomputed_search(runner, record, prompt, beams: int, max_tokens: int) -> list[int]:
    """The same search with no cache kept: each beam's logits from a run of its whole
    sequence against an empty past (what a gather of the wrong rows cannot give)."""
    search = BeamSearch(BeamConfig(beams), frozenset(), max_tokens)
    rows = [list(prompt)]
    while True:
        scores = []
        for row in rows:
            past, mask = empty_past(record, 1)
            feeds = last_only(step_feeds(record, [row], mask, past))
            out = runner.infer(dict(feeds.arrays))
            scores.append(out[record.logits][0, feeds.logit_slots[0], :VOCAB])
        search.step(log_softmax(np.stack(scores)))
        if search.done:
            return list(search.best())
        rows = [list(prompt) + beam for beam in search.running.tolist()]


@pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)
def test_a_graph_that_reads_its_mask_as_lengths_searches_the_same():
    """onnxruntime-genai's Llama (GroupQueryAttention: rows at the start of the cache, the
    present written by the graph): the engine's searches, two at once, each equal one that
    keeps no cache."""
    src = genai_builder.cached("llama", "fp32")
    runner, record = OrtRunner(load_cpu(src)), cache_record(load_model(src))
    assert record.rows_at_start
    g = Generator(runner, record, VOCAB, GenerateOptions(max_streams=4), max_positions=128)
    assert g.beams.infer_into is not None  # the graph writes each step into the rows' buffers
    try:  # two searches at once: shared runs, the shorter past widened after its entries
        got, rows = _runs_of(g, [GenerationRequest(PROMPT, 8, beams=4),
                                 GenerationRequest(PROMPT[:5], 6, beams=3)])
    finally:
        g.close()
    assert got == [_recomputed_search(runner, record, PROMPT, 4, 8),
                   _recomputed_search(runner, record, PROMPT[:5], 3, 6)]
    assert max(rows) == 7


def test_the_models_generation_config_sets_the_search_unless_the_request_does(tmp_path):
    """generation_config.json's length_penalty and early_stopping are the search's, as
    transformers' generate takes them, over real gRPC (TensorRT-LLM's example inputs); a
    request that names its own (len_penalty, early_stopping) has those."""
    import json

    from llm_support import decoder_artifact, start
    from trtllm_support import unary

    art = decoder_artifact(tmp_path, cached("llama-kv", "awkward", "torchscript"))
    (art / "generation_config.json").write_text(json.dumps({"length_penalty": 2.0,
                                                            "early_stopping": True}))
    eos = transformers_beams(PROMPT, 3, 10)[4]
    model_s = transformers_beams(PROMPT, 3, 10, eos, length_penalty=2.0, early_stopping=True)
    defaults = transformers_beams(PROMPT, 3, 10, eos)
    assert model_s != defaults
    controls = {"beam_width": np.array([[3]], np.uint32), "end_id": np.array([[eos]], np.int32)}
    server = start(art, generate={"max_tokens": 64})
    try:
        assert unary(server, list(PROMPT), 10, **controls)[0] == model_s
        own = {"len_penalty": np.array([[1.0]], np.float32),
               "early_stopping": np.array([[False]], bool)}
        assert unary(server, list(PROMPT), 10, **controls, **own)[0] == defaults
    finally:
        server.stop(5)
