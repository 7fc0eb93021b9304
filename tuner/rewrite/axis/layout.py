"""Ops that move axes without computing: Transpose, Unsqueeze, Squeeze, Shape."""

from __future__ import annotations

import onnx_ir as ir

from tuner.rewrite.axis.engine import Widen


def op_Transpose(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    perm = list(node.attributes["perm"].value) if "perm" in node.attributes \
        else list(range(t.rank))[::-1]
    k = perm.index(t.rank + t.axis)
    return [t.moved(axis=k - t.rank)]


def op_Unsqueeze(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    axes = w.axes(node, 1)
    if axes is None:
        raise w.refuse(node, "axes are not constant")
    r_out = t.rank + len(axes)
    axes = sorted(a % r_out for a in axes)
    kept = [i for i in range(r_out) if i not in axes]
    k = kept[t.rank + t.axis]
    return [t.moved(axis=k - r_out, rank=r_out)]


def op_Squeeze(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    axes = w.axes(node, 1)
    if axes is None:
        raise w.refuse(node, "squeezed axes are not constant")
    axes = [a % t.rank for a in axes]
    k = t.rank + t.axis
    if k in axes:
        raise w.refuse(node, "squeezes the widened axis")
    r_out = t.rank - len(axes)
    return [t.moved(axis=(k - sum(a < k for a in axes)) - r_out, rank=r_out)]


def op_Shape(w: Widen, node: ir.Node, tin: list) -> list:
    return [None]


HANDLERS = {("", "Transpose"): op_Transpose, ("", "Unsqueeze"): op_Unsqueeze,
            ("", "Squeeze"): op_Squeeze, ("", "Shape"): op_Shape}
