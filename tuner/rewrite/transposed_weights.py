"""Exact: a weight stored as (out, in) and transposed by the graph, stored transposed.

torch's dynamo exporter without its optimizer (`torch.onnx.export(..., optimize=False)`, what
a user turns to when the optimizer is slow or fails on a big model) writes each
`nn.Linear` as its weight, a Transpose, and the MatMul:

    W (out, in) --Transpose(perm=[1, 0])--> (in, out) --> MatMul(x, .)

The rewrites pad a projection's stored weight, so they need the MatMul's weight to be the
initializer itself. Here each such Transpose whose only input is a 2-D initializer read by
nothing else becomes an initializer holding W.T: the same numbers the Transpose produced at
run time. A weight read elsewhere too (a tied embedding, which a Gather reads as (vocab, h))
is left as it is: storing both would double it, and the LM-head rewrite reads it through the
Transpose already.

    count = fold_transposed_weights(model)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.graph.walk import op
from tuner.rewrite.common import new_initializer


def fold_transposed_weights(model: ir.Model) -> int:
    """Store every lone transposed 2-D weight transposed; returns how many were folded."""
    graph = model.graph
    folded = 0
    for node in list(graph):
        w = node.inputs[0] if op(node) == "Transpose" and node.inputs else None
        out = node.outputs[0]
        if (w is None or not _lone_matrix(graph, w) or not _swaps(node)
                or out.is_graph_output()):
            continue
        data = np.ascontiguousarray(w.const_value.numpy().T)  # type: ignore[union-attr]
        stored = new_initializer(graph, f"{w.name or node.name}.T", data)
        out.replace_all_uses_with(stored)
        graph.remove(node, safe=True)
        graph.initializers.pop(w.name)
        folded += 1
    return folded


def _lone_matrix(graph: ir.Graph, w: ir.Value) -> bool:
    """A 2-D initializer (not a graph input) that one node reads, once."""
    return (w.const_value is not None and w.name in graph.initializers
            and not w.is_graph_input() and len(w.const_value.shape) == 2
            and len(w.uses()) == 1)


def _swaps(node: ir.Node) -> bool:
    perm = node.attributes.get("perm")
    return perm is None or list(perm.value) == [1, 0]
