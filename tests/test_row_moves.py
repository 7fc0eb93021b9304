"""Rows that move: the engine left-pads a row computed alone when it joins a longer batch,
which is exact only where the graph's positions are the row's own (tuner.gate.row_moves).
Optimum's Gemma exports take no position_ids and count positions from the cache's length:
there a stream batched beside a longer one generated something else than alone (found on
Gemma 3: 3 of 4 concurrent streams differed), so the engine runs their streams one at a
time (tuner optimize gives them the input instead: tests/test_position_ids.py). Real
exports: Optimum's Gemma 3, Gemma and Llama, and a TorchScript Llama."""

from __future__ import annotations

import queue

import pytest
from serving_support import collect

from models import build, optimum
from serving.generation import GenerateOptions, Generator
from serving.sampling import GenerationRequest
from tuner.gate.row_moves import rows_move
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

VOCAB = optimum.VOCAB
# lengths either side of the exports' 16-position sliding window, so that batches re-pad
PROMPTS = ((6, 17, 301, 9, 42, 7), (5, 9) * 9, (11, 11, 11), tuple(range(20, 50)))


def _loaded(path):
    return cache_record(load_model(path)), OrtRunner(load_cpu(path))


@pytest.fixture(scope="module")
def exports():
    names = ("gemma3_text", "gemma", "llama")
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


def _greedy(gen, prompts, together: bool) -> list[list[int]]:
    """Each prompt's 24 greedy tokens: alone one after another, or together, the first
    decoding before the others arrive (so that they join its batch, and it moves)."""
    requests = [GenerationRequest(p, 24) for p in prompts]
    if not together:
        return [_ids(collect(gen, [r])[0]) for r in requests]
    first: queue.Queue = queue.Queue()
    gen.submit(requests[0], first.put)
    chunks = [first.get(timeout=120)]  # its first token: it is decoding now
    rest = collect(gen, requests[1:])
    while not chunks[-1].final:
        chunks.append(first.get(timeout=120))
    return [_ids(chunks)] + [_ids(c) for c in rest]


@pytest.mark.parametrize("name, stays", [("gemma3_text", True), ("llama", False)])
def test_concurrent_streams_each_equal_to_itself_alone(exports, name, stays):
    record, runner = _loaded(exports[name])
    gen = Generator(runner, record, VOCAB, GenerateOptions(max_streams=4), max_positions=256)
    try:
        assert gen.rows_stay is stays
        assert gen.options.max_streams == (1 if stays else 4)
        alone = _greedy(gen, PROMPTS, together=False)
        assert _greedy(gen, PROMPTS, together=True) == alone
    finally:
        gen.close()


def test_without_the_check_gemma_3_streams_differ_from_themselves_alone(exports, monkeypatch):
    """What the check prevents, shown on the same export: rows batched (moved) anyway."""
    record, runner = _loaded(exports["gemma3_text"])
    alone_gen = Generator(runner, record, VOCAB, GenerateOptions(max_streams=1), max_positions=256)
    try:
        alone = _greedy(alone_gen, PROMPTS, together=False)
    finally:
        alone_gen.close()
    monkeypatch.setattr("serving.generation.engine.rows_move", lambda *args: True)
    gen = Generator(runner, record, VOCAB, GenerateOptions(max_streams=4), max_positions=256)
    try:
        assert not gen.rows_stay
        together = _greedy(gen, PROMPTS, together=True)
    finally:
        gen.close()
    assert together[0] != alone[0]  # the first stream, moved when longer ones joined
