"""Graph-edit helpers shared by the exact rewrites (onnx_ir only).

Every rewrite works on names from `tuner.graph.shape.Sites` and edits weights copy-on-write:
exporters deduplicate identical initializers (one zero bias can feed nine nodes, sometimes
through Identity nodes), so a padded tensor is always a *new* initializer, named after the
node that uses it, and only that node's input is rewired.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
# the detectors' Identity-skipping readers: inspect and the rewrites must agree on what a
# constant is
from tuner.graph.walk import const_tensor
from tuner.graph.walk import source as source_through_identity  # noqa: F401 (re-exported)


def find_node(graph: ir.Graph, name: str) -> ir.Node:
    """The node called `name` in the top-level graph; RewriteRefused if it is not there."""
    for node in graph:
        if node.name == name:
            return node
    raise RewriteRefused(f"node {name!r} named by inspect is not in the graph")


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant behind a value (initializer, Constant node, through Identity), else None;
    any size (weights too), unlike the detectors' small-constant reader."""
    tensor = const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", name).strip("_") or "node"


def unique_name(graph: ir.Graph, base: str) -> str:
    """A value name not yet used by any initializer, input or node output of `graph`."""
    taken = set(graph.initializers)
    taken.update(v.name for v in graph.inputs)
    for node in graph:
        taken.update(o.name for o in node.outputs if o.name)
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    return name


def new_initializer(graph: ir.Graph, base: str, array: np.ndarray) -> ir.Value:
    """Register `array` as a new initializer named uniquely from `base`."""
    name = unique_name(graph, _safe(base))
    tensor = ir.Tensor(np.array(array, order="C"), name=name)  # (ascontiguousarray makes 0-d 1-d)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def set_const_input(graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, tag: str,
                    scope: object = None) -> ir.Value:
    """Point input `index` of `node` at a new initializer holding `array` (copy on write).

    Within one rewrite (`scope`), the replaced constant is remembered on the new value:
    exporters share shape-computing nodes between layers, so a later layer may meet a
    constant an earlier one already moved and must read what it said before that rewrite
    began (`original_const`)."""
    before = node.inputs[index]
    original = original_const(before, scope) if before is not None and scope is not None else None
    value = new_initializer(graph, f"{node.name}.{tag}", array)
    if original is not None:
        value.meta[ORIGINAL] = (scope, original)
    node.replace_input_with(index, value)
    return value


ORIGINAL = "shapetuner.original_const"


def private_node(graph: ir.Graph, user: ir.Node, trail: tuple[int, ...]) -> ir.Node:
    """The node at the end of `trail`, made private to `user` (copy on write for nodes).

    `trail` walks up from `user`: input trail[0] of `user` is made by node n1, input trail[1]
    of n1 by n2, ...; the last index is the input of the returned node the caller will
    rewrite. Exporters deduplicate shape computations (one Concat(batch, seq, 256) feeds
    every layer's Reshape, and maybe an unrelated Reshape whose 256 is the position count):
    editing such a node would change every reader. So each shared node on the way is cloned
    for `user` alone, named after the node it copies."""
    node = user
    for index in trail[:-1]:
        value = node.inputs[index]
        producer = value.producer() if value is not None else None
        if producer is None:
            raise RewriteRefused(f"node {node.name!r}: input {index} is not computed by a node")
        if len(value.uses()) > 1 or value.is_graph_output():
            producer = _clone_before(graph, producer, node)
            node.replace_input_with(index, producer.outputs[value.index()])
        node = producer
    return node


def _clone_before(graph: ir.Graph, node: ir.Node, before: ir.Node) -> ir.Node:
    """A copy of `node` (same inputs and attributes, new outputs) placed before `before`."""
    base = _safe(f"{node.name or node.op_type}.cow")
    names = {n.name for n in graph}
    name, i = base, 1
    while name in names:
        i += 1
        name = f"{base}_{i}"
    outputs = [ir.Value(name=unique_name(graph, _safe(f"{o.name or name}.cow")), shape=o.shape,
                        type=o.type) for o in node.outputs]
    attrs = [ir.Attr(a.name, a.type, a.value, a.ref_attr_name) for a in node.attributes.values()]
    clone = ir.Node(node.domain, node.op_type, list(node.inputs), attrs, overload=node.overload,
                    outputs=outputs, version=node.version, name=name)
    graph.insert_before(before, clone)
    return clone


