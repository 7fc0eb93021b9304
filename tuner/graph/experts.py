"""Mixture-of-experts blocks whose experts share one batched weight per projection, as
transformers exports GPT-OSS: every expert runs on every token and the router's weights
mix their outputs, through a MatMul on a constant (E, h, 2F) gate/up weight and one on an
(E, F, h) down weight (3-D weights: not walk.Linear's 2-D ones, so no FFN match).

    x (T, h) -> Repeat -> (E, T, h) @ (E, h, 2F) -> GLU -> (E, T, F) @ (E, F, h) -> mix

inspect reports them (experts, width per expert); no rewrite widens them. Experts that are a
Linear each (Qwen3-MoE) are FFNs of their own: tuner.graph.inspect groups them by layer."""

from __future__ import annotations

import onnx_ir as ir

from tuner.graph.shape import ExpertsSite
from tuner.graph.walk import const_shape, op


def _batched(node: ir.Node) -> tuple[int, ...] | None:
    """(E, K, N) of a MatMul on a constant 3-D weight, else None."""
    if op(node) != "MatMul" or len(node.inputs) != 2:
        return None
    shape = const_shape(node.inputs[1])
    return shape if shape is not None and len(shape) == 3 and shape[0] > 1 else None


def find_experts(graph: ir.Graph) -> list[ExpertsSite]:
    """Each block's up and down MatMuls, in graph order: an up (E, h, F or 2F) followed by
    the next batched MatMul, a down (E, F, h) of the same E and h."""
    batched = [(n, s) for n in graph if (s := _batched(n)) is not None]
    found, i = [], 0
    while i + 1 < len(batched):
        (up, (e, h, out)), (down, (e2, width, h2)) = batched[i], batched[i + 1]
        if e == e2 and h == h2 and out in (width, 2 * width):
            found.append(ExpertsSite(up.name or "", down.name or "", e, width))
            i += 2
        else:
            i += 1
    return found
