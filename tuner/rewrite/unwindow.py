"""Exact: a windowed cache (tuner.graph.windowed) made as long as the full layers' caches.

onnxruntime-genai's sliding-window layers keep a cache of their window's own capacity; one
engine cache holds one length for every layer. Each such GroupQueryAttention keeps its
`local_window_size` and loses `sliding_window_cache`: fed the whole past, it masks what lies
beyond the window, the attention the windowed buffer computed (the op's own note: only the
distance between a query and a key counts, and rotary positions are absolute either way).
Its past and present take the full layers' sequence dims, so that every layer's past is
one length: what the builder writes with `windowed_kv_cache=false`.

    found = unwindow(model)            # RewriteRefused where no layer is windowed

The cost is memory: a sliding layer's cache grows with the sequence as the others do. The
rewrite is checked by running (tuner.gate.windowed), never taken on trust.
"""

from __future__ import annotations

import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.walk import op
from tuner.graph.windowed import (FLAG, GQA, PAST_SLOTS, PRESENT_SLOTS, SEQ_AXIS,
                                  WindowedCache, windowed_cache, windowed_nodes)


def unwindow(model: ir.Model) -> WindowedCache:
    """Drop every GroupQueryAttention's windowed cache; returns what was windowed."""
    graph = model.graph
    found = windowed_cache(graph)
    if found is None:
        raise RewriteRefused("no GroupQueryAttention keeps a windowed cache")
    if found.window < 1:
        raise RewriteRefused(f"a windowed cache without a window (local_window_size "
                             f"{found.window})")
    nodes = windowed_nodes(graph)
    full = [n for n in graph if op(n) == GQA and n not in nodes]
    past_dim = _seq_dim(n.inputs[i] for n in full for i in PAST_SLOTS if i < len(n.inputs))
    present_dim = _seq_dim(n.outputs[i] for n in full for i in PRESENT_SLOTS)
    for node in nodes:
        node.attributes.pop(FLAG)
    for v in graph.inputs:
        if v.name in found.pasts and past_dim is not None:
            _set_seq(v, past_dim)
    for v in graph.outputs:
        if v.name in found.presents and present_dim is not None:
            _set_seq(v, present_dim)
    return found


def _seq_dim(values) -> ir.SymbolicDim | int | None:
    """The sequence dim the full layers' caches share (None: every layer is windowed, or
    their shapes are unknown; then the windowed ones keep theirs)."""
    for v in values:
        if v is not None and v.shape is not None and len(v.shape) > SEQ_AXIS:
            return v.shape[SEQ_AXIS]
    return None


def _set_seq(v: ir.Value, dim) -> None:
    if v.shape is not None and len(v.shape) > SEQ_AXIS:
        dims = list(v.shape)
        dims[SEQ_AXIS] = dim
        v.shape = ir.Shape(dims)
