"""How many heads an attention block has and how wide each is, read from the walks from its
score MatMul back to the projections (tuner.graph.attention.walk_projection): the shapes
where q meets k, the Reshape targets that split heads, the widths of the projections, and a
fused qkv projection's q Slice.

    heads, kv_heads, head_dim = head_counts(q_in, q_walk, k_walk, fused_qkv, dims, scale)
"""

from __future__ import annotations

from typing import Protocol

import onnx_ir as ir

from tuner.graph.dims import Dims
from tuner.graph.walk import Linear, const_array, op, source


class Walked(Protocol):
    """What a walk from a Q/K/V MatMul input back to its projection passed through."""

    linears: list[Linear]
    plumbing: list[ir.Node]


def _reshape_dims(path: Walked) -> tuple[int, int, ir.Node | None]:
    """(heads, head_dim, node) from a constant Reshape target like (B, S, a, d) on the path."""
    for node in path.plumbing:
        if op(node) != "Reshape":
            continue
        target = const_array(node.inputs[1])
        if target is None:
            target = _concat_target(node.inputs[1])
        if target is None or len(target) != 4:
            continue
        a, d = target[2], target[3]
        if d is not None and d > 0:
            return (int(a) if a is not None and a > 0 else 0), int(d), node
    return 0, 0, None


def _sliced_heads(q: Walked, d: int, dims: Dims) -> int:
    """The query heads of a fused projection whose q is a Slice of its last axis at constant
    bounds (Phi-3's `qkv[..., : heads * d]`): its width over `d`; 0 where no such Slice."""
    lin = q.linears[0] if q.linears else None
    for node in q.plumbing:
        if op(node) != "Slice" or lin is None or source(node.inputs[0]) not in (
                lin.output, lin.node.outputs[0]):
            continue
        bounds = [const_array(node.inputs[i]) if len(node.inputs) > i else None for i in (1, 2, 3)]
        if any(b is None or b.size != 1 for b in bounds):
            continue
        rank = len(dims.shape(node.inputs[0]) or (0, 0, 0))
        if int(bounds[2].reshape(-1)[0]) not in (-1, rank - 1):  # type: ignore[union-attr]
            continue
        start, end = (int(b.reshape(-1)[0]) for b in bounds[:2])  # type: ignore[union-attr]
        width = min(end, lin.out_dim) - start
        if 0 < width < lin.out_dim and width % d == 0:
            return width // d
    return 0


def _concat_target(v: ir.Value) -> list[int | None] | None:
    """A Reshape target built by Concat of pieces: constants kept, dynamic pieces as None."""
    node = source(v).producer() if source(v) is not None else None
    if node is None or op(node) != "Concat":
        return None
    out: list[int | None] = []
    for piece in node.inputs:
        c = const_array(piece)
        if c is not None:
            out.extend(int(x) for x in c.reshape(-1))
        else:
            out.append(None)  # an Unsqueeze'd scalar from the input's shape
    return out


def head_counts(q_in: ir.Value, q: Walked, k: Walked, fused_qkv: bool, dims: Dims,
                scale: float | None) -> tuple[int, int, int]:
    """(heads, kv heads, head dim) of one attention block: from the shape of q where it meets
    k (B, a, S, d), else from a Reshape target on q's path, else d from the scale; the heads
    then from the projections' widths (a fused qkv: its q Slice, or (a + 2 kv) d wide)."""
    d = dims.static(q_in, -1)
    shape = dims.shape(q_in)
    a = dims.static(q_in, -3) if shape is not None and len(shape) == 4 else None
    q_out = q.linears[0].out_dim if q.linears else 0
    if d is None:
        ra, rd, node = _reshape_dims(q)
        lin = q.linears[0] if q.linears else None
        if (fused_qkv and node is not None and lin is not None
                and source(node.inputs[0]) in (lin.output, lin.node.outputs[0])):
            rd //= 3  # (B, S, a, 3d) before the split: GPT-NeoX's interleaved fused layout
        d, a = (rd or None), (a or ra or None)
    if d is None and scale:
        d = round(1.0 / (scale * scale))
    if not d:
        return 0, 0, 0
    if fused_qkv:
        a = a or _sliced_heads(q, d, dims) or q_out // (3 * d)
        kv = (q_out // d - a) // 2
    else:
        a = a or q_out // d
        k_out = k.linears[0].out_dim if k.linears else 0
        kv = k_out // d if k_out else a
        if k_out % d:  # not kv heads x d wide: multi-head latent attention's kv_b_proj, which
            # makes each head's keys (less their shared rotary part) and its values at once
            kv = _reshape_dims(k)[0] or a
    return a, kv, d
