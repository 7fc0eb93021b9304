"""Quantize ops along a widened axis (onnxruntime.quantization.quantize_dynamic's graphs).

DynamicQuantizeLinear(x) -> (xq, scale, zero point): xq is elementwise in x, and the scale and
zero point are scalars computed from min(0, x) .. max(0, x). The widened entries that reach
it must be exactly 0 (zero-padded projections, a gated FFN's act(g) * 0): the range, hence
the scalars, are then what they were; the caller checks that (tuner.rewrite.ffn)."""

from __future__ import annotations

import onnx_ir as ir

from tuner.rewrite.axis.engine import Widen
from tuner.rewrite.common import const_array


def op_dynamic_quantize(w: Widen, node: ir.Node, tin: list) -> list:
    return [tin[0].moved(), None, None]  # (xq widened like x; scale, zero point scalars)


HANDLERS = {("", "DynamicQuantizeLinear"): op_dynamic_quantize}


def op_qdq(w: Widen, node: ir.Node, tin: list) -> list:
    """QuantizeLinear / DequantizeLinear with constant per-tensor scale and zero point (static
    QDQ): elementwise, and a padded 0 maps to the zero point and back to exactly 0."""
    for v in node.inputs[1:]:
        c = const_array(v) if v is not None else None
        if v is not None and (c is None or c.size != 1):
            raise w.refuse(node, "per-axis or computed quantization parameters on the widened "
                                 "axis")
    return [tin[0].moved()]


HANDLERS.update({("", "QuantizeLinear"): op_qdq, ("", "DequantizeLinear"): op_qdq})
