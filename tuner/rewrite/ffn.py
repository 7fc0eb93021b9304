"""FFN width f -> f' > f, exactly.

The up (and gate) projections get zero output columns and zero bias entries, the down
projection zero input rows: each extra unit computes act(0) (or act(0) * 0 when gated), a
finite number that meets a zero row and adds nothing. Between the projections the widened
tensor may pass through activations, bias Adds, casts and Reshapes whose shape constants
spell f (TorchScript's Gemm form reshapes to (B, S, f)); those are followed and fixed. Any
other op on that path refuses, naming the node, rather than guessing.

Fused gate+up projections (one weight of 2f output columns split in two) are padded per half,
so that each half keeps its units at the same positions.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.shape import FfnSite
from tuner.rewrite.common import (Projection, clear_shapes, const_array, original_const, projection,
                                  set_const_input, widen_inputs, widen_outputs)

# Elementwise ops that map a finite 0 to a finite value: extra units stay harmless.
UNARY = {"Relu", "Gelu", "FastGelu", "BiasGelu", "Sigmoid", "Tanh", "Erf", "Neg", "Abs", "Cast",
         "Identity", "Softplus", "Elu", "Selu", "LeakyRelu", "HardSigmoid", "HardSwish", "Mish",
         "QuickGelu", "Sin", "Cos", "Exp", "Sqrt", "CastLike"}
BINARY = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"}
# Constants on these input slots are padded with ones, so that no padded unit divides by zero.
ONE_FILL = {("Div", 1), ("Pow", 1)}


def pad_ffn(graph: ir.Graph, site: FfnSite, new_size: int, layer: int) -> int:
    """Widen one FFN block to `new_size` units; returns the old width."""
    up = projection(graph, site.up)
    down = projection(graph, site.down)
    gate = projection(graph, site.gate) if site.gate else None
    f = int(down.weight.shape[down.in_axis])
    if new_size < f:
        raise RewriteRefused(f"FFN of layer {layer} ({site.down}) has width {f}; cannot pad to "
                             f"the smaller {new_size}")
    if new_size == f:
        return f
    fused = up.out_features == 2 * f and gate is None
    if up.out_features != f and not fused:
        raise RewriteRefused(f"node {site.up!r}: {up.out_features} output features do not match "
                             f"the {f} input features of {site.down!r}")
    if gate is not None and gate.out_features != f:
        raise RewriteRefused(f"node {site.gate!r}: {gate.out_features} output features, "
                             f"expected {f}")
    tag = f"ffn{new_size}"
    if fused:
        columns = np.concatenate([np.arange(f), new_size + np.arange(f)])
        widen_outputs(graph, up, 2 * new_size, tag, columns)
    else:
        widen_outputs(graph, up, new_size, tag)
    if gate is not None:
        widen_outputs(graph, gate, new_size, tag)
    widen_inputs(graph, down, new_size, tag)
    starts = [up.node.outputs[0]] + ([gate.node.outputs[0]] if gate else [])
    _fix_region(graph, starts, down, f, new_size, fused)
    return f


def _fix_region(graph: ir.Graph, starts: list[ir.Value], down: Projection, f: int, new: int,
                fused: bool) -> None:
    """Walk from the widened projections to the down projection, fixing what encodes f."""
    region = _reachable(starts, down.node)
    frontier = list(starts)
    done: set[ir.Node] = set()
    # A fused projection is 2f wide until its Split/Slice; the walk tracks each value's width.
    width = {v: (2 * f if fused else f) for v in starts}
    while frontier:
        value = frontier.pop()
        if value.is_graph_output():
            raise RewriteRefused(f"the FFN's inner value {value.name!r} is a graph output")
        for use in list(value.uses()):
            node, index = use.node, use.idx
            if node is down.node:
                if index != 0 or width[value] != f:
                    raise RewriteRefused(f"node {node.name!r}: the FFN's inner value reaches "
                                         f"input {index} with width {width[value]}")
                continue
            if node in done:
                continue
            done.add(node)
            outs = _fix_node(graph, node, region, width[value], new, f)
            for out, w in outs:
                width[out] = w
                frontier.append(out)
    clear_shapes(region)


def _reachable(starts: list[ir.Value], stop: ir.Node, limit: int = 10_000) -> set[ir.Value]:
    """Values downstream of `starts`, not through `stop` or Shape nodes (bounded, in case the
    inner value leaks into the rest of the graph: the walk then refuses on the first odd op)."""
    seen: set[ir.Value] = set(starts)
    frontier = list(starts)
    while frontier and len(seen) < limit:
        for use in frontier.pop().uses():
            if use.node is stop or use.node.op_type == "Shape":
                continue
            for out in use.node.outputs:
                if out not in seen:
                    seen.add(out)
                    frontier.append(out)
    return seen


def _fix_node(graph: ir.Graph, node: ir.Node, region: set[ir.Value], w: int, new: int,
              f: int) -> list[tuple[ir.Value, int]]:
    """Fix one node on the path; returns its outputs that carry the widened axis (and width)."""
    op = node.op_type
    new_w = new * (w // f)
    if op in UNARY:
        return [(node.outputs[0], w)]
    if op in BINARY:
        for j, inp in enumerate(node.inputs):
            if inp in region:
                continue
            _pad_operand(graph, node, j, w, new_w)
        return [(node.outputs[0], w)]
    if op == "Shape":
        return []  # computes the new width at run time; its users need no change
    if op == "Transpose":
        perm = list(node.attributes["perm"].value) if "perm" in node.attributes else None
        if perm is None or perm[-1] != len(perm) - 1:
            raise RewriteRefused(f"node {node.name!r}: Transpose moves the FFN's inner axis")
        return [(node.outputs[0], w)]
    if op == "Reshape" and node.inputs[0] in region:
        _fix_reshape(graph, node, w, new_w)
        return [(node.outputs[0], w)]
    if op == "Split" and w == 2 * f:
        _fix_split(graph, node, f, new)
        return [(o, f) for o in node.outputs]
    if op == "Slice" and w == 2 * f:
        _fix_slice(graph, node, f, new)
        return [(node.outputs[0], f)]
    raise RewriteRefused(f"node {node.name!r}: {op} on the FFN's inner path is not understood")


def _pad_operand(graph: ir.Graph, node: ir.Node, j: int, w: int, new_w: int) -> None:
    """A binary op's operand from outside the widened region: broadcast, or a constant to pad."""
    inp = node.inputs[j]
    c = const_array(inp)
    if c is None:
        dims = inp.shape.dims if inp is not None and inp.shape is not None else None
        if dims is not None and (len(dims) == 0 or dims[-1] == 1):
            return
        raise RewriteRefused(f"node {node.name!r}: operand {j} ({inp.name if inp else None!r}) "
                             "is computed elsewhere and may span the FFN's inner axis")
    if c.ndim == 0 or c.shape[-1] == 1:
        return
    if c.shape[-1] != w:
        raise RewriteRefused(f"node {node.name!r}: constant operand of shape {c.shape} on the "
                             f"FFN's inner axis of width {w}")
    fill = 1.0 if (node.op_type, j) in ONE_FILL else 0.0
    padded = np.concatenate([c, np.full(c.shape[:-1] + (new_w - w,), fill, dtype=c.dtype)], axis=-1)
    set_const_input(graph, node, j, padded, f"pad{new_w}")


