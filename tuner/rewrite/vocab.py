"""Vocabulary v -> v' > v, exactly.

The LM head's weight gets v' - v zero output features (zero bias entries too), and a Slice
right after the head's GEMM cuts the logits back to v: everything downstream (bias Add,
reshapes, the graph output with its name, shape and dtype) sees exactly what it saw before,
while the big GEMM runs at the padded size. A tied embedding is padded with the same zero rows,
so that head and embedding still share their storage; token ids never reach those rows.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.shape import Sites
from tuner.rewrite import quantized
from tuner.rewrite.common import (clear_shapes, const_array, new_initializer, pad_axis, projection,
                                  set_const_input, source_through_identity)


def _weight_chain(node: ir.Node, index: int) -> tuple[ir.Value, list[ir.Value], bool]:
    """The initializer behind the head's weight input, the values between, and whether an odd
    number of 2-D Transposes sits between them (the initializer is then the other way round)."""
    value = node.inputs[index]
    chain: list[ir.Value] = []
    flipped = False
    while True:
        value = source_through_identity(value)
        if value is None:
            raise RewriteRefused(f"node {node.name!r}: LM head without a weight")
        producer = value.producer()
        if producer is None or value.const_value is not None:
            return value, chain, flipped
        if producer.op_type == "Transpose":
            perm = list(producer.attributes["perm"].value) if "perm" in producer.attributes else [1, 0]
            if perm != [1, 0]:
                raise RewriteRefused(f"node {producer.name!r}: LM head weight transposed by {perm}")
            chain.append(value)
            flipped = not flipped
            value = producer.inputs[0]
            continue
        if producer.op_type == "Constant":
            return value, chain, flipped
        raise RewriteRefused(f"node {node.name!r}: LM head weight comes from {producer.op_type} "
                             f"node {producer.name!r}, not a constant")


def _only_gathers_besides(value: ir.Value, allowed: set[ir.Node]) -> bool:
    """True when every use of `value` is in `allowed` or is a Gather's data (an embedding)."""
    return all(u.node in allowed or (u.node.op_type == "Gather" and u.idx == 0)
               for u in value.uses())


def _replace_initializer(graph: ir.Graph, value: ir.Value, array: np.ndarray, base: str) -> None:
    """Every user of `value` now reads a new initializer holding `array`."""
    new = new_initializer(graph, base, array)
    value.replace_all_uses_with(new)


def pad_vocab(graph: ir.Graph, sites: Sites, new_size: int) -> int:
    """Pad the LM head (and a tied embedding) to `new_size` outputs; returns the old size."""
    if not sites.lm_head:
        raise RewriteRefused("no LM head to pad (an encoder, or inspect found none)")
    head = projection(graph, sites.lm_head, const_weight=False)
    node = head.node
    if head.quantized:  # new rows hold the zero point (tuner.rewrite.quantized)
        v = head.out_features
        if new_size < v:
            raise RewriteRefused(f"vocabulary is {v}; cannot pad to the smaller {new_size}")
        if new_size > v:
            quantized.widen_out(graph, head, new_size, f"vocab{new_size}")
            _slice_back(graph, quantized.output_node(head), v)
        return v
    source, chain, flipped = _weight_chain(node, head.weight_index)
    w = const_array(source)
    if w is None or w.ndim != 2:
        raise RewriteRefused(f"node {node.name!r}: LM head weight is not a 2-D constant")
    axis = head.out_axis if not flipped else 1 - head.out_axis  # the vocab axis of `source`
    v = int(w.shape[axis])
    if new_size < v:
        raise RewriteRefused(f"vocabulary is {v}; cannot pad to the smaller {new_size}")
    if new_size == v:
        return v
    chain_nodes = {c.producer() for c in chain} | {node}
    tag = f"{node.name}.vocab{new_size}"
    if source.is_initializer() and _only_gathers_besides(source, chain_nodes):
        # Shared with the embedding (or private): pad in one place, uses stay shared.
        _replace_initializer(graph, source, pad_axis(w, axis, new_size), tag)
        clear_shapes(chain)
    else:
        # Shared with something we do not understand: the head gets a private padded copy.
        eff = w.T if flipped else w
        set_const_input(graph, node, head.weight_index, pad_axis(eff, head.out_axis, new_size),
                        "vocab.weight")
    _pad_tied_embedding(graph, sites, source, v, new_size)
    if head.bias_index is not None:
        b = const_array(node.inputs[head.bias_index])
        if b is not None and b.ndim >= 1 and b.shape[-1] == v:
            set_const_input(graph, node, head.bias_index, pad_axis(b, -1, new_size), "vocab.bias")
    _slice_back(graph, node, v)
    return v


def _pad_tied_embedding(graph: ir.Graph, sites: Sites, head_source: ir.Value, v: int,
                        new_size: int) -> None:
    """TorchScript ties by a duplicate initializer: pad the embedding's rows too, so that the
    copies stay equal (inspect still sees them tied). Only when Gathers alone read it."""
    if not (sites.tied and sites.embedding) or sites.embedding == head_source.name:
        return
    emb = graph.initializers.get(sites.embedding)
    if emb is None or emb.const_value is None or not _only_gathers_besides(emb, set()):
        return
    table = emb.const_value.numpy()
    if table.ndim == 2 and table.shape[0] == v:
        _replace_initializer(graph, emb, pad_axis(table, 0, new_size), f"{sites.embedding}.vocab{new_size}")


def _slice_back(graph: ir.Graph, node: ir.Node, v: int) -> None:
    """Insert Slice(head_out, [0], [v], [-1]) and move every user (and a graph output slot,
    name included) of the head's output onto it."""
    out = node.outputs[0]
    name, shape, typ = out.name, out.shape, out.type
    sliced = ir.Value(name=f"{name}.vocab_sliced", shape=shape, type=typ)
    out.replace_all_uses_with(sliced, replace_graph_outputs=True)
    consts = [new_initializer(graph, f"{node.name}.slice_{k}", np.array([x], dtype=np.int64))
              for k, x in (("starts", 0), ("ends", v), ("axes", -1))]
    slice_node = ir.Node("", "Slice", [out, *consts], outputs=[sliced],
                         name=f"{node.name}/vocab_slice")
    graph.insert_after(node, slice_node)
    out.name = f"{name}.vocab_padded"
    sliced.name = name
    out.shape = None