def original_const(value: ir.Value | None, scope: object = None) -> np.ndarray | None:
    """The constant as it was when the rewrite `scope` began (before it replaced it)."""
    if value is not None and scope is not None and ORIGINAL in value.meta:
        owner, array = value.meta[ORIGINAL]
        if owner == scope:
            return array
    return const_array(value)


def pad_axis(array: np.ndarray, axis: int, new_size: int, fill: float = 0.0) -> np.ndarray:
    """`array` with `axis` grown to `new_size` by appending `fill`."""
    axis = axis % array.ndim
    extra = new_size - array.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot shrink axis {axis} from {array.shape[axis]} to {new_size}")
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, extra)
    return np.pad(array, widths, constant_values=np.array(fill, dtype=array.dtype))


def set_gemm_sizes(node: ir.Node, k: int, n: int) -> None:
    """A block-quantized GEMM's K and N attributes after padding (MatMulNBits, MatMulBnb4),
    its output's shape cleared: the axis engine or the caller sets what it knows."""
    node.attributes["K"] = ir.AttrInt64("K", k)
    node.attributes["N"] = ir.AttrInt64("N", n)
    node.outputs[0].shape = None


def refuse_smaller(node: ir.Node, axis: str, old: int, new: int) -> None:
    """RewriteRefused when padding would shrink `axis` (K or N) from `old` to `new`."""
    if new < old:
        raise RewriteRefused(f"node {node.name!r}: {axis} is {old}; cannot pad to the smaller "
                             f"{new}")


@dataclass(frozen=True)
class Projection:
    """A MatMul/Gemm with a constant weight: where the weight is and which axis is which."""

    node: ir.Node
    weight_index: int  # input index of the weight
    out_axis: int  # axis of the weight that is the projection's output features
    in_axis: int  # axis of the weight that contracts with the activations
    bias_index: int | None  # Gemm's C input, when present
    # "nbits" (com.microsoft.MatMulNBits), "bnb4" (com.microsoft.MatMulBnb4) or "integer"
    # (MatMulInteger): padded by tuner.rewrite.quantized, whose padded entries are zero
    # points or zero codes, not zeros
    quantized: str | None = None

    @property
    def weight(self) -> np.ndarray:
        if self.quantized == "qdq":  # the int8 weight behind DequantizeLinear
            return const_array(self.node.inputs[self.weight_index].producer().inputs[0])  # type: ignore[union-attr,return-value]
        return const_array(self.node.inputs[self.weight_index])  # type: ignore[return-value]

    @property
    def out_features(self) -> int:
        if self.quantized in ("nbits", "bnb4"):
            return int(self.node.attributes["N"].value)
        return int(self.weight.shape[self.out_axis])

    @property
    def in_features(self) -> int:
        if self.quantized in ("nbits", "bnb4"):
            return int(self.node.attributes["K"].value)
        return int(self.weight.shape[self.in_axis])


def projection(graph: ir.Graph, name: str, const_weight: bool = True) -> Projection:
    """The Projection for node `name`; RewriteRefused if it is not a MatMul/Gemm on a constant
    (with `const_weight=False` the weight may be computed, e.g. a Transpose of the embedding)."""
    node = find_node(graph, name)
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        w = const_array(node.inputs[1])
        if w is None and _dequantized_weight(node.inputs[1]):
            return Projection(node, 1, 1, 0, None, quantized="qdq")  # static QDQ, (K, N) int8
        if w is None and not const_weight:
            return Projection(node, 1, 1, 0, None)
        if w is None or w.ndim != 2:
            raise RewriteRefused(f"node {name!r}: MatMul whose weight is not a constant 2-D tensor")
        return Projection(node, 1, 1, 0, None)
    if node.op_type == "Gemm" and node.domain in ("", "ai.onnx"):
        attrs = {k: a.value for k, a in node.attributes.items()}
        if attrs.get("transA", 0):
            raise RewriteRefused(f"node {name!r}: Gemm with transA=1 is not a projection")
        if const_array(node.inputs[1]) is None and const_weight:
            raise RewriteRefused(f"node {name!r}: Gemm whose weight is not a constant")
        trans_b = bool(attrs.get("transB", 0))
        bias = 2 if len(node.inputs) > 2 and node.inputs[2] is not None else None
        return Projection(node, 1, 0 if trans_b else 1, 1 if trans_b else 0, bias)
    if (node.op_type == "MatMulNBits" and node.domain == "com.microsoft"
            and {"K", "N"} <= set(node.attributes)):
        return Projection(node, 1, 0, 1, None, quantized="nbits")  # weight (N, blocks, blob)
    if (node.op_type == "MatMulBnb4" and node.domain == "com.microsoft"
            and {"K", "N"} <= set(node.attributes)):
        return Projection(node, 1, 0, 1, None, quantized="bnb4")  # (N, K) codes, flat
    if node.op_type == "MatMulInteger" and node.domain in ("", "ai.onnx"):
        w = const_array(node.inputs[1])
        if w is None or w.ndim != 2:
            raise RewriteRefused(f"node {name!r}: MatMulInteger whose weight is not a 2-D constant")
        return Projection(node, 1, 1, 0, None, quantized="integer")  # weight (K, N) int8
    raise RewriteRefused(f"node {name!r}: expected MatMul or Gemm, found {node.op_type}")


