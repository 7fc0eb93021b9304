"""Speculative decoding by prompt lookup (serving/generation/speculate.py; `tuner serve
--speculate N`): the drafts found in a stream's own tokens, the rewind that drops rejected
drafts' entries (tuner.gate.decode_step.rewind), the probe that allows it only where dropped
entries count for nothing (tuner.gate.row_moves.drafts_drop; a copy that reads masked
entries FAILS it), and the engine on a real exported Llama and on onnxruntime-genai's
GroupQueryAttention graph: greedy and seeded sampling give the tokens they give without
drafts, drafts are accepted where the output repeats, and the server counts them."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
from llm_support import (decoder_artifact, greedy, llama, openai_client, start,  # noqa: F401
                         tokenizer)
from serving_support import collect, scraped_metrics

from models import genai_builder
from models.build import cached
from serving.generation import GenerateOptions, Generator
from serving.generation.output import GenerationStats
from serving.generation.speculate import REST_MAX, Backoff, propose
from serving.sampling import GenerationRequest, Sampling
from tuner.cli import main
from tuner.errors import BadInput
from tuner.gate.decode_step import rewind
from tuner.gate.row_moves import RowProbe
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

VOCAB = 1003


# ------------------------------------------------------------------------------ drafts


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    assert propose([7, 8, 9, 4, 7, 8], 3) == [9, 4, 7]  # (7, 8) occurred at 0
    assert propose([1, 2, 5, 0, 1, 2, 6, 0, 1, 2], 1) == [6]  # the latest occurrence
    # a 3-token tail wins over a later 2-token one
    assert propose([4, 1, 2, 9, 3, 1, 2, 8, 4, 1, 2], 2) == [9, 3]
    assert propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert propose([5, 6, 5, 7], 3) == []  # one token alone is never looked up
    assert propose([7, 8, 9, 4, 7, 8], 0) == []


def test_a_match_running_into_the_end_repeats_with_its_period():
    assert propose([3, 5, 5, 5], 4) == [5, 5, 5, 5]
    assert propose([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # the period 3 found by the match


def test_a_stream_rests_from_lookups_after_misses_in_a_row_and_not_after_a_hit():
    b = Backoff()
    rests = []
    for accepted in (0, 0, 0, 0, 0, 2, 0):
        assert b.ready()
        b.observe(accepted)
        rests.append(b.wait)
        for _ in range(b.wait):
            assert not b.ready()
    assert rests == [1, 3, 7, REST_MAX, REST_MAX, 0, 1]


# ------------------------------------------------------------------------------ rewind


def test_rewind_masks_the_entries_after_the_kept_ones_and_nothing_else():
    left = np.array([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])  # row 0 left-padded, 5 entries
    out = rewind(left, 0, 3)
    assert out.tolist() == [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]  # holes, as a chunk's
    assert left[0].sum() == 5  # a new array
    holed = np.array([[1, 1, 0, 1, 1, 1]])  # an earlier hole stays: entries count kept ones
    assert rewind(holed, 0, 4).tolist() == [[1, 1, 0, 1, 1, 0]]
    at_start = np.array([[1, 1, 1, 1, 0, 0]])
    assert rewind(at_start, 0, 2).tolist() == [[1, 1, 0, 0, 0, 0]]
    with pytest.raises(BadInput, match="holds 4 entries; it cannot keep 5"):
        rewind(at_start, 0, 5)


# ------------------------------------------------------------------------------ the probe


class _ReadsMaskedEntries:
    """A real session fed a mask of ones: every cached entry counts, masked or not (what a
    graph that ignores its mask's holes would compute)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def infer(self, feeds):
        return self.runner.infer({**feeds, "attention_mask": np.ones_like(feeds["attention_mask"])})


@pytest.fixture(scope="module")
def llama_kv():
    path = cached("llama-kv", "awkward", "torchscript")
    return path, cache_record(load_model(path)), OrtRunner(load_cpu(path))


def test_the_probe_passes_a_graph_fed_its_mask_and_fails_one_that_reads_masked_entries(llama_kv):
    _, record, runner = llama_kv
    assert RowProbe(runner, record).drafts_drop()
    assert not RowProbe(_ReadsMaskedEntries(runner), record).drafts_drop()
    gen = Generator(_ReadsMaskedEntries(runner), record, VOCAB, GenerateOptions(speculate=3),
                    max_positions=256)
    try:
        assert gen.speculate == 0  # refused, with the reason logged
    finally:
        gen.close()


# ------------------------------------------------------------------------------ the engine

# prompts of a repeated token and a repeated triple: on this random Llama some outputs fall
# into loops (one repeats 713), where prompt lookup's drafts are accepted
def _prompts(n: int = 8) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        token, triple = int(rng.integers(0, VOCAB)), rng.integers(0, VOCAB, 3).tolist()
        out.append((token,) * 4 + tuple(triple) * 3)
    return out


def _ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.ids]


