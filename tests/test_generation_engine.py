"""The generation engine's parts, each alone (serving/generation/: scheduler, cache manager,
runner, output processor), and the engine on a real exported Llama with its KV cache:
greedy output equal to transformers' generate and each stream equal to itself alone with
chunked prefill, preemption and prefix-cache hits.

Over 400 lines on purpose: one file per part under test, each test with the model it needs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from serving_support import collect

from models.build import cached
from serving.errors import InvalidArgument, ResourceExhausted
from serving.generation import GenerateOptions, Generator
from serving.generation.cache import CacheManager
from serving.generation.output import GenerationStats, OutputProcessor, Scores, StreamOutput
from serving.generation.runner import StepRunner
from serving.generation.scheduler import Scheduler, StepCosts, Stream
from serving.sampling import Chunk, GenerationRequest, Sampling
from tuner.gate.decode_step import pad_rows, row_cache
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

VOCAB = 1003
TEXT = "the cat sat on the mat. a dog ran to the park and back. STOP here, then more. " * 30


@pytest.fixture(scope="module")
def llama():
    path = cached("llama-kv", "awkward", "torchscript")
    return cache_record(load_model(path)), OrtRunner(load_cpu(path))


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, n))


def _stream(prompt, max_tokens=8, **kw) -> Stream:
    request = GenerationRequest(tuple(prompt), max_tokens, **kw)
    return Stream(request, lambda c: None, StreamOutput(request, None))


def _manager(record, tokens: int = 10_000, **kw) -> CacheManager:
    return CacheManager(record, tokens * record.bytes_per_token, kw.pop("pad_to", "longest"),
                        **kw)


def _ids(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.ids]


def _generator(llama, **options) -> Generator:
    record, runner = llama
    return Generator(runner, record, VOCAB, GenerateOptions(**options), max_positions=256)


# ------------------------------------------------------------------------------ scheduler


def test_the_token_budget_is_shared_by_decode_rows_and_prefill_chunks(llama):
    record, _ = llama
    sched = Scheduler(_manager(record), max_streams=3, token_budget=10, takes_chunks=True)
    decoding = [_stream(_prompt(5, i)) for i in range(2)]
    for s in decoding:
        s.computed = 4  # only its last token is left: decoding
        sched.running.append(s)
    long, late, later = _stream(_prompt(30, 7)), _stream(_prompt(4, 8)), _stream(_prompt(4, 9))
    for s in (long, late, later):
        sched.add(s)
    plan = sched.schedule()
    assert plan.decode == tuple(decoding)
    assert [(s, n) for s, n in plan.prefill] == [(long, 8)]  # 10 - 2 decode rows: a chunk
    assert plan.tokens == 10 and list(sched.waiting) == [late, later]  # max 3 running
    long.computed = 8
    assert [n for _, n in sched.schedule().prefill] == [8]  # the next chunk, still budgeted


def test_while_streams_decode_prefill_is_held_to_a_share_of_a_decode_run(llama):
    """Measured costs: a decode run 200 ms, prefill 1 ms a token; with max_stall 0.5 a step
    beside decoding rows feeds 100 prompt tokens, never under MIN_CHUNK, and the whole budget
    once nothing decodes; before anything is measured only the budget bounds it."""
    record, _ = llama

    def plan(stall, decoding: int, costs=(0.200, 0.001)) -> list[int]:
        sched = Scheduler(_manager(record), max_streams=8, token_budget=200, takes_chunks=True,
                          max_stall=stall)
        if costs is not None:
            sched.costs.observe_decode(costs[0])
            sched.costs.observe_prefill(10, costs[1] * 10)
        for i in range(decoding):
            s = _stream(_prompt(5, i))
            s.computed = 4
            sched.running.append(s)
        sched.add(_stream(_prompt(150, 9)))
        return [n for _, n in sched.schedule().prefill]

    assert plan(0.5, 2) == [100]
    assert plan(0.5, 2, costs=(0.040, 0.001)) == [Scheduler.MIN_CHUNK]  # 20 tokens: too few
    assert plan(0.5, 0) == [150]  # nothing waits for a token: the whole budget
    assert plan(None, 2) == [150] and plan(0.5, 2, costs=None) == [150]
    costs = StepCosts()
    costs.observe_prefill(100, 0.2)
    costs.observe_prefill(10, 0.1)  # a moving average: 0.8 x 2 ms + 0.2 x 10 ms
    assert costs.prefill_token_s == pytest.approx(0.0036)


def test_beside_decoding_rows_one_chunk_after_a_past_where_each_runs_alone(llama):
    """GroupQueryAttention's graphs run a chunk after a past alone, a run (every weight read)
    per chunk: beside decoding rows a step feeds one such chunk, fresh prompts still join;
    with nothing decoding, or where chunks share a run, every stream gets its chunk."""
    record, _ = llama

    def plan(share: bool, decoding: int) -> list[tuple[int, int]]:
        sched = Scheduler(_manager(record), max_streams=8, token_budget=200, takes_chunks=True,
                          chunks_share_runs=share)
        for i in range(decoding):
            s = _stream(_prompt(5, i))
            s.computed = 4
            sched.running.append(s)
        for i in range(2):  # two prompts half prefilled: each chunk after its past
            s = _stream(_prompt(60, 10 + i))
            s.computed = 30
            sched.running.append(s)
        sched.add(_stream(_prompt(20, 20)))  # a fresh prompt: no past
        return [(s.computed, n) for s, n in sched.schedule().prefill]

    assert plan(share=False, decoding=2) == [(30, 30), (0, 20)]
    assert plan(share=False, decoding=0) == [(30, 30), (30, 30), (0, 20)]
    assert plan(share=True, decoding=2) == [(30, 30), (30, 30), (0, 20)]


def test_without_chunks_a_prompt_is_prefilled_whole(llama):
    record, _ = llama
    sched = Scheduler(_manager(record), max_streams=4, token_budget=10, takes_chunks=False)
    a, b = _stream(_prompt(30, 1)), _stream(_prompt(3, 2))
    sched.add(a)
    sched.add(b)
    assert [(s, n) for s, n in sched.schedule().prefill] == [(a, 30)]  # one at least
    assert list(sched.waiting) == [b]


def test_the_newest_stream_is_preempted_when_the_cache_budget_runs_out(llama):
    record, _ = llama
    sched = Scheduler(_manager(record, tokens=20), max_streams=4, token_budget=64,
                      takes_chunks=True)
    old, new = _stream(_prompt(10, 1)), _stream(_prompt(9, 2))
    old.computed, new.computed = 9, 8
    sched.running += [old, new]
    old.tokens.append(5)  # each has generated: 10 + 1 and 9 + 1 entries with the next step
    old.computed += 1
    new.tokens.append(6)
    new.computed += 1
    plan = sched.schedule()
    assert plan.preempted == (new,) and sched.running == [old] and sched.waiting[0] is new
    assert new.computed == 0 and new.preemptions == 1 and new.tokens[-1] == 6  # recomputed


# ------------------------------------------------------------------------- cache manager


def _row(record, length: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(record.past_shape(1, length, n)).astype(np.float32)
            for n in record.past}


def test_a_joining_stream_is_written_in_place_into_a_free_row(llama):
    record, _ = llama
    cache = _manager(record, pad_to="bucket", batch_buckets=(4,), cache_buckets=(16,))
    a, b, c = (_stream(_prompt(3, i)) for i in range(3))
    for s, n in ((a, 5), (b, 9), (c, 7)):
        s.cache, s.computed = _row(record, n, n), n
    want = {id(s): {k: v.copy() for k, v in s.cache.items()} for s in (a, b, c)}
    batch = cache.decode_batch([a, b])
    assert (len(batch.slots), batch.past, cache.gathers) == (4, 16, 1)  # bucket padded
    assert cache.decode_batch([a, b, c]) is batch and cache.gathers == 1  # in place: row 2
    for s in (a, b, c):
        got = cache.own(s)
        for name in record.past:
            np.testing.assert_array_equal(got[name], want[id(s)][name])
    cache.release(a)
    assert batch.slots[0] is None
    b.computed = 17  # longer than the batch's past: it cannot be written in place
    d = _stream(_prompt(3, 4))
    d.cache, d.computed = _row(record, 17, 17), 17
    assert cache.decode_batch([b, c, d]) is not batch and cache.gathers == 2


def test_left_pad_and_row_cache_round_trip(llama):
    record, _ = llama
    rows = [_row(record, n, n) for n in (2, 6, 0)]
    arrays, mask = pad_rows(record, rows, batch=4, past=8)
    assert mask.sum(axis=1).tolist() == [2, 6, 0, 0]
    for i, row in enumerate(rows[:2]):
        back = row_cache(record, arrays, mask[i], i)
        for name in record.past:
            np.testing.assert_array_equal(back[name], row[name])


def test_another_cache_layout_is_padded_and_joined_on_its_own_axes(llama):
    """A (batch, seq, heads, dim) cache (layout bshd): the same steps on its axes."""
    import dataclasses

    record, _ = llama
    bshd = dataclasses.replace(record, cache=dataclasses.replace(record.cache, layout="bshd"))
    rows = [_row(bshd, n, n) for n in (3, 5)]
    assert rows[0][bshd.past[0]].shape == (1, 3, bshd.kv_heads, bshd.head_dim)
    arrays, mask = pad_rows(bshd, rows, batch=2, past=6)
    assert arrays[bshd.past[0]].shape == (2, 6, bshd.kv_heads, bshd.head_dim)
    np.testing.assert_array_equal(arrays[bshd.past[0]][0, 3:], rows[0][bshd.past[0]][0])
    cache = _manager(bshd)
    a, b = _stream((1,)), _stream((2,))
    a.cache, a.computed = rows[1], 5
    batch = cache.decode_batch([a])
    cache.release(a)
    b.cache, b.computed = rows[0], 3
    assert cache.decode_batch([b]) is batch  # in place, on the seq axis 1
    np.testing.assert_array_equal(cache.own(b)[bshd.past[1]], rows[0][bshd.past[1]])


def test_the_prefix_cache_finds_whole_blocks_of_the_same_tokens_only(llama):
    record, _ = llama
    cache = _manager(record, prefix_block=4)
    first = _stream(_prompt(11, 1))
    first.computed, first.cache = 11, _row(record, 11, 3)
    cache.store_prefix(first)
    assert len(cache.prefix.blocks) == 2  # 8 of its 11 tokens in two blocks of 4
    same = _stream(first.request.prompt[:9] + (1, 2))
    cache.lookup_prefix(same)
    assert same.computed == 8 and same.prefix_hit == 8
    for name in record.past:
        np.testing.assert_array_equal(same.cache[name], first.cache[name][:, :, :8])
    other = _stream((first.request.prompt[0] + 1,) + first.request.prompt[1:])
    cache.lookup_prefix(other)
    assert other.computed == 0  # one other token in the first block: nothing shared
    short = _stream(first.request.prompt[:8])
    cache.lookup_prefix(short)
    assert short.computed == 4  # its last token must run: at most 7 of 8 from the cache


# --------------------------------------------------------------------------------- runner


def test_a_prefill_in_chunks_gives_the_logits_of_one_prefill(llama):
    record, runner = llama
    cache, steps = _manager(record), StepRunner(runner, record, VOCAB)
    prompt = _prompt(21, 5)
    whole, parts = _stream(prompt), _stream(prompt)
    one = steps.prefill(cache, [(whole, 21)])
    for n in (8, 8, 5):
        result = steps.prefill(cache, [(parts, n)])
        parts.cache, parts.computed = result.caches[0], parts.computed + n
    np.testing.assert_allclose(result.logits, one.logits, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------- output processor


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok


def _feed(request: GenerationRequest, tokens, tokenizer=None) -> list[Chunk]:
    sent: list[Chunk] = []
    stream = Stream(request, sent.append, StreamOutput(request, tokenizer))
    out = OutputProcessor(GenerationStats())
    for t in tokens:
        if stream.done:
            break
        out.emit(stream, t, Scores(-0.5))
    return sent


def test_a_stop_string_across_tokens_ends_the_stream_before_it():
    tok = _tokenizer()
    ids = tok.encode("a dog ran. STOP here").ids
    request = GenerationRequest((1,), 50, stop_strings=("STOP",))
    chunks = _feed(request, ids, tok)
    text = "".join(c.text for c in chunks)
    assert text == "a dog ran. " and chunks[-1].final and chunks[-1].reason == "stop"
    assert not any(c.final for c in chunks[:-1])
    held = _feed(GenerationRequest((1,), 50, stop_strings=("ST!",)), tok.encode("a ST").ids, tok)
    assert "".join(c.text for c in held).endswith("a ") and not held[-1].final  # "ST" held


def test_stop_ids_are_masked_until_min_tokens_and_logprobs_come_from_raw_logits(llama):
    record, _ = llama
    out = OutputProcessor(GenerationStats())
    logits = np.zeros((2, 5), np.float32)
    logits[:, 3] = 4.0  # token 3 is the stop id and the argmax
    logits[:, 1] = 2.0
    early = _stream((1,), 4, stop_ids=frozenset({3}), min_tokens=2, logprobs=True, ranks=True)
    late = _stream((1,), 4, stop_ids=frozenset({3}), min_tokens=0)
    tokens, scores = out.sample([early, late], logits)
    assert tokens == [1, 3]
    raw = logits[0].astype(np.float64)
    assert scores[0].logprob == pytest.approx(raw[1] - np.log(np.exp(raw).sum()))
    assert scores[0].rank == 2  # under the raw logits: the masked stop id scores higher
    assert scores[0].top is None and scores[1] is None  # only what was asked
    assert out.sample([late], logits)[1] == [None]
    ranked = out.sample([_stream((1,), 4, top_logprobs=3)], logits)[1][0].top
    assert [t for t, _ in ranked][:2] == [3, 1] and len(ranked) == 3  # then a tie of 0s
    assert ranked[1][1] == pytest.approx(scores[0].logprob)
    tied = out.sample([_stream((1,), 4, stop_ids=frozenset({3, 1}), min_tokens=1,
                               ranks=True)], logits)[1][0]
    assert tied.rank == 5  # a 0 among three 0s: every id scoring as high counts (vLLM's)
    chunks = _feed(GenerationRequest((1,), 4, stop_ids=frozenset({3}), logprobs=True), [2, 3])
    assert [c.ids for c in chunks] == [(2,), ()] and chunks[-1].reason == "stop"
    assert chunks[0].logprobs == (-0.5,)


def test_bad_words_mask_their_last_token_only_after_the_rest():
    out = OutputProcessor(GenerationStats())
    logits = np.zeros((1, 8), np.float32)
    logits[0, 3], logits[0, 2] = 4.0, 2.0  # 3 is the argmax, 2 the next
    prompt = (5, 7, 6)

    def first(*bad_words) -> int:
        return out.sample([_stream(prompt, bad_words=bad_words)], logits)[0][0]

    assert first() == 3
    assert first((3,)) == 2  # one token: always banned
    assert first((6, 3)) == 2 and first((7, 6, 3)) == 2  # the rest ends the sequence
    assert first((7, 3)) == 3 and first((5, 6, 3)) == 3 and first((1, 5, 7, 6, 3)) == 3
    assert first((6, 4)) == 3  # another word's ban leaves 3 alone


# ------------------------------------------------------------------ the engine, exactness


def _transformers_greedy(prompt, max_tokens: int) -> list[int]:
    import torch

    from models.build import build_torch_model, spec

    model = build_torch_model(spec("llama-kv", "awkward"))
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_chunked_prefill_is_token_identical_to_transformers(llama):
    gen = _generator(llama, prefill_tokens=8, max_streams=4)
    try:
        jobs = [(_prompt(n, 40 + n), 12) for n in (37, 5, 20)]
        got = collect(gen, [GenerationRequest(p, k) for p, k in jobs])
    finally:
        gen.close()
    for (p, k), chunks in zip(jobs, got):
        assert _ids(chunks) == _transformers_greedy(p, k)


def test_preempted_streams_give_what_they_give_alone(llama):
    record, _ = llama
    jobs = [GenerationRequest(_prompt(12 + 3 * i, 60 + i), 24) for i in range(6)]
    alone_gen = _generator(llama)
    try:
        alone = [_ids(collect(alone_gen, [r])[0]) for r in jobs]
    finally:
        alone_gen.close()
    preempted = []
    tight = Generator(llama[1], record, VOCAB, GenerateOptions(
        kv_cache_bytes=80 * record.bytes_per_token, prefix_cache=False),
        max_positions=256, stats=GenerationStats(on_preempt=lambda: preempted.append(1)))
    try:
        together = [_ids(c) for c in collect(tight, jobs)]
    finally:
        tight.close()
    assert together == alone and preempted  # the budget forced recomputation


def test_prefix_hits_are_token_identical_and_counted(llama):
    system = _prompt(48, 99)
    jobs = [GenerationRequest(system + _prompt(3 + i, 200 + i), 10) for i in range(5)]
    counts = []
    stats = GenerationStats(on_prefix=lambda looked, hit: counts.append((looked, hit)))
    cold = _generator(llama, prefix_cache=False)
    warm = Generator(llama[1], llama[0], VOCAB, GenerateOptions(), max_positions=256,
                     stats=stats)
    try:
        want = [_ids(collect(cold, [r])[0]) for r in jobs]
        got = [_ids(collect(warm, [r])[0]) for r in jobs]  # one after another: hits
    finally:
        cold.close()
        warm.close()
    assert got == want
    assert counts[0][1] == 0 and all(hit == 48 for _, hit in counts[1:])


def test_sixteen_streams_with_chunks_each_equal_to_itself_alone(llama):
    rng = np.random.default_rng(3)
    jobs = [GenerationRequest(_prompt(int(rng.integers(1, 60)), 300 + i),
                              int(rng.integers(1, 30))) for i in range(16)]
    gen = _generator(llama, prefill_tokens=16, max_streams=6)
    try:
        alone = [_ids(collect(gen, [r])[0]) for r in jobs]
        together: dict[int, list[int]] = {}

        def run(i: int) -> None:
            together[i] = _ids(collect(gen, [jobs[i]])[0])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        gen.close()
    assert [together.get(i) for i in range(16)] == alone


def test_stop_strings_need_a_tokenizer(llama):
    gen = _generator(llama)
    try:
        with pytest.raises(InvalidArgument, match="stop strings need a tokenizer"):
            gen.submit(GenerationRequest((1, 2), 4, stop_strings=("x",)), lambda c: None)
        with pytest.raises(InvalidArgument, match="byte budget"):
            small = Generator(llama[1], llama[0], VOCAB, GenerateOptions(kv_cache_bytes=1),
                              max_positions=256)
            try:
                small.submit(GenerationRequest((1, 2), 4), lambda c: None)
            finally:
                small.close()
    finally:
        gen.close()


class _Prefills:
    """The model, noting the rows of each run from an empty cache (a prompt's prefill),
    once `watching` (after the engine's own probes)."""

    def __init__(self, runner) -> None:
        self.runner, self.rows, self.watching = runner, [], False

    def infer(self, feeds):
        if self.watching and feeds["attention_mask"].shape[1] == feeds["input_ids"].shape[1]:
            self.rows.append(feeds["input_ids"].shape[0])
        return self.runner.infer(feeds)


def test_a_requests_streams_start_in_one_step_or_not_at_all(llama):
    """submit_all (a request's n samples, a batch of prompts): six streams where four fit
    are refused whole, none of them run; three are prefilled in one run however the
    engine's thread is scheduled."""
    record, runner = llama
    watched = _Prefills(runner)
    gen = Generator(watched, record, VOCAB, GenerateOptions(max_streams=3, max_queue=1),
                    max_positions=256)
    watched.watching = True
    requests = [GenerationRequest(_prompt(10, seed), 3) for seed in range(3)]
    try:
        with pytest.raises(ResourceExhausted, match="the server is full"):
            gen.submit_all([(r, lambda c: None) for r in requests] * 2)
        got = collect(gen, requests)
    finally:
        gen.close()
    assert watched.rows == [3]  # one prefill, of these three prompts only
    assert all(c[-1].final and len(_ids(c)) == 3 for c in got)


def test_seeded_sampling_does_not_depend_on_the_other_streams(llama):
    knobs = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=5)
    request = GenerationRequest(_prompt(9, 1), 16, knobs)
    gen = _generator(llama)
    try:
        alone = _ids(collect(gen, [request])[0])
        mixed = collect(gen, [request, GenerationRequest(_prompt(30, 2), 20)])
    finally:
        gen.close()
    assert _ids(mixed[0]) == alone


def test_a_stream_behind_another_picks_up_its_prefix_blocks_between_chunks(llama):
    """Two streams with one 64-token prefix sent at once, 24 tokens per step: the second
    prefills behind the first and takes each block the first computed meanwhile."""
    system = _prompt(64, 7)
    jobs = [GenerationRequest(system + _prompt(5, 70 + i), 8) for i in range(2)]
    counts = []
    stats = GenerationStats(on_prefix=lambda looked, hit: counts.append(hit))
    cold = _generator(llama, prefix_cache=False)
    warm = Generator(llama[1], llama[0], VOCAB, GenerateOptions(prefill_tokens=24),
                     max_positions=256, stats=stats)
    try:
        want = [_ids(collect(cold, [r])[0]) for r in jobs]
        got = [_ids(c) for c in collect(warm, jobs)]
    finally:
        cold.close()
        warm.close()
    assert got == want
    assert sorted(counts)[0] == 0 and sorted(counts)[1] >= 32  # the second found blocks


def _transformers_prompt_logprobs(prompt, k: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' log-probs of prompt tokens 1.. (one forward pass), and the k most likely
    ids at each of those positions."""
    import torch

    from models.build import build_torch_model, spec

    model = build_torch_model(spec("llama-kv", "awkward"))
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)])).logits[0, :-1].double()  # (S - 1, V)
    lp = torch.log_softmax(logits, -1)
    return (lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].numpy(),
            torch.topk(lp, k, -1).indices.numpy())


def test_prompt_logprobs_are_transformers_own_whatever_the_chunks_cache_and_preemption(llama):
    """A stream asking for its prompt's log-probs gets transformers' numbers in its first
    chunk: prefilled in chunks of 8, its prompt in the prefix cache already (never taken: every
    position must be computed), and preempted and recomputed under a tight cache budget."""
    record, runner = llama
    prompt = _prompt(37, 123)
    want, want_top = _transformers_prompt_logprobs(prompt, 3)
    ask = GenerationRequest(prompt, 20, prompt_logprobs=3)
    counts, preempted = [], []
    chunked = Generator(runner, record, VOCAB, GenerateOptions(prefill_tokens=8),
                        max_positions=256, stats=GenerationStats(
                            on_prefix=lambda looked, hit: counts.append(hit)))
    tight = Generator(runner, record, VOCAB, GenerateOptions(
        kv_cache_bytes=80 * record.bytes_per_token, prefix_cache=False), max_positions=256,
        stats=GenerationStats(on_preempt=lambda: preempted.append(1)))
    try:
        plain = collect(chunked, [GenerationRequest(prompt, 20)])[0]  # caches its blocks
        scored = collect(chunked, [ask])[0]
        # 20 + 37 entries fit the 80 at first; grown by 12 tokens each they do not: the
        # newest (ask) is preempted after its first chunk went out, and recomputed later
        crowded = collect(tight, [GenerationRequest(_prompt(20, 300), 30), ask])[-1]
    finally:
        chunked.close()
        tight.close()
    assert plain[0].prompt_logprobs is None and counts == [0, 0] and preempted
    for chunks in (scored, crowded):
        first = chunks[0]
        np.testing.assert_allclose(first.prompt_logprobs, want, atol=1e-4)
        assert [[i for i, _ in top] for top in first.prompt_top_logprobs] == want_top.tolist()
        assert all(c.prompt_logprobs is None for c in chunks[1:])
        assert _ids(chunks) == _ids(plain)


def test_the_one_bucket_rule_and_the_cache_buckets():
    from serving.generation.options import cache_buckets, next_bucket

    assert [next_bucket(n, (2, 8)) for n in (1, 2, 3, 8, 9, 17)] == [2, 2, 8, 8, 16, 32]
    assert next_bucket(0) == 1 and next_bucket(5) == 8
    assert cache_buckets(100, ()) == (16, 32, 64, 100)
    assert cache_buckets(100, (48, 128)) == (48, 100)
    with pytest.raises(ValueError, match="kv_cache_share must be in"):
        GenerateOptions(kv_cache_share=0)
