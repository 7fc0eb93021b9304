"""The gate's own copy of a graph, not a variant to serve: a graph quantized by ONNX Runtime's
`quantize_dynamic` with its activations left in float, so that a check can be exact where the
graph as served cannot (tuner.gate.seq2seq_quantized). Here, not in rewrite/: the gate runs
it, and nothing is written.

`quantize_dynamic` quantizes each MatMul's input at run time with one range per run
(DynamicQuantizeLinear: x -> x_q, x_scale, x_zp, the range min(0, x) .. max(0, x) over the
whole tensor) and multiplies integers (MatMulInteger, then Cast and a Mul by x_scale *
w_scale): a row's numbers depend on what else the run holds, so two runs of the same rows
that differ in anything (a whole sequence against one token at a time) differ by the
quantization's rounding. Here each DynamicQuantizeLinear hands on x itself at scale 1 and
zero point 0, and each MatMulInteger becomes a float MatMul of its operands less their zero
points:

    MatMulInteger(A, B, a_zp, b_zp) -> MatMul(A - a_zp, float(B) - b_zp)
    x_scale * w_scale               -> 1 * w_scale       (the Mul after it, untouched)

so every weight is still the stored integer times its stored scale (a changed weight stays
changed) and the graph computes each row apart, in float. The weights are cast at run time
(int8 stays int8 in memory until ONNX Runtime folds it).

    count = float_activations(model)   # RewriteRefused where such an input feeds another op
    runner = float_copy(path)          # the graph at `path` so, on ONNX Runtime's CPU provider
"""

from __future__ import annotations

import os

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.load import load_model
from tuner.runtime.base import SessionSettings
from tuner.runtime.ort import OrtRunner, load_cpu

DYNAMIC = "DynamicQuantizeLinear"
MATMUL = "MatMulInteger"


def float_activations(model: ir.Model) -> int:
    """Rewrite every DynamicQuantizeLinear of the top-level graph and every MatMulInteger
    (see the module's docstring); returns how many MatMulIntegers became MatMuls.
    RewriteRefused where a quantized activation feeds anything else (ConvInteger, QAttention:
    ops this does not take back to float) or a subgraph quantizes activations too."""
    graph = model.graph
    nested = [n for n in graph.all_nodes() if n.op_type == DYNAMIC and n.graph is not graph]
    if nested:
        raise RewriteRefused(f"{DYNAMIC} {nested[0].name!r} lies inside a subgraph")
    names = _Names(graph)
    for node in [n for n in graph if n.op_type == DYNAMIC]:
        _pass_through(graph, node, names)
    matmuls = [n for n in graph if n.op_type == MATMUL]
    for node in matmuls:
        _float_matmul(graph, node, names)
    return len(matmuls)


class _Names:
    """Value and node names no initializer, input or node output of the graph has yet."""

    def __init__(self, graph: ir.Graph) -> None:
        self.taken = {*graph.initializers, *(v.name for v in graph.inputs),
                      *(o.name for node in graph for o in node.outputs)}

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name


def _pass_through(graph: ir.Graph, node: ir.Node, names: _Names) -> None:
    """The activation itself, at scale 1 and zero point 0, where its quantized copy was."""
    quantized, scale, zero = node.outputs
    for value in (quantized, zero):
        for user, _ in value.uses():
            if user.op_type != MATMUL:
                raise RewriteRefused(f"{DYNAMIC} {node.name!r} feeds {user.op_type} "
                                     f"{user.name!r}: only {MATMUL} is taken back to float")
    if any(v.is_graph_output() for v in node.outputs):
        raise RewriteRefused(f"{DYNAMIC} {node.name!r}'s output is a graph output")
    quantized.replace_all_uses_with(node.inputs[0])
    scale.replace_all_uses_with(_constant(graph, names(f"{node.name}.one"), 1.0))
    zero.replace_all_uses_with(_constant(graph, names(f"{node.name}.zero"), 0.0))
    graph.remove(node, safe=True)


def _constant(graph: ir.Graph, name: str, number: float) -> ir.Value:
    tensor = ir.Tensor(np.array(number, np.float32), name=name)
    value = ir.Value(name=name, shape=ir.Shape(()), type=ir.TensorType(tensor.dtype),
                     const_value=tensor)
    graph.register_initializer(value)
    return value


def _float_matmul(graph: ir.Graph, node: ir.Node, names: _Names) -> None:
    """MatMul(A - a_zp, B - b_zp) in float in place of `node`; its int32 output's users (a
    Cast to float) take the float result."""
    a, b, *zeros = list(node.inputs) + [None] * (4 - len(node.inputs))
    if not _one_value(zeros[0]):  # (B's may be one per column: it broadcasts over K)
        raise RewriteRefused(f"{MATMUL} {node.name!r}: a zero point per row of A")
    new = _Nodes(graph, node, names)
    out = new("MatMul", [new.less_zero(a, zeros[0]), new.less_zero(b, zeros[1])])
    node.outputs[0].replace_all_uses_with(out, replace_graph_outputs=True)
    graph.remove(node, safe=True)


def _one_value(zero: ir.Value | None) -> bool:
    return zero is None or (zero.shape is not None and all(d == 1 for d in zero.shape))


class _Nodes:
    """New nodes before `before`, named after it."""

    def __init__(self, graph: ir.Graph, before: ir.Node, names: _Names) -> None:
        self.graph, self.before, self.names = graph, before, names

    def __call__(self, op: str, inputs: list, attributes: list | None = None) -> ir.Value:
        name = self.names(f"{self.before.name}.float_{op}")
        out = ir.Value(name=name)
        self.graph.insert_before(self.before, ir.Node("", op, inputs, attributes or [],
                                                      outputs=[out], name=name))
        return out

    def less_zero(self, value: ir.Value, zero: ir.Value | None) -> ir.Value:
        """float(value) - float(zero)."""
        made = self.float(value)
        return made if zero is None else self("Sub", [made, self.float(zero)])

    def float(self, value: ir.Value) -> ir.Value:
        if value.dtype == ir.DataType.FLOAT:
            return value
        return self("Cast", [value], [ir.AttrInt64("to", ir.DataType.FLOAT)])


def float_copy(path: str | os.PathLike) -> OrtRunner:
    """A runner of the graph at `path` with its activations in float, on ONNX Runtime's
    CPU provider (RewriteRefused where the graph quantizes activations for other ops)."""
    model = load_model(path)
    float_activations(model)
    proto = ir.serde.serialize_model(model).SerializeToString()
    # unoptimized: no folded float copy of every int8 weight (the check runs a few steps)
    return OrtRunner(load_cpu(proto, SessionSettings(graph_optimization="disable")))
