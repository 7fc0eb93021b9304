"""Quantize ops along a widened axis (onnxruntime.quantization.quantize_dynamic's graphs).

DynamicQuantizeLinear(x) -> (xq, scale, zero point): xq is elementwise in x, and the scale and
zero point are scalars computed from min(0, x) .. max(0, x). The widened entries that reach
it must be exactly 0 (zero-padded projections, a gated FFN's act(g) * 0): the range, hence
the scalars, are then what they were; the caller checks that (tuner.rewrite.ffn)."""

from __future__ import annotations

import onnx_ir as ir

from tuner.rewrite.axis.engine import Widen


def op_dynamic_quantize(w: Widen, node: ir.Node, tin: list) -> list:
    return [tin[0].moved(), None, None]  # (xq widened like x; scale, zero point scalars)


HANDLERS = {("", "DynamicQuantizeLinear"): op_dynamic_quantize}
