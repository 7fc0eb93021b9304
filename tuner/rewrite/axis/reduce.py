"""Reductions and normalizations along a widened axis (see tuner.rewrite.axis.engine).

Seen in real exports: q/k RMSNorm over the head dim (Gemma 3, Qwen 3: `q_norm`/`k_norm`,
exported as `mean(x**2)` per head), q/k LayerNorm over the head dim (Phi, StableLM with
`qk_layernorm`: one LayerNormalization op). A reduction over an axis that does not contain
the widened one just carries the track (moved when `keepdims` is 0). A reduction over the
widened axis would see the padded entries (a mean over d' instead of d changes RMSNorm's
statistics), so its input is first gathered back to the original entries (`pos`): the
reduction then computes exactly what it did before, whatever the padding holds, and its
result (size 1 or gone on that axis) needs no track.

A LayerNormalization over the widened (last) axis runs on the original entries the same way,
and its output is widened again: gathered into the padded layout and multiplied by a 0/1 mask,
so the padded entries are exact zeros. Over axes after the widened one (the heads axis when
heads are added), it keeps the track.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.rewrite.axis.engine import Track, Widen
from tuner.rewrite.common import new_initializer, unique_name

REDUCTIONS = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
              "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp")


def _gather_original(w: Widen, node: ir.Node, t: Track) -> None:
    """Feed `node` Gather(input, old positions, axis) instead of the widened input."""
    x = node.inputs[0]
    indices = new_initializer(w.graph, f"{node.name}.unpad_idx", np.array(t.pos, dtype=np.int64))
    out = ir.Value(name=unique_name(w.graph, f"{x.name or node.name}.unpadded"), type=x.type)
    gather = ir.Node("", "Gather", [x, indices], [ir.AttrInt64("axis", t.rank + t.axis)],
                     outputs=[out], name=unique_name(w.graph, f"{node.name}/unpad"))
    w.graph.insert_before(node, gather)
    node.replace_input_with(0, out)


def op_Reduce(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    if t is None or any(x is not None for x in tin[1:]):
        raise w.refuse(node, "reduction axes computed from the widened tensor")
    axes = w.axes(node, 1)
    keep = bool(node.attributes["keepdims"].value) if "keepdims" in node.attributes else True
    attrs = node.attributes
    noop = "noop_with_empty_axes" in attrs and attrs["noop_with_empty_axes"].value
    if axes is None and len(node.inputs) > 1 and node.inputs[1] is not None:
        raise w.refuse(node, "reduction axes are not constant")
    if not axes:
        if noop:
            return [t]
        axes = list(range(t.rank))  # no axes: reduce over all of them
    axes = sorted(a % t.rank for a in axes)
    k = t.rank + t.axis
    if k in axes:
        _gather_original(w, node, t)
        return [None]
    if keep:
        return [t]
    r_out = t.rank - len(axes)
    return [t.moved(axis=(k - sum(a < k for a in axes)) - r_out, rank=r_out)]


def op_Normalization(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    if t is None or any(x is not None for x in tin[1:]):
        raise w.refuse(node, "widened scale or bias")
    axis = (node.attributes["axis"].value if "axis" in node.attributes else -1) % t.rank
    k = t.rank + t.axis
    if k < axis:  # normalizes over axes after the widened one
        return [t] + [None] * (len(node.outputs) - 1)
    if k != t.rank - 1 or axis != t.rank - 1:
        raise w.refuse(node, "normalizes over the widened axis together with others")
    if any(o is not None and o.uses() for o in node.outputs[1:]):
        raise w.refuse(node, "its mean/variance outputs are used")
    _gather_original(w, node, t)
    _rewiden_output(w, node, t)
    return [None] * len(node.outputs)


def _rewiden_output(w: Widen, node: ir.Node, t: Track) -> None:
    """Users of the (original-width, last-axis) output read it in the padded layout instead:
    Gather(out, idx) * mask, where old entry i lands at t.pos[i] and padded entries are 0."""
    out = node.outputs[0]
    idx = np.zeros(t.new, dtype=np.int64)
    dtype = node.inputs[0].dtype
    mask = np.zeros(t.new, dtype=dtype.numpy() if dtype is not None else np.float32)
    idx[list(t.pos)] = np.arange(t.old)
    mask[list(t.pos)] = 1
    base = out.name or node.name
    gathered = ir.Value(name=unique_name(w.graph, f"{base}.repad"), type=out.type)
    widened = ir.Value(name=unique_name(w.graph, f"{base}.repadded"), type=out.type)
    out.replace_all_uses_with(widened)
    gather = ir.Node("", "Gather", [out, new_initializer(w.graph, f"{node.name}.repad_idx", idx)],
                     [ir.AttrInt64("axis", t.rank - 1)], outputs=[gathered],
                     name=unique_name(w.graph, f"{node.name}/repad"))
    mul = ir.Node("", "Mul", [gathered, new_initializer(w.graph, f"{node.name}.repad_mask", mask)],
                  outputs=[widened], name=unique_name(w.graph, f"{node.name}/repad_mask"))
    w.graph.insert_after(node, [gather, mul])
    w.tracks[widened] = t


HANDLERS = {**{("", op): op_Reduce for op in REDUCTIONS},
            ("", "RMSNormalization"): op_Normalization,
            ("", "LayerNormalization"): op_Normalization}
