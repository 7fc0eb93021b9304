"""Gather and GatherND with constant indices along axes other than the widened one."""

from __future__ import annotations

import onnx_ir as ir

from tuner.rewrite.axis.engine import Widen
from tuner.rewrite.common import const_array


def op_Gather(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    if t is None or tin[1] is not None:
        raise w.refuse(node, "gathers with widened indices")
    axis = (node.attributes["axis"].value if "axis" in node.attributes else 0) % t.rank
    k = t.rank + t.axis
    if axis == k:
        raise w.refuse(node, "gathers along the widened axis")
    r_idx = w.rank(node.inputs[1])
    if r_idx is None:
        raise w.refuse(node, "index rank unknown")
    r_out = t.rank - 1 + r_idx
    k_out = k - 1 + r_idx if axis < k else k
    return [t.moved(axis=k_out - r_out, rank=r_out)]


def op_GatherND(w: Widen, node: ir.Node, tin: list) -> list:
    """Constant indices into leading axes (dynamo's qkv[..., [-2], :] for Falcon's k and v):
    the trailing axes, the widened one among them, keep their place from the end."""
    t = tin[0]
    if t is None or tin[1] is not None or const_array(node.inputs[1]) is None:
        raise w.refuse(node, "gathers with widened or computed indices")
    idx = const_array(node.inputs[1])
    b = node.attributes["batch_dims"].value if "batch_dims" in node.attributes else 0
    if t.rank + t.axis < b + idx.shape[-1]:
        raise w.refuse(node, "gathers along the widened axis")
    r_out = idx.ndim - 1 + t.rank - b - idx.shape[-1]
    return [t.moved(rank=r_out)]


HANDLERS = {("", "Gather"): op_Gather, ("", "GatherND"): op_GatherND}
