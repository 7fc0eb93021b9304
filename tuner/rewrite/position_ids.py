"""Exact where not fed: a decoder that counts its positions from its cache's length takes them
as an input.

Optimum's Gemma exports take no position ids: the graph builds them from the past's length
(tuner.graph.positions), so a row's rotary positions are its slots in the batch. A server
that batches rows of different lengths pads the shorter ones, and moves a row computed alone
when it joins a longer batch: its new tokens then get other positions than its cached keys
were rotated with, and it generates something else than alone (tuner.gate.row_moves). This
rule adds the input `position_ids` (B, S), with a default that selects the graph's own:

    fed (B, S) or the default [[-1]] (1, 1)
    positions = Where(fed < 0, slot_positions (1, S), fed)     # (1, S) unfed, (B, S) fed

Unfed (the default), every op computes what it did, bit for bit; fed each row's own count
(what the server feeds every graph that takes positions), rows may be padded and moved. Only
the uses that lead to the rotary Cos/Sin take the new value; the mask keeps the slots.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.kv_cache import find_kv_cache
from tuner.graph.positions import (POSITIONS, SLOT_DEFAULT, positions_input, rotary_uses,
                                   slot_positions)
from tuner.graph.roles import input_specs
from tuner.graph.role_names import POSITION_IDS, TOKEN_IDS
from tuner.rewrite.common import new_initializer, unique_name


def add_position_ids(model: ir.Model) -> str:
    """Give the graph the input `position_ids` for the positions it computes from its cache's
    length; returns the input's name. RewriteRefused when it takes positions already, has
    no cache, or builds no such positions."""
    graph = model.graph
    specs = input_specs(model)
    if positions_input(graph) is not None or any(
            s.role == POSITION_IDS or s.name == POSITIONS for s in specs):
        raise RewriteRefused("the graph takes position ids already")
    cache = find_kv_cache(graph)
    if cache is None:
        raise RewriteRefused("no KV cache: the positions follow the sequence, not a cache")
    found = slot_positions(graph, cache.pasts)
    if not found:
        raise RewriteRefused("no rotary positions computed from the cache's length")
    ids = next((s for s in specs if s.role == TOKEN_IDS), None)
    dims = [d if isinstance(d, int) else ir.SymbolicDim(d) for d in ids.dims] if ids else [
        ir.SymbolicDim("batch"), ir.SymbolicDim("sequence")]
    # checked: from here on the graph is edited
    fed = ir.Value(name=POSITIONS, shape=ir.Shape(dims), type=ir.TensorType(ir.DataType.INT64),
                   const_value=ir.tensor(np.array([[SLOT_DEFAULT]], np.int64), name=POSITIONS))
    graph.inputs.append(fed)
    graph.register_initializer(fed)
    zero = new_initializer(graph, "position_ids.zero", np.array(0, np.int64))
    for own in found:
        uses = rotary_uses(own)
        nodes = _select_nodes(graph, own, fed, zero)
        graph.insert_after(own.producer(), nodes)
        for user, index in uses:
            user.replace_input_with(index, nodes[-1].outputs[0])
    return fed.name


def _select_nodes(graph: ir.Graph, own: ir.Value, fed: ir.Value,
                  zero: ir.Value) -> list[ir.Node]:
    """Where(fed < 0, own, fed) in `own`'s dtype."""
    base = own.producer().name or "positions"
    nodes = []

    def node(op: str, inputs: list, **attrs) -> ir.Node:
        n = ir.node(op, inputs, attributes=attrs or None,
                    name=unique_name(graph, f"{base}/fed_{op}"))
        n.outputs[0].name = unique_name(graph, f"{base}.fed_{op.lower()}")
        nodes.append(n)
        return n

    value = fed
    if own.dtype is not None and own.dtype != ir.DataType.INT64:
        value = node("Cast", [fed], to=own.dtype).outputs[0]
        zero = node("Cast", [zero], to=own.dtype).outputs[0]
    unfed = node("Less", [value, zero])                                # (B, S) or (1, 1)
    node("Where", [unfed.outputs[0], own, value])                      # (B, S) or (1, S)
    return nodes
