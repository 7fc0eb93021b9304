"""`tuner unwindow` as a job, and the step `tuner optimize` takes first on such a graph:
onnxruntime-genai's windowed caches made as long as the full layers' (tuner.rewrite.unwindow),
checked against the windowed file by running (tuner.gate.windowed), and only then written,
atomically, as `tuner pad` writes.

    result, found = unwindow_file("genai/model.onnx", "full/model.onnx")
"""

from __future__ import annotations

import os
from pathlib import Path

from tuner.errors import BadInput, RewriteRefused
from tuner.gate.verify import Tolerance, VerifyResult
from tuner.gate.windowed import check_unwindowed
from tuner.graph.cache_record import cache_record
from tuner.graph.io import vocab_for_feeds
from tuner.graph.load import load_model
from tuner.graph.walk import const_tensor
from tuner.graph.windowed import WindowedCache, windowed_nodes
from tuner.jobs.pad import check_destination, load_reference, write_checked
from tuner.rewrite.unwindow import unwindow
from tuner.runtime.base import SessionSettings

COS_CACHE = 7  # GroupQueryAttention's rotary table input: (positions, rotary dim / 2)


def unwindow_file(src: str | os.PathLike, dst: str | os.PathLike,
                  tolerance: Tolerance = Tolerance(),
                  settings: SessionSettings = SessionSettings()
                  ) -> tuple[VerifyResult, WindowedCache]:
    """Load the windowed graph, make its caches full-length, check it against `src`, then
    write `dst` atomically. BadInput: no windowed cache; NotExact: the check failed and
    nothing was written."""
    src, dst = Path(src), Path(dst)
    check_destination(src, dst, "full-cache graph")
    model = load_model(src)
    positions = _rotary_positions(model)
    try:
        found = unwindow(model)
    except RewriteRefused as e:
        raise BadInput(f"{src}: {e}: nothing to unwindow") from None
    record = cache_record(model)
    vocab = vocab_for_feeds(model)
    result = write_checked(model, dst, lambda staged: check_unwindowed(
        lambda: load_reference(src, settings), lambda: load_reference(staged, settings),
        record, found, vocab, tolerance, positions))
    return result, found


def _rotary_positions(model) -> int | None:
    """The rows of the windowed layers' rotary table: the longest sequence they take."""
    for node in windowed_nodes(model.graph):
        cos = node.inputs[COS_CACHE] if len(node.inputs) > COS_CACHE else None
        t = const_tensor(cos)
        if t is not None and len(t.shape) == 2:
            return int(t.shape[0])
    return None


def describe(found: WindowedCache, result: VerifyResult) -> str:
    """One line for notes and logs: what was windowed and what the check found."""
    worst = max((o.max_abs for o in result.outputs), default=float("nan"))
    return (f"{len(found.nodes)} layer(s) kept only a window of {found.window} positions "
            f"(onnxruntime-genai's windowed caches): made full-length, checked by running "
            f"({result.feeds} rollouts crossing the window, logits max abs {worst:.3g})")