def _dequantized_weight(v: ir.Value | None) -> bool:
    """Whether `v` is DequantizeLinear(2-D constant, ...): a static QDQ graph's weight."""
    p = v.producer() if v is not None else None
    return (p is not None and p.op_type == "DequantizeLinear" and p.domain in ("", "ai.onnx")
            and const_array(p.inputs[0]) is not None and const_array(p.inputs[0]).ndim == 2)


def widen_outputs(graph: ir.Graph, proj: Projection, new_size: int, tag: str,
                  columns: np.ndarray | None = None) -> None:
    """Grow the projection's output features to `new_size` with zero weights (and zero bias).
    (The output's shape annotation is the caller's to update: the axis engine does it.)

    `columns`, when given, is where each old output feature goes (length old, values < new);
    otherwise the new features are appended at the end."""
    _not_quantized(proj)
    w = proj.weight
    set_const_input(graph, proj.node, proj.weight_index,
                    _scatter(w, proj.out_axis, new_size, columns), f"{tag}.weight")
    if proj.bias_index is not None:
        b = const_array(proj.node.inputs[proj.bias_index])
        if b is None:
            raise RewriteRefused(f"node {proj.node.name!r}: Gemm bias is not a constant")
        if b.ndim >= 1 and b.shape[-1] == w.shape[proj.out_axis]:
            set_const_input(graph, proj.node, proj.bias_index,
                            _scatter(b, -1, new_size, columns), f"{tag}.bias")
        elif b.size != 1:
            raise RewriteRefused(f"node {proj.node.name!r}: Gemm bias of shape {b.shape} "
                                 "does not match its output features")


def widen_inputs(graph: ir.Graph, proj: Projection, new_size: int, tag: str,
                 rows: np.ndarray | None = None) -> None:
    """Grow the projection's input features to `new_size` with zero weight rows."""
    _not_quantized(proj)
    w = proj.weight
    set_const_input(graph, proj.node, proj.weight_index,
                    _scatter(w, proj.in_axis, new_size, rows), f"{tag}.weight")


def _not_quantized(proj: Projection) -> None:
    """Zero rows of a quantized weight would dequantize to (0 - zero point) * scale, not 0:
    only tuner.rewrite.quantized pads those (vocabulary and FFN)."""
    if proj.quantized:
        raise RewriteRefused(f"node {proj.node.name!r}: {proj.node.op_type} weights are "
                             "quantized; only the vocabulary and FFN widths are padded through "
                             "them")


def _scatter(array: np.ndarray, axis: int, new_size: int, index: np.ndarray | None) -> np.ndarray:
    """Place `array`'s entries along `axis` at `index` inside a zero array of `new_size`."""
    if index is None:
        return pad_axis(array, axis, new_size)
    axis = axis % array.ndim
    shape = list(array.shape)
    shape[axis] = new_size
    out = np.zeros(shape, dtype=array.dtype)
    sel = [slice(None)] * array.ndim
    sel[axis] = index
    out[tuple(sel)] = array
    return out


def clear_shapes(values) -> None:
    """Forget stale shape annotations of widened values (graph outputs keep theirs)."""
    for v in values:
        if v is not None and not v.is_graph_output() and v.const_value is None:
            v.shape = None


def remove_unused(model: ir.Model) -> None:
    """Drop nodes and initializers nothing uses any more (the weights we replaced)."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    RemoveUnusedNodesPass()(model)
    graph = model.graph
    for name in [n for n, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()]:
        graph.initializers.pop(name)
