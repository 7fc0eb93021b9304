"""Where a decoder's rotary positions come from when it takes no position ids: the cache's
length. Optimum's Gemma exports (Gemma, Gemma 2, Gemma 3) compute

    cache_position = Range(past_length, past_length + S)      # (S,)
    position_ids   = Unsqueeze(cache_position, 0)             # (1, S) -> the rotary Cos/Sin

so a row's positions are its slots: right only while the row is never padded or moved.
tuner.rewrite.position_ids gives such a graph the input `position_ids` with a default that
keeps this computation; `positions_input` finds that input again (the server feeds it)."""

from __future__ import annotations

import onnx_ir as ir

from tuner.graph.walk import const_array, op, walk_back, walk_forward

POSITIONS = "position_ids"  # the input the rewrite adds: transformers' name and meaning
SLOT_DEFAULT = -1  # its default's value: any negative position means "the graph's own"
_LIMIT = 64  # nodes walked from a value to a Cos/Sin, or back to a past's Shape


def positions_input(graph: ir.Graph) -> str | None:
    """The name of the graph's defaulted `position_ids` input (the rewrite's), or None."""
    for v in graph.inputs:
        if v.name == POSITIONS and v.dtype == ir.DataType.INT64 and v.const_value is not None:
            return v.name
    return None


def _reaches_trig(v: ir.Value) -> bool:
    return bool(walk_forward(v, lambda n: True, lambda n: op(n) in ("Cos", "Sin"),
                             limit=_LIMIT))


def _from_past_length(v: ir.Value | None, pasts: set[str]) -> bool:
    """Whether `v` is computed from the Shape of a past input (the cache's length)."""
    if v is None:
        return False
    hits, _ = walk_back(v, lambda n: range(len(n.inputs)),
                        lambda x: op(x.producer()) == "Shape"
                        and x.producer().inputs[0] is not None
                        and x.producer().inputs[0].name in pasts, limit=_LIMIT)
    return bool(hits)


def _unsqueezed_at_0(node: ir.Node) -> bool:
    if op(node) != "Unsqueeze":
        return False
    axes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None and "axes" in node.attributes:
        axes = node.attributes["axes"].as_ints()
    return axes is not None and [int(a) for a in list(axes)] == [0]


def slot_positions(graph: ir.Graph, pasts: set[str]) -> list[ir.Value]:
    """The (1, S) position values the graph builds from its cache's length (an Unsqueeze at
    axis 0 of a Range that starts at the past's length) and feeds to a Cos/Sin."""
    found = []
    for node in graph:
        if op(node) != "Range" or not _from_past_length(node.inputs[0], pasts):
            continue
        for user, _ in node.outputs[0].uses():
            if _unsqueezed_at_0(user) and _reaches_trig(user.outputs[0]):
                found.append(user.outputs[0])
    return found


def rotary_uses(v: ir.Value) -> list[tuple[ir.Node, int]]:
    """The uses of `v` that lead to a Cos/Sin (the ones a fed position replaces)."""
    return [(n, i) for n, i in v.uses()
            if op(n) in ("Cos", "Sin") or any(_reaches_trig(o) for o in n.outputs)]
