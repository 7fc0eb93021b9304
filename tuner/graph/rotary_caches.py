"""ONNX's RotaryEmbedding (opset 23) nodes whose cos/sin caches hold one row where their
input holds the batch: torch's dynamo export at opset 23 of a decoder that computes its
positions itself (no `position_ids` input) writes them so.

Without position ids the op takes its caches per token, (batch, seq, rotary dim / 2). The
model computed `cos(positions x inv_freq)` for positions `arange(seq)[None]`: one row, which
torch broadcasts over the batch. ONNX Runtime (1.31) does not broadcast them: at batch > 1
every such node fails ("Inputs 'cos_cache' and 'sin_cache' are expected to have the same
shape as input 'x', got 1 and 16"), so the graph runs only one sequence at a time.

    x (B, heads, S, d) | cos (1, S, d/2) | sin (1, S, d/2)    ->   fails at B > 1

Found from the caches' shapes (as annotated, or inferred: tuner.graph.dims); a cache whose
first dim is the batch (positions fed per row, as a graph with a KV cache takes them) is
left alone, as is a graph whose batch is 1 itself.
"""

from __future__ import annotations

import onnx_ir as ir

from tuner.graph.dims import Dims
from tuner.graph.walk import op

ROTARY = "RotaryEmbedding"
X, COS, SIN, POSITION_IDS = 0, 1, 2, 3  # the op's input slots


def batch_one_rotaries(model: ir.Model, dims: Dims | None = None) -> tuple[ir.Node, ...]:
    """Every RotaryEmbedding fed no position ids whose cos cache has one row of a batch its
    input `x` may have more of, in graph order."""
    dims = dims or Dims(model)
    found = []
    for node in model.graph:
        if op(node) != ROTARY or _has(node, POSITION_IDS) or not _has(node, COS):
            continue
        cos, x = dims.shape(node.inputs[COS]), dims.shape(node.inputs[X])
        if cos is None or len(cos) != 3 or cos[0] != 1:
            continue
        if x is not None and x and x[0] == 1:  # a batch-1 export: nothing to broadcast to
            continue
        found.append(node)
    return tuple(found)


def _has(node: ir.Node, slot: int) -> bool:
    return len(node.inputs) > slot and node.inputs[slot] is not None