def _generator(runner, record, drafts: list, **options) -> Generator:
    stats = GenerationStats(on_draft=lambda d, a: drafts.append((d, a)))
    return Generator(runner, record, VOCAB, GenerateOptions(**options), max_positions=256,
                     stats=stats)


def test_greedy_and_seeded_streams_give_what_they_give_without_drafts(llama_kv):
    """Each stream alone (speculation runs while one stream decodes alone): greedy, sampled
    with a seed, and cut by max_tokens inside a run's drafts, equal to the same request
    without drafts; drafts were checked and some accepted."""
    _, record, runner = llama_kv
    drafts: list = []
    plain = _generator(runner, record, [], speculate=0)
    spec = _generator(runner, record, drafts, speculate=4)
    try:
        assert spec.speculate == 4
        sampled = Sampling(temperature=0.8, top_p=0.9, seed=7)
        for prompt in _prompts():
            for request in (GenerationRequest(prompt, 60),
                            GenerationRequest(prompt, 60, sampling=sampled)):
                want = _ids(collect(plain, [request])[0])
                assert _ids(collect(spec, [request])[0]) == want
        looping = _prompts()[4]
        want = _ids(collect(plain, [GenerationRequest(looping, 40)])[0])
        for n in range(9, 15):  # max_tokens falls inside a run's drafts
            got = _ids(collect(spec, [GenerationRequest(looping, n)])[0])
            assert got == want[:n]
    finally:
        plain.close(), spec.close()
    proposed, accepted = sum(d for d, _ in drafts), sum(a for _, a in drafts)
    assert accepted > 0 and proposed >= accepted
    assert all(0 < d <= 4 and 0 <= a <= d for d, a in drafts)


def test_log_probs_and_stop_ids_come_out_as_without_drafts(llama_kv):
    _, record, runner = llama_kv
    plain = _generator(runner, record, [], speculate=0)
    spec = _generator(runner, record, [], speculate=4)
    looping = _prompts()[4]
    try:
        base = _ids(collect(plain, [GenerationRequest(looping, 30)])[0])
        stop = base[-1]  # a token of the loop: the stream ends at its first one either way
        for kw in (dict(logprobs=True, top_logprobs=3), dict(stop_ids=(stop,))):
            want = collect(plain, [GenerationRequest(looping, 30, **kw)])[0]
            got = collect(spec, [GenerationRequest(looping, 30, **kw)])[0]
            assert _ids(got) == _ids(want)
            assert got[-1].reason == want[-1].reason
            if "logprobs" in kw:
                lp = [x for c in got for x in c.logprobs]
                np.testing.assert_allclose(lp, [x for c in want for x in c.logprobs], atol=1e-4)
                assert [t for c in got for t, _ in c.top_logprobs[0][:1]] == \
                    [t for c in want for t, _ in c.top_logprobs[0][:1]]
    finally:
        plain.close(), spec.close()


class _Watched:
    """The model, noting at each run that feeds several tokens after a past (a checking run:
    the prompts here are one chunk each, from an empty cache) how many streams decode. Not
    before `gen` is set (the engine's own probes at its start)."""

    def __init__(self, runner) -> None:
        self.runner, self.gen, self.decoding = runner, None, []

    def infer(self, feeds):
        ids, mask = feeds["input_ids"], feeds["attention_mask"]
        if self.gen is not None and ids.shape[1] > 1 and mask.shape[1] > ids.shape[1]:
            self.decoding.append(sum(s.decoding for s in self.gen.scheduler.running))
        return self.runner.infer(feeds)


def test_no_drafts_while_several_streams_decode(llama_kv):
    """Three streams of the looping prompt, of lengths 20, 12 and 8, at once: they draft
    only once one of them is left decoding alone, and each equals itself alone."""
    _, record, runner = llama_kv
    drafts: list = []
    watched = _Watched(runner)
    spec = _generator(watched, record, drafts, speculate=4, max_streams=4)
    watched.gen = spec
    plain = _generator(runner, record, [], speculate=0)
    looping = _prompts()[4]
    requests = [GenerationRequest(looping, n) for n in (20, 12, 8)]
    try:
        got = [_ids(c) for c in collect(spec, requests)]
        want = [_ids(collect(plain, [r])[0]) for r in requests]
    finally:
        spec.close(), plain.close()
    assert got == want
    assert watched.decoding and set(watched.decoding) == {1}  # checking runs: one stream each
    assert sum(a for _, a in drafts) > 0  # the last stream alone drafted and was right


@pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)
def test_a_genai_graph_speculates_in_its_shared_buffers():
    """GroupQueryAttention writes the drafts' entries into the shared buffers (IO binding);
    the rewind ends the mask at the kept ones and the next step writes over the rest."""
    src = genai_builder.cached("llama", "fp32")
    record, runner = cache_record(load_model(src)), OrtRunner(load_cpu(src))
    drafts: list = []
    plain = _generator(runner, record, [], speculate=0)
    spec = _generator(runner, record, drafts, speculate=4)
    try:
        assert spec.cache.shared and spec.speculate == 4
        for prompt in _prompts():
            want = _ids(collect(plain, [GenerationRequest(prompt, 60)])[0])
            assert _ids(collect(spec, [GenerationRequest(prompt, 60)])[0]) == want
    finally:
        plain.close(), spec.close()
    assert sum(a for _, a in drafts) > 0


@pytest.mark.venv(*genai_builder.VENV)
def test_a_stream_left_alone_drafts_within_the_shared_buffers_past_the_mask():
    """Shared buffers one cache bucket long (128: a byte budget too small for full length).
    A stream of a long random prompt ends at 126 entries beside a looping one of ~40: the
    mask stays 126 wide, and the stream left alone may draft only what the buffers hold past
    the mask (2 tokens), not past its own 40 entries (the bound was that: its drafts ran
    past the buffers and GroupQueryAttention failed the run). Both equal the same requests
    without drafts."""
    src = genai_builder.cached("llama", "fp32")
    record, runner = cache_record(load_model(src)), OrtRunner(load_cpu(src))
    drafts: list = []
    small = dict(kv_cache_bytes=300_000, max_streams=4)
    plain = _generator(runner, record, [], speculate=0, **small)
    spec = _generator(runner, record, drafts, speculate=4, **small)
    rng = np.random.default_rng(0)
    rng.integers(3, VOCAB, 60)
    looping = [5, 6, 7, 8, 9] * 2
    try:
        assert spec.cache.shared
        for m in range(30, 44, 2):  # the long one's output: it ends at 126 entries
            long = rng.integers(3, VOCAB, 127 - m).tolist()
            requests = [GenerationRequest(long, m), GenerationRequest(looping, 100)]
            got = collect(spec, requests)
            assert [c[-1].reason for c in got] == ["length", "length"], got[1][-1]
            assert [_ids(c) for c in got] == [_ids(c) for c in collect(plain, requests)]
    finally:
        plain.close(), spec.close()
    assert sum(a for _, a in drafts) > 0


# ------------------------------------------------------------------------------ served


def test_the_server_speculates_and_counts_drafts_in_its_metrics(llama, tmp_path):  # noqa: F811
    looping = list(_prompts()[4])
    server = start(decoder_artifact(tmp_path, llama),
                   generate={"speculate": 3, "max_tokens": 64})
    try:
        body = json.dumps({"model": server.slot.name, "prompt": looping, "max_tokens": 40,
                           "temperature": 0, "ignore_eos": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}/v1/completions",
                                         body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        streamed = openai_client(server).completions.create(  # the real client, streamed
            model=server.slot.name, prompt=looping, max_tokens=40, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].text for c in streamed if c.choices)
        metrics = scraped_metrics(server)
    finally:
        server.stop(5)
    want = greedy(llama, looping, 40)[0]
    assert answer["choices"][0]["text"] == streamed == tokenizer().decode(want)
    drafts = metrics[("tuner_spec_draft_tokens_total", ())]
    accepted = metrics[("tuner_spec_accepted_tokens_total", ())]
    assert 0 < accepted <= drafts
    assert metrics[("vllm:spec_decode_num_accepted_tokens_total", ())] == accepted
    assert metrics[("tuner_generated_tokens_total", ())] == 80


def test_the_option_is_on_the_cli_and_a_negative_count_refused(capsys):
    assert main(["serve", "--help"]) == 0
    assert "--speculate" in capsys.readouterr().out
    with pytest.raises(ValueError, match="speculate must be >= 0, not -1"):
        GenerateOptions(speculate=-1)
