"""ONNX's own attention ops (opset 23) along a widened head dim (see tuner.rewrite.axis.engine).

- `RotaryEmbedding` (non-interleaved) rotates dim i with i + d/2 of each head, reading
  cos/sin caches of d/2 entries: the head must be padded per half and the caches (grown from
  the inverse-frequency table) must follow; partial rotary (`rotary_embedding_dim`) refuses.
- `Attention` defaults its scale to 1/sqrt(head size): after padding that would be
  1/sqrt(d'), so the old scale is written as the attribute when the exporter left it out.

ONNX Runtime's com.microsoft.RotaryEmbedding (what its transformer optimizer fuses a
rotary into) is the same rotation with its inputs in another order (x, position_ids, cos, sin)
and constant caches, which tuner.rewrite.head_dim widens. Only 4-D (batch, heads, seq, d)
inputs are handled; the 3-D packed form (heads given as attributes) refuses, as do ONNX
Runtime's other fused attention ops.
"""

from __future__ import annotations

import math

import onnx_ir as ir

from tuner.rewrite.axis.engine import Track, Widen


def _attr(node: ir.Node, name: str, default):
    return node.attributes[name].value if name in node.attributes else default


def op_RotaryEmbedding(w: Widen, node: ir.Node, tin: list) -> list:
    return _rotary(w, node, tin[0], *(tin + [None, None, None])[1:3])


def op_ms_RotaryEmbedding(w: Widen, node: ir.Node, tin: list) -> list:
    return _rotary(w, node, tin[0], *(tin + [None, None, None, None])[2:4])


def _rotary(w: Widen, node: ir.Node, t, cos, sin) -> list:
    if t is None or t.rank != 4 or t.axis != -1:
        raise w.refuse(node, "only 4-D (batch, heads, seq, head dim) input is handled")
    if _attr(node, "interleaved", 0) or _attr(node, "rotary_embedding_dim", 0):
        raise w.refuse(node, "interleaved or partial rotary embedding")
    half = Track(-1, 0, tuple(range(t.old // 2)), t.new // 2)
    for cache in (cos, sin):
        if cache is None or cache.axis != -1 or cache.pos != half.pos or cache.new != half.new:
            raise w.refuse(node, "cos/sin caches are not widened to half the new head dim")
    per_half = tuple(list(range(t.old // 2)) + [t.new // 2 + i for i in range(t.old // 2)])
    if t.pos != per_half:
        raise w.refuse(node, "the head is not padded per half, as rotate-half needs")
    return [t]


def op_Attention(w: Widen, node: ir.Node, tin: list) -> list:
    q, k, v = (tin + [None, None, None])[:3]
    if any(x is None or x.rank != 4 or x.axis != -1 for x in (q, k, v)):
        raise w.refuse(node, "Q, K and V must all be 4-D and widened on the head dim")
    if not q.same(k):
        raise w.refuse(node, "Q and K are widened differently")
    if any(t is not None for t in tin[3:]):
        raise w.refuse(node, "widened mask or past key/value")
    if len(node.outputs) > 1 and any(o is not None and o.uses() for o in node.outputs[1:]):
        raise w.refuse(node, "present key/value outputs are used (KV cache)")
    if "scale" not in node.attributes:
        node.attributes["scale"] = ir.AttrFloat32("scale", 1.0 / math.sqrt(q.old))
    return [v] + [None] * (len(node.outputs) - 1)


HANDLERS = {("", "RotaryEmbedding"): op_RotaryEmbedding, ("", "Attention"): op_Attention,
            ("com.microsoft", "RotaryEmbedding"): op_ms_RotaryEmbedding}
