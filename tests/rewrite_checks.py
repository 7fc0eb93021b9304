"""Checks every exact-rewrite test repeats: the padded file passed the gate, keeps the
original's inputs and outputs, runs at other batch/sequence sizes, and inspects as padded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from tuner.gate.feeds import make_feeds
from tuner.gate.verify import Tolerance, verify
from tuner.graph.inspect import inspect_path
from tuner.graph.shape import ModelShape
from tuner.jobs.pad import PadResult, pad_file
from tuner.rewrite.compose import PadRequest
from tuner.runtime.registry import get_backend

GATE_SHAPES = ((1, 5), (2, 9))
OTHER_SHAPES = ((4, 3), (1, 40))


def io_signature(path: Path) -> list[tuple]:
    sess = get_backend("ort-cpu").load(path).session
    return ([("in", i.name, i.type, tuple(i.shape)) for i in sess.get_inputs()]
            + [("out", o.name, o.type, tuple(o.shape)) for o in sess.get_outputs()])


def pad_and_check(src: Path, dst: Path, req: PadRequest) -> tuple[PadResult, ModelShape]:
    result = pad_file(src, dst, req, shapes=GATE_SHAPES)
    assert result.accuracy is not None and result.accuracy, result.accuracy.table()
    assert dst.exists()
    onnx.checker.check_model(str(dst))  # unique names, no dangling inputs
    assert io_signature(dst) == io_signature(src)
    original = inspect_path(src)
    vocab = original.vocab_size or 100
    backend = get_backend("ort-cpu")
    other = verify(backend.load(src), backend.load(dst), make_feeds(src, vocab, OTHER_SHAPES, seed=7),
                   Tolerance())
    assert other, other.table()
    return result, inspect_path(dst)


def weight(path: Path, node_name: str, index: int = 1) -> np.ndarray:
    """The constant input `index` of node `node_name` in the saved model."""
    from tuner.graph.load import load_model
    from tuner.rewrite.common import const_array, find_node

    model = load_model(path)
    return const_array(find_node(model.graph, node_name).inputs[index])
