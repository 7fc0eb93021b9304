"""Exact: a RotaryEmbedding's one-row cos/sin caches expanded to its input's batch
(tuner.graph.rotary_caches says which nodes and why).

    cos (1, S, d/2) -> Expand(cos, [B] ++ shape(cos)[1:]) -> (B, S, d/2)      (sin likewise)
    B = Shape(x)[0:1]

Expand copies: every row gets the values the one row had, which is what torch computed by
broadcasting; where the cache already has B rows it changes nothing. Nodes that share one
pair of caches (every layer's q and k) share one Expand, placed before the first of them.
The rewrite is checked by running (tuner.gate.rows_alone: each row of a batch against the
original run on that row alone), never taken on trust.

    n = expand_rotary_caches(model)    # RewriteRefused where no node needs it
"""

from __future__ import annotations

import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.rotary_caches import COS, SIN, X, batch_one_rotaries
from tuner.rewrite.common import unique_name


def expand_rotary_caches(model: ir.Model) -> int:
    """Expand every one-row rotary cache to the batch; returns how many nodes now take them."""
    graph = model.graph
    nodes = batch_one_rotaries(model)
    if not nodes:
        raise RewriteRefused("no RotaryEmbedding takes one-row cos/sin caches beside a batch")
    groups: dict[tuple[int, int], list[ir.Node]] = {}
    for node in nodes:
        groups.setdefault((id(node.inputs[COS]), id(node.inputs[SIN])), []).append(node)
    for group in groups.values():
        first = group[0]
        added = _expand_nodes(graph, first)
        graph.insert_before(first, added)
        cos, sin = added[-2].outputs[0], added[-1].outputs[0]
        for node in group:
            node.replace_input_with(COS, cos)
            node.replace_input_with(SIN, sin)
    return len(nodes)


def _expand_nodes(graph: ir.Graph, node: ir.Node) -> list[ir.Node]:
    base = node.name or "rotary"

    def make(what: str, op: str, inputs: list, **attrs) -> ir.Node:
        # `base` names a node of the graph, so "<base>/batch_<what>" is a node name of its own
        n = ir.node(op, inputs, attributes=attrs or None, name=f"{base}/batch_{what}")
        n.outputs[0].name = unique_name(graph, f"{base}.batch_{what}")
        return n

    x, cos, sin = node.inputs[X], node.inputs[COS], node.inputs[SIN]
    batch = make("b", "Shape", [x], start=0, end=1)                          # [B]
    rest = make("rest", "Shape", [cos], start=1)                             # [S, d/2]
    shape = make("shape", "Concat", [batch.outputs[0], rest.outputs[0]], axis=0)  # [B, S, d/2]
    return [batch, rest, shape, make("cos", "Expand", [cos, shape.outputs[0]]),
            make("sin", "Expand", [sin, shape.outputs[0]])]
