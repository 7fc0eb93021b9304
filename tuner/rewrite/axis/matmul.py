"""MatMul and Softmax: a MatMul contracting two tracked axes with equal tracks ends them
(q . k over d); a softmax over the widened axis would change and refuses."""

from __future__ import annotations

import onnx_ir as ir

from tuner.rewrite.axis.engine import Widen
from tuner.rewrite.common import const_array


def op_Softmax(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    axis = node.attributes["axis"].value if "axis" in node.attributes else -1
    if axis % t.rank == t.rank + t.axis:
        raise w.refuse(node, "softmax over the widened axis")
    return [t]


def op_MatMul(w: Widen, node: ir.Node, tin: list) -> list:
    ta, tb = tin
    # A constant operand is a weight the widened axis must not reach, unless the constant is
    # itself the widened one: a rotary's inverse frequencies that a slimmer folded together
    # with their Expand, (1, d/2, 1) @ positions (Gemma through onnxslim)
    if any(const_array(v) is not None and t is None for v, t in zip(node.inputs, tin)):
        raise w.refuse(node, "a projection the widened axis was not meant to reach")
    if ta is not None and ta.axis == -1:
        if tb is None or tb.axis != -2 or not tb.same(ta.moved(axis=-2)):
            raise w.refuse(node, "contracts the widened axis with an unwidened one")
        return [None]
    if tb is not None and tb.axis == -2:
        raise w.refuse(node, "contracts the widened axis with an unwidened one")
    r = max(ta.rank if ta else 0, tb.rank if tb else 0)
    if ta is not None and tb is not None:
        if ta.axis <= -3 and ta.same(tb):
            return [ta.moved(rank=r)]  # a widened batch axis (heads) on both sides
        raise w.refuse(node, "two widened axes meet")
    if ta is not None and ta.axis == -2:
        return [ta.moved(rank=r)]
    if tb is not None and tb.axis == -1:
        return [tb.moved(rank=r)]
    raise w.refuse(node, "widened batch axis in a MatMul")


HANDLERS = {("", "Softmax"): op_Softmax, ("", "MatMul"): op_MatMul}
