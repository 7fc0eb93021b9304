"""Exact: attention over a grouped KV cache without repeating it (GQA without repeat_kv).

Hugging Face's eager and SDPA attention repeat each layer's K and V to the query heads
before the two attention MatMuls (`repeat_kv`: Unsqueeze(2) -> Expand -> Reshape), so the
exported graph copies the whole cache n_rep = heads / kv_heads times per layer and step:
on a CPU the largest single cost of a batched decode step after the projections. The query
heads of one kv head are contiguous (head h = g * n_rep + r reads kv head g), so folding
them into the query's sequence axis gives the same dot products against the grouped cache:

    scores:  q (B, H, S, D) -> (B, kvH, n_rep*S, D) @ k^T (B, kvH, D, T) -> (B, kvH, n_rep*S, T)
             -> (B, H, S, T)                       (was: q @ repeat(k)^T, (B, H, S, T))
    output:  p (B, H, S, T) -> (B, kvH, n_rep*S, T) @ v (B, kvH, T, D) -> (B, kvH, n_rep*S, D)
             -> (B, H, S, D)                       (was: p @ repeat(v))

Every reshape is of contiguous axes (Reshape's 0 copies B, and D or T); a Transpose and a
scalar Mul between the repeat and the score MatMul (the SDPA decomposition scales K^T) move
onto the grouped K unchanged, and a Shape of the repeated V (the decomposition reads it)
becomes the grouped one's times (1, n_rep, 1, 1). A repeat with any other consumer is left
as it is. The gate
proves the result like any variant's (tests/test_grouped_attention.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.rewrite.common import const_array, new_initializer, remove_unused

_SWAP_LAST = [0, 1, 3, 2]


def _axes(node: ir.Node) -> list[int] | None:
    if "axes" in node.attributes:
        return list(node.attributes["axes"].as_ints())
    return None if len(node.inputs) < 2 else _ints(node.inputs[1])


def _ints(value: ir.Value | None) -> list[int] | None:
    arr = const_array(value)
    return None if arr is None else [int(x) for x in arr.reshape(-1)]


def _grouped_source(reshape: ir.Node) -> ir.Value | None:
    """The grouped (B, kvH, T, D) tensor a repeat_kv Reshape repeats, else None."""
    expand = reshape.inputs[0].producer() if reshape.inputs[0] is not None else None
    if expand is None or expand.op_type != "Expand" or expand.domain not in ("", "ai.onnx"):
        return None
    unsqueeze = expand.inputs[0].producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or _axes(unsqueeze) != [2]:
        return None
    return unsqueeze.inputs[0]


def _scalar_mul(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of `node` when it is a Mul of `value` by a one-element constant."""
    if node.op_type != "Mul" or len(node.inputs) != 2:
        return None
    other = node.inputs[1] if node.inputs[0] is value else node.inputs[0]
    arr = const_array(other)
    return other if arr is not None and arr.size == 1 else None


class _Builder:
    def __init__(self, graph: ir.Graph, heads: int, kv_heads: int) -> None:
        self.graph = graph
        self.repeat = new_initializer(graph, "regroup.repeat",
                                      np.array([1, heads // kv_heads, 1, 1], np.int64))
        self.to_groups = new_initializer(graph, "regroup.to_groups",
                                         np.array([0, kv_heads, -1, 0], np.int64))
        self.to_heads = new_initializer(graph, "regroup.to_heads",
                                        np.array([0, heads, -1, 0], np.int64))

    def add(self, before: ir.Node, op: str, inputs, **attrs) -> ir.Value:
        node = ir.node(op, inputs, attributes=attrs or None)
        self.graph.insert_before(before, node)
        return node.outputs[0]

    def grouped_matmul(self, at: ir.Node, left: ir.Value, right: ir.Value) -> ir.Value:
        """(B, H, S, X) @ right (B, kvH, X, Y) -> (B, H, S, Y), without repeating right."""
        folded = self.add(at, "Reshape", [left, self.to_groups])  # (B, kvH, n_rep*S, X)
        product = self.add(at, "MatMul", [folded, right])  # (B, kvH, n_rep*S, Y)
        return self.add(at, "Reshape", [product, self.to_heads])  # (B, H, S, Y)


def _value_user(node: ir.Node, repeated: ir.Value) -> bool:
    """p @ repeat(v), or a whole Shape of repeat(v)."""
    if node.op_type == "MatMul":
        return node.inputs[1] is repeated and node.inputs[0] is not repeated
    return node.op_type == "Shape" and not node.attributes.get("start") and \
        node.attributes.get("end") is None


def _rewrite_value_use(b: _Builder, user: ir.Node, source: ir.Value) -> None:
    if user.op_type == "Shape":  # (B, kvH, T, D) * (1, n_rep, 1, 1) = (B, H, T, D)
        out = b.add(user, "Mul", [b.add(user, "Shape", [source]), b.repeat])
    else:
        out = b.grouped_matmul(user, user.inputs[0], source)
    ir.convenience.replace_all_uses_with(user.outputs[0], out)


def _rewrite_key_use(b: _Builder, transpose: ir.Node, source: ir.Value) -> bool:
    """q @ repeat(k)^T (optionally k^T times a scalar) -> grouped; False if the Transpose's
    users are not that."""
    perm = transpose.attributes.get("perm")
    if perm is None or list(perm.as_ints()) != _SWAP_LAST:
        return False
    kt = transpose.outputs[0]
    plans = []
    for user in list(kt.consumers()):
        scale = _scalar_mul(user, kt)
        matmuls = list(user.outputs[0].consumers()) if scale is not None else [user]
        if not all(m.op_type == "MatMul" and m.inputs[1] is (user.outputs[0] if scale is not None
                                                              else kt) for m in matmuls):
            return False
        plans.append((scale, matmuls))
    for scale, matmuls in plans:
        for matmul in matmuls:
            grouped = b.add(matmul, "Transpose", [source], perm=_SWAP_LAST)  # (B, kvH, D, T)
            if scale is not None:
                grouped = b.add(matmul, "Mul", [grouped, scale])
            out = b.grouped_matmul(matmul, matmul.inputs[0], grouped)
            ir.convenience.replace_all_uses_with(matmul.outputs[0], out)
    return True


def regroup_attention(model: ir.Model, heads: int, kv_heads: int) -> int:
    """Rewrite every repeat_kv of `model` (in place) whose uses are the attention MatMuls;
    returns how many were removed (0: the graph is left as it was)."""
    if kv_heads < 1 or heads <= kv_heads or heads % kv_heads:
        return 0
    graph = model.graph
    repeats = [(n, s) for n in list(graph) if n.op_type == "Reshape"
               for s in [_grouped_source(n)] if s is not None]
    if not repeats:
        return 0
    b = _Builder(graph, heads, kv_heads)
    done = 0
    for reshape, source in repeats:
        users = list(reshape.outputs[0].consumers())
        if any(u.op_type == "MatMul" for u in users) and all(
                _value_user(u, reshape.outputs[0]) for u in users):
            for user in users:
                _rewrite_value_use(b, user, source)
            done += 1
        elif len(users) == 1 and users[0].op_type == "Transpose":
            done += _rewrite_key_use(b, users[0], source)
    remove_unused(model)
    return done
