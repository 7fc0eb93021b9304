"""`tuner rebatch` as a job, and the step `tuner optimize` and `tuner pad` take first on such
a graph: torch's opset-23 export whose rotary caches hold one row (tuner.graph.rotary_caches)
made to run at any batch (tuner.rewrite.rotary_batch), checked by running each row of a
batch against the original on that row alone (tuner.gate.rows_alone), and only then
written, atomically, as `tuner pad` writes.

    result, nodes = rebatch_file("dynamo23/model.onnx", "fixed/model.onnx")
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx_ir as ir

from tuner.errors import BadInput, RewriteRefused
from tuner.gate.feeds import DEFAULT_SHAPES, make_feeds
from tuner.gate.float_activations import float_copy
from tuner.gate.rows_alone import check_rows_alone
from tuner.gate.verify import Tolerance, VerifyResult
from tuner.graph.io import model_precision, quantizes_activations, vocab_for_feeds
from tuner.graph.load import load_model
from tuner.graph.roles import KV_CACHE, input_specs
from tuner.jobs.pad import check_destination, load_reference, write_checked
from tuner.rewrite.rotary_batch import expand_rotary_caches
from tuner.runtime.base import SessionSettings

PAST = 5  # a cache model is also checked on a step after this many cached positions


def rebatch_file(src: str | os.PathLike, dst: str | os.PathLike,
                 tolerance: Tolerance = Tolerance(),
                 settings: SessionSettings = SessionSettings()) -> tuple[VerifyResult, int]:
    """Load the graph, expand its one-row rotary caches, check it row by row against `src`
    (a dynamically quantized graph with its activations in float), then write `dst`
    atomically. BadInput: nothing to expand; NotExact: the check failed and nothing was
    written. Returns the check and how many rotary nodes were repaired."""
    src, dst = Path(src), Path(dst)
    check_destination(src, dst, "graph")
    model = load_model(src)
    specs = input_specs(model)
    feeds = _check_feeds(model)
    tolerance = tolerance.at_precision(model_precision(model))  # a half-precision graph's own
    try:
        count = expand_rotary_caches(model)
    except RewriteRefused as e:
        raise BadInput(f"{src}: {e}: it runs at any batch as it is") from None
    # quantize_dynamic quantizes activations over the whole run, so a row alone is rounded
    # otherwise than beside others: both graphs are checked with their activations in float
    # (every weight still its stored integer times its scale; the Expand is what differs)
    load = float_copy if quantizes_activations(model) else (
        lambda path: load_reference(path, settings))
    result = write_checked(model, dst, lambda staged: check_rows_alone(
        lambda: load(src), lambda: load(staged), feeds, specs, tolerance))
    return result, count


def _check_feeds(model: ir.Model) -> list[dict[str, np.ndarray]]:
    """The gate's feeds (batches 1 to 3, padded masks), and for a graph with a KV cache the
    same after a past of PAST positions."""
    vocab = vocab_for_feeds(model)
    feeds = make_feeds(model, vocab, DEFAULT_SHAPES)
    if any(s.role == KV_CACHE for s in input_specs(model)):
        feeds += make_feeds(model, vocab, DEFAULT_SHAPES, seed=1, past=PAST)
    return feeds


def describe(count: int, result: VerifyResult) -> str:
    """One line for notes and logs: what was repaired and what the check found."""
    worst = max((o.max_abs for o in result.outputs), default=float("nan"))
    return (f"{count} RotaryEmbedding node(s) took one-row cos/sin caches, so ONNX Runtime "
            f"ran the graph at batch 1 only (torch's opset-23 export): the caches now expand "
            f"to the batch, checked by running each row of {result.feeds} batches against "
            f"the original on that row alone (max abs {worst:.3g})")
