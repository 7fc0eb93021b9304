"""The longest sequence a model with a learned position table takes
(tuner.graph.io.max_positions), found from the graph and proved by running it: the model runs
at that length and fails one token past it. RoBERTa's positions count the tokens that are not
padding from padding_idx + 1 (`cumsum(mask) * mask + padding_idx`), two rows of its table
never a position; before 2026-12-07 one was counted, and `tuner optimize` on every RoBERTa
export planned a bucket one token too long and stopped with an internal error."""

from __future__ import annotations

import pytest

from models.build import DYNAMO_UNOPTIMIZED, cached
from tuner.cli import main
from tuner.gate.feeds import make_feeds
from tuner.graph.inspect import inspect_model
from tuner.graph.io import max_positions, vocab_for_feeds
from tuner.graph.load import load_model
from tuner.runtime.ort import OrtRunner, load_cpu

CASES = [("roberta", "torchscript", 254), ("roberta", "dynamo", 254),
         ("roberta", DYNAMO_UNOPTIMIZED, 254),  # an Add of the past's length 0 on the way
         ("opt", "torchscript", 256),  # arange + 2: a table of 258
         ("gpt2", "torchscript", 256), ("bert", "torchscript", 256)]


def _runs(runner: OrtRunner, model, vocab: int, seq: int) -> bool:
    feeds = make_feeds(model, vocab, [(1, seq)])[0]
    try:
        runner.infer(feeds)
        return True
    except Exception:  # noqa: BLE001 - ONNX Runtime's index error past the table
        return False


@pytest.mark.parametrize("name,exporter,want", CASES)
def test_the_longest_sequence_runs_and_one_more_does_not(name, exporter, want):
    path = cached(name, "awkward", exporter)
    model = load_model(path)
    shape = inspect_model(model)
    found = max_positions(model, shape)
    assert found == want
    runner = OrtRunner(load_cpu(str(path)))
    vocab = vocab_for_feeds(model, shape)
    assert _runs(runner, model, vocab, found)
    assert not _runs(runner, model, vocab, found + 1)


def test_optimize_plans_roberta_within_its_positions(tmp_path, capsys):
    src = cached("roberta", "awkward", "torchscript")
    assert main(["optimize", str(src), "-o", str(tmp_path / "out"), "--rounds", "2",
                 "--warmup", "0", "--no-probe", "--max-variants", "1", "--no-plots",
                 "--no-cache"]) == 0
    buckets = capsys.readouterr().out.split("seq [", 1)[1].split("]", 1)[0]
    assert max(int(b) for b in buckets.split(",")) == 254  # the model's longest sequence
