"""Elementwise ops along a widened axis: tracked operands must agree entry for entry,
constant operands spanning the axis are scattered the same way, and a scalar computed from a
shape at run time (the attention scale) is pinned to the value it had."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.rewrite.axis.engine import Track, Widen, scatter
from tuner.rewrite.axis.shapemath import scalar
from tuner.rewrite.common import const_array

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Neg", "Cast", "Identity",
               "IsNaN", "Equal", "Sigmoid", "Tanh", "Relu", "Erf", "Cos", "Sin", "Abs", "Sqrt",
               "Exp", "Not", "And", "Or", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
               "CastLike", "Dropout", "Reciprocal", "Log", "Softplus", "Softsign", "Sign", "Floor",
               "Ceil", "Round", "Gelu", "Elu", "Selu", "LeakyRelu", "HardSwish", "HardSigmoid",
               "Mish"}
# ONNX Runtime's fused activations (after its transformer optimizer): elementwise, a bias
# operand broadcast along the last axis.
MS_ELEMENTWISE = {"BiasGelu", "FastGelu", "Gelu", "QuickGelu", "BiasAdd"}
ONE_FILL = {("Div", 1), ("Pow", 1)}


def op_elementwise(w: Widen, node: ir.Node, tin: list) -> list:
    if node.op_type == "CastLike":  # its input 1 lends only its dtype (torch's unoptimized
        return [tin[0] for _ in node.outputs]  # SDPA: CastLike(1.0, k) for the scale)
    ref = next(t for t in tin if t is not None)
    ranks = [t.rank if t is not None else w.rank_any(v) for v, t in zip(node.inputs, tin)
             if v is not None]
    rank = max(r for r in ranks if r is not None)  # numpy broadcasting: the widest operand
    for j, (v, t) in enumerate(zip(node.inputs, tin)):
        if v is None:
            continue
        if t is not None:
            if not t.same(ref):
                raise w.refuse(node, f"operands widened differently (input {j})")
            continue
        c = const_array(v)
        if c is not None:
            _const_operand(w, node, j, c, ref)
            continue
        if w.pin_one(node, j) or scalar(w.math.eval(v, "old")) is not None:
            continue  # a scalar: pinned if it followed the widened shape, else kept
        r = w.rank(v)
        s = w.dims.shape(v)
        if r is not None and r < -ref.axis:
            continue  # broadcasts along the widened axis
        if s is not None and len(s) >= -ref.axis and s[ref.axis] == 1:
            continue
        raise w.refuse(node, f"operand {v.name!r} spans the widened axis but is not "
                          "widened with it")
    return [ref.moved(rank=rank) for _ in node.outputs]


def _const_operand(w: Widen, node: ir.Node, j: int, c: np.ndarray, t: Track) -> None:
    if c.ndim < -t.axis or c.shape[t.axis] == 1:
        return
    if c.shape[t.axis] != t.old:
        raise w.refuse(node, f"constant of shape {c.shape} on the widened axis of {t.old}")
    fill = 1.0 if (node.op_type, j) in ONE_FILL else 0.0
    w.set_const(node, j, scatter(c, t.axis, t, fill), "widened")


HANDLERS = {**{("", op): op_elementwise for op in ELEMENTWISE},
            **{("com.microsoft", op): op_elementwise for op in MS_ELEMENTWISE}}
