"""Rows that move: the engine left-pads a row computed alone when it joins a longer batch,
which is exact only where the graph's positions are the row's own (tuner.gate.row_moves).
Optimum's Gemma exports take no position_ids and count positions from the cache's length:
there a stream batched beside a longer one generated something else than alone (found on
Gemma 3: 3 of 4 concurrent streams differed), so the engine runs their streams one at a
time (tuner optimize gives them the input instead: tests/test_position_ids.py). And slots
that a sliding window counts: a short prompt chunk after a past, padded to a longer chunk in
one run, has masked slots between its cache and its tokens, which the window counts; the
runner keeps it out of such runs where the graph has a window. Real exports: Optimum's Gemma
3, Gemma and Llama, a TorchScript Llama and its quantize_dynamic copy, whose rows are not
computed apart (one activation range per run) and never share a run either. The same checks
decide where a speculative run's rejected drafts may be masked out (`drafts_drop`)."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

import pytest
from serving_support import collect

from models import build, optimum, quantize
from serving.generation import GenerateOptions, Generator
from serving.generation.cache import CacheManager
from serving.generation.output import StreamOutput
from serving.generation.runner import StepRunner
from serving.generation.scheduler import Stream
from serving.sampling import GenerationRequest
from tuner.gate.row_moves import RowProbe, holes_stay, rows_apart, rows_move
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model, save_model
from tuner.rewrite.position_ids import add_position_ids
from tuner.runtime.ort import OrtRunner, load_cpu

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

VOCAB = optimum.VOCAB
# lengths either side of the exports' 16-position sliding window, so that batches re-pad
PROMPTS = ((6, 17, 301, 9, 42, 7), (5, 9) * 9, (11, 11, 11), tuple(range(20, 50)))


def _loaded(path):
    return cache_record(load_model(path)), OrtRunner(load_cpu(path))


@pytest.fixture(scope="module")
def exports():
    names = ("gemma3_text", "gemma", "llama", "mpt", "gpt_neo")
    paths = optimum.export_all([(n, optimum.TASKS[0]) for n in names])
    return dict(zip(names, paths))


@pytest.mark.parametrize("name", ["gemma3_text", "gemma"])
def test_a_graph_counting_positions_from_its_cache_length_fails_the_check(exports, name):
    record, runner = _loaded(exports[name])
    assert record.position_ids is None  # what makes it so: positions from the past's length
    assert not rows_move(runner, record)


def test_graphs_fed_their_positions_pass_it(exports):
    for path in (exports["llama"], build.cached("llama-kv", "awkward", "torchscript")):
        record, runner = _loaded(path)
        assert record.position_ids is not None
        assert rows_move(runner, record)


def _ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.ids]


class _Slowed:
    """The model, 2 ms slower a run: the first stream is still decoding when the others
    arrive however busy the machine (a tiny model's 24 steps can pass between two lines)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def infer(self, feeds):
        time.sleep(0.002)
        return self.runner.infer(feeds)


class _Gated:
    """The model, held at each run while `open` is clear: streams submitted meanwhile all
    wait for the next step, and the scheduler takes them together."""

    def __init__(self, runner) -> None:
        self.runner, self.open = runner, threading.Event()
        self.open.set()

    def infer(self, feeds):
        self.open.wait()
        return self.runner.infer(feeds)


def _greedy(gen, prompts, together: bool) -> list[list[int]]:
    """Each prompt's 24 greedy tokens (the first's 48): alone one after another, or
    together, the first decoding before the others arrive (so that they join its batch,
    and it moves)."""
    requests = [GenerationRequest(p, 48 if i == 0 else 24) for i, p in enumerate(prompts)]
    if not together:
        return [_ids(collect(gen, [r])[0]) for r in requests]
    first: queue.Queue = queue.Queue()
    gen.submit(requests[0], first.put)
    chunks = [first.get(timeout=120)]  # its first token: it is decoding now
    rest = collect(gen, requests[1:])
    while not chunks[-1].final:
        chunks.append(first.get(timeout=120))
    return [_ids(chunks)] + [_ids(c) for c in rest]


def _engine(runner, record, streams: int = 4, **options) -> Generator:
    return Generator(_Slowed(runner), record, VOCAB,
                     GenerateOptions(max_streams=streams, **options), max_positions=256)


def _both(gen, prompts) -> tuple[list, list]:
    """(alone, together): `prompts`' greedy tokens on `gen`, which is closed after."""
    try:
        return _greedy(gen, prompts, together=False), _greedy(gen, prompts, together=True)
    finally:
        gen.close()


@pytest.mark.parametrize("name, stays", [("gemma3_text", True), ("llama", False)])
def test_concurrent_streams_each_equal_to_itself_alone(exports, name, stays):
    record, runner = _loaded(exports[name])
    gen = _engine(runner, record)
    assert bool(gen.rows_stay) is stays
    assert gen.options.max_streams == (1 if stays else 4)
    alone, together = _both(gen, PROMPTS)
    assert together == alone


def test_without_the_check_gemma_3_streams_differ_from_themselves_alone(exports, monkeypatch):
    """What the check prevents, shown on the same export: rows batched (moved) anyway."""
    record, runner = _loaded(exports["gemma3_text"])
    alone, _ = _both(_engine(runner, record, streams=1), PROMPTS)
    monkeypatch.setattr(RowProbe, "rows_move", lambda self: True)
    gen = _engine(runner, record)
    assert not gen.rows_stay
    _, together = _both(gen, PROMPTS)
    assert together[0] != alone[0]  # the first stream, moved when longer ones joined


def _stream(prompt) -> Stream:
    request = GenerationRequest(tuple(prompt), 4)
    return Stream(request, lambda c: None, StreamOutput(request, None))


def test_under_a_window_a_short_chunk_after_a_past_runs_apart(exports, tmp_path, monkeypatch):
    model = load_model(exports["gemma3_text"])
    add_position_ids(model)  # rows may move; the window (16 slots) still counts slots
    record, runner = _loaded(save_model(model, tmp_path / "model.onnx"))
    assert record.window == 16
    cache = CacheManager(record, 10_000 * record.bytes_per_token, "longest")
    steps = StepRunner(runner, record, VOCAB)
    a, b = _stream(range(20, 50)), _stream(range(60, 71))  # 30 tokens, 11 fresh ones
    first = steps.prefill(cache, [(a, 20)])
    a.cache, a.computed = first.caches[0], 20  # a past longer than the window
    alone = steps.prefill(cache, [(a, 10)]).logits[0]
    assert steps._groups([(a, 10), (b, 11)]) == [[(b, 11)], [(a, 10)]]
    np.testing.assert_allclose(steps.prefill(cache, [(a, 10), (b, 11)]).logits[0], alone,
                               atol=1e-5, rtol=1e-5)
    # without the rule: one run, one masked slot between a's cache and its chunk
    monkeypatch.setattr(steps, "holes", True)
    assert len(steps._groups([(a, 10), (b, 11)])) == 1
    mixed = steps.prefill(cache, [(a, 10), (b, 11)]).logits[0]
    assert not np.allclose(mixed, alone, atol=1e-3, rtol=1e-3)


def test_masked_slots_before_a_chunk_are_found_by_running(exports):
    """Slots counted where no window pattern says so: MPT's ALiBi biases each key by its
    slot, so masked slots between a cache and its chunk change the distances; GPT-Neo's
    local layers slice a constant band table (its window, 16 here, now found too). The
    check fails on both and passes on Llama, whose positions and mask are the row's own."""
    for name, holes, window in (("mpt", False, None), ("gpt_neo", False, 16),
                                ("llama", True, None)):
        record, runner = _loaded(exports[name])
        assert rows_move(runner, record) and rows_apart(runner, record)
        assert holes_stay(runner, record) is holes, name
        assert record.window == window, name


def test_dropped_drafts_are_allowed_only_where_masked_entries_count_for_nothing(exports):
    """Speculation (tuner serve --speculate) masks the entries of rejected drafts out of a
    row's cache: exact on Llama, whose positions and mask are the row's own; not where
    masked slots count (MPT's ALiBi, GPT-Neo's window), nor where positions follow the
    cache's length (Gemma), nor where activations take one range per run (quantize_dynamic):
    the probe fails on each, and the server does not speculate there."""
    for name, drops in (("llama", True), ("mpt", False), ("gpt_neo", False), ("gemma", False)):
        record, runner = _loaded(exports[name])
        assert RowProbe(runner, record).drafts_drop() is drops, name
    record, runner = _loaded(quantize.cached("dynamic", "llama-kv"))
    assert not RowProbe(runner, record).drafts_drop()


def test_mpt_runs_a_short_chunk_after_a_past_apart(exports, monkeypatch):
    """MPT, served: the engine runs the check as it starts, and its runner then keeps a
    short prompt chunk after a past out of a longer chunk's run (they meet where chunk
    lengths are within PAD_SLACK); forced into one run, the chunk's logits change."""
    record, runner = _loaded(exports["mpt"])
    gen = _engine(runner, record)
    gen.close()
    assert gen.rows_stay is None and not gen.step_runner.holes
    cache = CacheManager(record, 10_000 * record.bytes_per_token, "longest")
    steps = gen.step_runner
    a, b = _stream(range(20, 37)), _stream(range(60, 71))  # 17 tokens, 11 fresh ones
    a.cache, a.computed = steps.prefill(cache, [(a, 7)]).caches[0], 7
    alone = steps.prefill(cache, [(a, 10)]).logits[0]
    assert steps._groups([(a, 10), (b, 11)]) == [[(b, 11)], [(a, 10)]]
    np.testing.assert_allclose(steps.prefill(cache, [(a, 10), (b, 11)]).logits[0], alone,
                               atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(steps, "holes", True)  # without the rule: one run, one masked slot
    assert len(steps._groups([(a, 10), (b, 11)])) == 1
    mixed = steps.prefill(cache, [(a, 10), (b, 11)]).logits[0]
    assert not np.allclose(mixed, alone, atol=1e-3, rtol=1e-3)


def _logprobs(chunks) -> list[float]:
    return [p for c in chunks for p in (c.logprobs or ())]


@pytest.mark.parametrize("checked", [True, False])
def test_mpt_prompts_after_a_shared_prefix_each_as_alone(exports, monkeypatch, checked):
    """What makes such runs in service: prompts that share a cached prefix (a system prompt)
    and differ after it by a token or two arrive together, and their chunks after the prefix
    share one run. On MPT each stream's log-probs are then what they are alone; with the
    check forced to pass, the shorter chunks had masked slots before them, and some stream's
    log-probs moved (by 0.026 on the first token here)."""
    if not checked:
        monkeypatch.setattr(RowProbe, "holes_stay", lambda self: True)
    record, runner = _loaded(exports["mpt"])
    gated = _Gated(runner)
    gen = Generator(gated, record, VOCAB, GenerateOptions(max_streams=4), max_positions=256)
    shared = tuple(range(100, 132))  # two prefix blocks
    requests = [GenerationRequest(shared + tuple(range(200, 200 + n)), 8, logprobs=True)
                for n in (9, 10, 11)]
    try:
        assert gen.step_runner.holes is not checked
        collect(gen, [GenerationRequest(shared + (5,), 2)])  # the shared prefix, cached
        alone = [_logprobs(collect(gen, [r])[0]) for r in requests]
        gated.open.clear()  # the model held in another stream's run while the three arrive
        gen.submit(GenerationRequest((7, 8, 9), 2), lambda chunk: None)
        together: list = []
        pending = threading.Thread(target=lambda: together.extend(collect(gen, requests)))
        pending.start()
        time.sleep(0.2)
        gated.open.set()
        pending.join(120)
    finally:
        gen.close()
    together = [_logprobs(c) for c in together]
    assert len(together) == 3 and all(len(a) == 8 for a in alone + together)  # compared
    close = all(np.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(alone, together))
    assert close is checked


def test_rows_quantized_with_one_range_per_run_never_meet():
    """ONNX Runtime's quantize_dynamic: DynamicQuantizeLinear takes one range over every
    row's activations, so a stream's tokens depend on the streams beside it. The engine
    finds it by running (rows_apart) and runs such a graph's streams one at a time, each
    then what it is alone; batched anyway (--allow-batch-variance), some stream is not.
    The range covers a row's own tokens too: a prompt whose first 16 tokens come from the
    prefix cache (the rest run as a chunk) is not the prompt run whole, so such a graph
    reuses no prefix, and the same request sent again gets the same tokens."""
    record, runner = _loaded(quantize.cached("dynamic", "llama-kv"))
    assert rows_move(runner, record) and not rows_apart(runner, record)
    prompts = [tuple(range(4 + 7 * i, 4 + 7 * i + n)) for i, n in enumerate((9, 21, 5, 14))]
    gen = _engine(runner, record)
    assert "quantized" in gen.rows_stay and gen.options.max_streams == 1
    assert not gen.options.prefix_cache
    alone, together = _both(gen, prompts)  # `together` sends every prompt a second time
    assert together == alone
    gen = _engine(runner, record, batch_variance=True)
    assert gen.rows_stay is None and gen.options.max_streams == 4 and gen.options.prefix_cache
    try:
        assert _greedy(gen, prompts, together=False) == alone
        # sent twice, 21 tokens: 16 of them a prefix hit the second time, so other ranges
        # for the rest, which changes the tokens of some prompts (not of every one: of
        # 11..31, 40..60, 100..120 on today's weights, the last two)
        longer = [tuple(range(s, s + 21)) for s in (11, 40, 100)]
        first, again = (_greedy(gen, longer, together=False) for _ in range(2))
        assert first != again
    finally:
        gen.close()
    gen = _engine(runner, record, batch_variance=True, prefix_cache=False)
    _, batched = _both(gen, prompts)
    assert batched != alone


def test_a_stream_that_takes_a_cancelled_streams_row_generates_what_it_does_alone():
    """On the same graph, one stream at a time: a long stream decoding is cancelled while a
    short one waits; the short one is admitted and prefilled in the step that drops the
    long one, so it joins the decode batch that one left, in its freed row, whose past is
    wider than its own entries. Those masked slots held the long stream's entries, and the
    graph's one range per run covers them: its tokens changed (found by bench/soak.py, a
    prompt in ~400 under clients that close their streams). They are zeroed as the row is
    placed, as the gate's zero-padded rows are. (Optimum's quantized Llama: its attention's
    MatMuls quantized too, keys and values with one range over every slot.)"""
    record, runner = _loaded(optimum.quantized("llama", per_channel=True))
    # the short row fills over half the left batch's past: joined in place, not gathered
    long, short = tuple(range(30, 50)), (7, 70, 8, 80, 9, 90, 10, 100, 11, 110, 12, 120)
    gen = _engine(runner, record)
    try:
        alone = _ids(collect(gen, [GenerationRequest(short, 24)])[0])
        first: queue.Queue = queue.Queue()
        handle = gen.submit(GenerationRequest(long, 48), first.put)
        first.get(timeout=120)  # its first token: it is decoding now
        after: queue.Queue = queue.Queue()
        gen.submit(GenerationRequest(short, 24), after.put)
        handle.cancel()
        chunks = [after.get(timeout=120)]
        while not chunks[-1].final:
            chunks.append(after.get(timeout=120))
        assert gen.cache.gathers == 2  # (it joined the left batch: no gather of its own)
    finally:
        gen.close()
    assert _ids(chunks) == alone