def _fix_reshape(graph: ir.Graph, node: ir.Node, w: int, new_w: int) -> None:
    """A Reshape of the widened tensor: a constant last dim of w becomes new_w."""
    shape_in = node.inputs[1]
    c = original_const(shape_in)
    if c is not None:
        if c[-1] == w:
            set_const_input(graph, node, 1, np.concatenate([c[:-1], [new_w]]).astype(c.dtype),
                            f"shape{new_w}")
        elif c[-1] != -1:
            raise RewriteRefused(f"node {node.name!r}: Reshape to {c.tolist()} does not end in "
                                 f"the FFN width {w}")
        return
    producer = shape_in.producer() if shape_in is not None else None
    if producer is not None and producer.op_type == "Concat":
        last = producer.inputs[-1]
        lc = original_const(last)
        if lc is not None and lc.size >= 1 and lc[-1] == w:
            set_const_input(graph, producer, len(producer.inputs) - 1,
                            np.concatenate([lc[:-1], [new_w]]).astype(lc.dtype), f"dim{new_w}")
        elif lc is not None and lc.size >= 1 and lc[-1] != -1:
            raise RewriteRefused(f"node {node.name!r}: Reshape whose shape ends in the constant "
                                 f"{lc.tolist()}, not the FFN width {w}")
    # Otherwise the shape is computed at run time (from Shape nodes): it follows the new width.


def _fix_split(graph: ir.Graph, node: ir.Node, f: int, new: int) -> None:
    axis = node.attributes["axis"].value if "axis" in node.attributes else 0
    if axis not in (-1, _rank(node.inputs[0]) - 1):
        raise RewriteRefused(f"node {node.name!r}: Split on axis {axis}, not the FFN's inner axis")
    if len(node.outputs) != 2:
        raise RewriteRefused(f"node {node.name!r}: fused FFN Split into {len(node.outputs)} parts")
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = const_array(node.inputs[1])
        if sizes is None or sizes.tolist() != [f, f]:
            raise RewriteRefused(f"node {node.name!r}: split sizes are not [{f}, {f}]")
        set_const_input(graph, node, 1, np.array([new, new], dtype=sizes.dtype), f"split{new}")
    elif "split" in node.attributes:
        node.attributes["split"] = ir.AttrInt64s("split", [new, new])


def _fix_slice(graph: ir.Graph, node: ir.Node, f: int, new: int) -> None:
    """Slice of one half of a fused projection: bounds f (and 2f) become new (and 2 new)."""
    remap = {f: new, 2 * f: 2 * new, -f: -new}
    for j in (1, 2):
        c = const_array(node.inputs[j])
        if c is None:
            raise RewriteRefused(f"node {node.name!r}: Slice bounds are not constants")
        fixed = np.array([remap.get(int(x), int(x)) for x in c.reshape(-1)], dtype=c.dtype)
        if any(int(x) not in (0, f, 2 * f, -f) and abs(int(x)) < 2**62 for x in c.reshape(-1)):
            raise RewriteRefused(f"node {node.name!r}: Slice bounds {c.tolist()} do not split "
                                 "the fused FFN in halves")
        set_const_input(graph, node, j, fixed.reshape(c.shape), f"bound{new}")


def _rank(value: ir.Value | None) -> int:
    if value is None or value.shape is None:
        return -1
    return len(value.shape)
