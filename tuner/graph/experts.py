"""Mixture-of-experts blocks whose experts share one batched weight per projection, as
transformers exports GPT-OSS: every expert runs on every token and the router's weights
mix their outputs, through a MatMul on a constant (E, h, 2F) gate/up weight and one on an
(E, F, h) down weight (3-D weights: not walk.Linear's 2-D ones, so no FFN match).

    x (T, h) -> Repeat -> (E, T, h) @ (E, h, 2F) -> GLU -> (E, T, F) @ (E, F, h) -> mix

ONNX Runtime's fused MoE op (onnxruntime-genai's builder writes it for GPT-OSS) holds them
too: fc1 (E, F or 2F, h) and fc2 (E, h, F), 4-bit or 8-bit packed along F in QMoE.

inspect reports them (experts, width per expert); no rewrite widens them. Experts that are a
Linear each (Qwen3-MoE) are FFNs of their own: tuner.graph.inspect groups them by layer."""

from __future__ import annotations

import onnx_ir as ir

from tuner.graph.shape import ExpertsSite
from tuner.graph.walk import MS, const_shape, op

_FUSED = (f"{MS}.MoE", f"{MS}.QMoE")  # inputs: x, router, fc1 weights, fc1 bias, fc2 weights


def _batched(node: ir.Node) -> tuple[int, ...] | None:
    """(E, K, N) of a MatMul on a constant 3-D weight, else None."""
    if op(node) != "MatMul" or len(node.inputs) != 2:
        return None
    shape = const_shape(node.inputs[1])
    return shape if shape is not None and len(shape) == 3 and shape[0] > 1 else None


def _fused(node: ir.Node) -> ExpertsSite | None:
    """A fused MoE op's experts: E and F from its fc2 weight (E, h, F, packed in QMoE)."""
    if op(node) not in _FUSED or len(node.inputs) < 5:
        return None
    shape = const_shape(node.inputs[4])
    if shape is None or len(shape) != 3:
        return None
    bits = node.attributes.get("expert_weight_bits")
    per_byte = 8 // int(bits.value) if op(node) == f"{MS}.QMoE" and bits is not None else 1
    return ExpertsSite(node.name or "", node.name or "", shape[0], shape[2] * per_byte)


def find_experts(graph: ir.Graph) -> list[ExpertsSite]:
    """Each block's experts, in graph order: a fused MoE op, or an up MatMul (E, h, F or 2F)
    followed by the next batched MatMul, a down (E, F, h) of the same E and h."""
    fused = [e for n in graph if (e := _fused(n)) is not None]
    if fused:
        return fused
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
