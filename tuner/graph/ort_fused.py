"""Graphs already run through ONNX Runtime's transformer optimizer (or exported with fused
ops): recognise them, list the fused ops, and read what dims the fused ops carry.

    com.microsoft.Attention(x, W_qkv (h, 3h), b, mask; num_heads)  -> o MatMul
    com.microsoft.MultiHeadAttention(q, k, v; num_heads)            -> o MatMul
    com.microsoft.GroupQueryAttention(q, k, v, ...; num_heads, kv_num_heads)
    Attention (ONNX opset 23)(q, k, v; q_num_heads, kv_num_heads, scale)
    com.microsoft.EmbedLayerNormalization(ids, segment, word_emb, pos_emb, ...)
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from tuner.graph.attention import AttnMatch, linears_by_output, rotary_of, walk_projection
from tuner.graph.dims import Dims
from tuner.graph.shape import AttentionSite, ScaleSite
from tuner.graph.walk import MS, Linear, const_shape, consumers, op, source

# Weight-quantized GEMMs: listed with the fused ops, but not a sign of the transformer optimizer.
QUANTIZED = {f"{MS}.MatMulNBits", f"{MS}.MatMulBnb4", f"{MS}.DynamicQuantizeMatMul",
             f"{MS}.MatMulIntegerToFloat", "MatMulInteger", "QLinearMatMul", "DequantizeLinear"}
# Standard-domain fused ops (ONNX opset 23) that torch's dynamo exporter may emit.
STANDARD_FUSED = {"Attention", "RotaryEmbedding", "RMSNormalization"}
FUSED_ATTENTION = {f"{MS}.Attention", f"{MS}.MultiHeadAttention", f"{MS}.GroupQueryAttention",
                   f"{MS}.PackedAttention", f"{MS}.PackedMultiHeadAttention",
                   f"{MS}.DecoderMaskedMultiHeadAttention", f"{MS}.SparseAttention", "Attention"}


@dataclass(frozen=True)
class Fusion:
    fused_ops: tuple[str, ...]  # every com.microsoft (or opset-23 fused) op type, sorted
    embedding: ir.Value | None = None  # EmbedLayerNormalization's word embedding
    hidden: int = 0
    activation: str = "unknown"
    ffn_size: int = 0
    lengths_mask: str | None = None  # the attention node that reads the mask as lengths


def lengths_mask_reader(graph: ir.Graph) -> str | None:
    """The first com.microsoft.Attention fed each row's count of ones for a mask (its input 3
    made by a ReduceSum, or by EmbedLayerNormalization's mask index), as ONNX Runtime's
    optimizer writes it by default (Optimum's O1-O4 copies): it takes a row's first that many
    tokens as the row, so a left-padded or holed mask gives wrong outputs; None otherwise."""
    for n in graph:
        if op(n) != f"{MS}.Attention" or len(n.inputs) < 4 or n.inputs[3] is None:
            continue
        made_by = n.inputs[3].producer()
        if made_by is not None and op(made_by) in ("ReduceSum", f"{MS}.EmbedLayerNormalization"):
            return n.name
    return None


def scan(graph: ir.Graph) -> Fusion:
    kinds = sorted({op(n) for n in graph
                    if n.domain == MS or op(n) in STANDARD_FUSED or op(n) in QUANTIZED})
    embedding = None
    hidden = 0
    for n in graph:
        if op(n) == f"{MS}.EmbedLayerNormalization" and len(n.inputs) > 2:
            table = source(n.inputs[2])
            shape = const_shape(table)
            if shape is not None and len(shape) == 2:
                embedding, hidden = table, shape[1]
                break
    activation = "unknown"
    if f"{MS}.FastGelu" in kinds:
        activation = "gelu_tanh"
    elif f"{MS}.BiasGelu" in kinds or f"{MS}.Gelu" in kinds:
        activation = "gelu"
    return Fusion(tuple(kinds), embedding, hidden, activation,
                  lengths_mask=lengths_mask_reader(graph))


def _attr(node: ir.Node, name: str, default=None):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _o_proj(node: ir.Node, by_output: dict[int, Linear]) -> ir.Node | None:
    frontier = [node.outputs[0]]
    for _ in range(6):
        nxt = []
        for v in frontier:
            for user in consumers(v):
                lin = by_output.get(id(user.outputs[0]))
                if lin is not None and lin.node is user and user.inputs[0] is v:
                    return user
                if op(user) in ("Reshape", "Transpose", "Identity", "Cast"):
                    nxt.extend(user.outputs)
        frontier = nxt
    return None


def attention_blocks(graph: ir.Graph, lins: list[Linear], dims: Dims):
    """AttnMatch for each fused attention op: heads from its attributes (or its inputs'
    shapes), head dim from the projection widths, scale from its attribute."""

    by_output = linears_by_output(lins)
    found = []
    for i, node in enumerate(graph):
        kind = op(node)
        if kind not in FUSED_ATTENTION:
            continue
        inputs = [x if x is not None else None for x in node.inputs] + [None, None, None]
        heads = int(_attr(node, "num_heads", 0) or _attr(node, "q_num_heads", 0) or 0)
        kv = int(_attr(node, "kv_num_heads", 0) or 0)
        if not heads and len(dims.shape(inputs[0]) or ()) == 4:  # ONNX Attention, (B, a, S, d)
            heads = dims.static(inputs[0], 1) or 0
            kv = kv or dims.static(inputs[1], 1) or 0
        kv = kv or heads
        o = _o_proj(node, by_output)
        q = k = v = qkv = None
        d, rotary, rotary_dim, plumbing = 0, "none", None, []
        projections: list[ir.Node] = [o] if o is not None else []
        if kind == f"{MS}.Attention":  # packed QKV weight is the op's own input 1
            w = const_shape(source(inputs[1]))
            sizes = _attr(node, "qkv_hidden_sizes")
            if w is not None and heads:
                d = (int(sizes[0]) if sizes else w[1] // 3) // heads
            qkv = node.name
        else:
            paths = [walk_projection(x, by_output) if x is not None else None for x in inputs[:3]]
            lq, lk, lv = [p.linears[0] if p is not None and p.linears else None for p in paths]
            if lq is not None and heads:
                four_d = len(dims.shape(inputs[0]) or ()) == 4  # (B, a, S, d) shows d
                shown = dims.static(inputs[0], -1) if four_d else None
                if lk is None or lk is lq:  # packed QKV in one input
                    qkv = lq.node.name
                    d, kv = _packed_heads(lq.out_dim, heads, kv, shown)
                else:
                    q, k = lq.node.name, lk.node.name
                    v = lv.node.name if lv is not None else None
                    d = shown or lq.out_dim // heads
                    kv = lk.out_dim // d if d else kv
            projections += [lin.node for lin in (lq, lk, lv) if lin is not None]
            if paths[0] is not None:
                rotary, rotary_dim = rotary_of(paths[0], d, dims)
            plumbing = [n.name for p in paths if p is not None for n in p.plumbing]
        if kind == f"{MS}.GroupQueryAttention" and _attr(node, "do_rotary", 0):
            rotary, rotary_dim = _gqa_rotary(node, d)  # rotary inside the op, from its cos cache
        scale_attr = _attr(node, "scale")
        value = float(scale_attr) if scale_attr else (d ** -0.5 if d else None)
        site = AttentionSite(q=q, k=k, v=v, o=o.name if o is not None else "", qkv=qkv,
                             reshapes=tuple(dict.fromkeys(plumbing)),
                             scale=ScaleSite("attribute", value, (node.name,)),
                             rotary=rotary, rotary_dim=rotary_dim,  # type: ignore[arg-type]
                             fused_op=kind)
        found.append(AttnMatch(i, site, tuple(dict.fromkeys(projections)), heads, kv, d))
    return found


def _packed_heads(width: int, heads: int, kv: int, shown: int | None) -> tuple[int, int]:
    """(head dim, kv heads) of a packed QKV projection `width` wide. The op's q input, where
    it shows its head dim (B, a, S, d), gives it, and the kv heads follow from the width: the
    op's own k input may count heads after repeat_kv (Falcon's [q.. k v] groups at opset
    23: k arrives with the q heads' count); otherwise the op's counts give the head dim."""
    if shown and width % shown == 0 and (width // shown - heads) % 2 == 0 \
            and width // shown > heads:
        return shown, (width // shown - heads) // 2
    return width // (heads + 2 * kv), kv


def _gqa_rotary(node: ir.Node, d: int) -> tuple[str, int | None]:
    """GroupQueryAttention with do_rotary: its cos_cache (input 7) is (positions, rotary/2)."""
    cos = const_shape(source(node.inputs[7])) if len(node.inputs) > 7 else None
    r = 2 * cos[1] if cos is not None and len(cos) == 2 else None
    if r is None or not d:
        return "full", r
    return ("partial" if r < d else "full"), r
