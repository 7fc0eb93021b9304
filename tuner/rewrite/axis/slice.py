"""Slice, Split and Concat along a widened axis (see tuner.rewrite.axis.engine).

Bounds and sizes are read in old coordinates (constants, or evaluated from the shape
computation that produces them) and moved to where those entries now live; a computed bound
must already evaluate to the new position, else the rewrite refuses.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.rewrite.axis.engine import INT_MAX, Track, Widen, identity
from tuner.rewrite.common import const_array


def _bound(w: Widen, node: ir.Node, index: int, j: int, mode: str) -> int | None:
    arr = w.math.eval(node.inputs[index], mode)
    if arr is None or arr.size <= j or not np.isfinite(arr.reshape(-1)[j]):
        return None
    return int(min(max(arr.reshape(-1)[j], -INT_MAX), INT_MAX))


def op_Slice(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    if t is None or any(tin[1:]):
        raise w.refuse(node, "slice bounds from a widened tensor")
    axes = w.axes(node, 3)
    n_bounds = len(w.math.eval(node.inputs[1], "old") or [0]) if axes is None else len(axes)
    axes = axes if axes is not None else list(range(n_bounds))
    k = t.rank + t.axis
    norm = [a % t.rank for a in axes]
    if k not in norm:
        return [t]
    j = norm.index(k)
    if len(node.inputs) > 4 and node.inputs[4] is not None:
        steps = w.math.eval(node.inputs[4], "old")
        if steps is None or steps.reshape(-1)[j] != 1:
            raise w.refuse(node, "strided slice of the widened axis")
    new_bounds = []
    for index in (1, 2):
        b_old = _bound(w, node, index, j, "old")
        if b_old is None:
            raise w.refuse(node, "slice bound not computable")
        b = b_old + t.old if b_old < 0 else b_old
        b = min(max(b, 0), t.old)
        mapped = t.map_bound(b)
        c = const_array(node.inputs[index])
        if c is None and (c := w.math.folded(node.inputs[index])) is not None:
            v = node.inputs[index]
            c = c.astype(v.dtype.numpy()) if v.dtype is not None and v.dtype.is_integer() else c
        if c is not None:
            # an end past the old length (INT_MAX) still means "to the end"; one equal to it is
            # the full width written out (a folded `2 * (ffn + 1) // 2`), which moves to new
            if b_old != mapped and not (b_old > t.old and index == 2):
                arr = c.copy()
                arr.reshape(-1)[j] = mapped
                w.set_const(node, index, arr, "bound")
        else:
            b_new = _bound(w, node, index, j, "new")
            b_new = None if b_new is None else min(max(b_new + t.new if b_new < 0 else b_new, 0), t.new)
            if b_new != mapped:
                raise w.refuse(node, f"computed slice bound becomes {b_new}, needs {mapped}")
        new_bounds.append((b, mapped))
    (s_old, s_new), (e_old, e_new) = new_bounds
    pos = [t.pos[i] - s_new for i in range(s_old, e_old)]
    if any(p < 0 or p >= e_new - s_new for p in pos):
        raise w.refuse(node, "the slice cuts through the widened entries")
    if pos and pos == list(range(len(pos))) and e_new - s_new == len(pos):
        return [None]  # this part is unchanged (a partial rotary's rotated dims)
    return [t.moved(pos=tuple(pos), new=e_new - s_new, group=None)]


def op_Split(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    axis = node.attributes["axis"].value if "axis" in node.attributes else 0
    k = t.rank + t.axis
    if axis % t.rank != k:
        return [t for _ in node.outputs]
    n = len(node.outputs)
    sizes = None
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        c = const_array(node.inputs[1])
        if c is None:
            raise w.refuse(node, "split sizes are not constant")
        sizes = [int(x) for x in c]
    elif "split" in node.attributes:
        sizes = list(node.attributes["split"].value)
    if sizes is None:
        if t.old % n:
            raise w.refuse(node, "uneven split")
        sizes = [t.old // n] * n
    bounds = np.cumsum([0] + sizes)
    new_b = [t.map_bound(int(b)) for b in bounds]
    new_sizes = list(np.diff(new_b))
    if new_sizes != sizes:
        arr = np.array(new_sizes, dtype=np.int64)
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            w.set_const(node, 1, arr, "split")
        elif "split" in node.attributes:
            node.attributes["split"] = ir.AttrInt64s("split", new_sizes)
        else:
            opset = w.model.opset_imports.get("", 0)
            if opset < 13:
                node.attributes["split"] = ir.AttrInt64s("split", new_sizes)
            else:
                node.attributes.pop("num_outputs", None)
                node.resize_inputs(2)
                w.set_const(node, 1, arr, "split")
    outs = []
    for i in range(n):
        pos = [t.pos[x] - new_b[i] for x in range(int(bounds[i]), int(bounds[i + 1]))]
        if any(p < 0 or p >= new_sizes[i] for p in pos):
            raise w.refuse(node, "the split cuts through the widened entries")
        same = pos == list(range(len(pos))) and new_sizes[i] == len(pos)
        outs.append(None if same else t.moved(pos=tuple(pos), new=int(new_sizes[i]), group=None))
    return outs


def op_Concat(w: Widen, node: ir.Node, tin: list) -> list:
    ref = next(t for t in tin if t is not None)
    axis = node.attributes["axis"].value
    k = axis % ref.rank
    if k != ref.rank + ref.axis:
        if w.cache is not None:  # a KV cache's past joined with widened keys/values
            tin = [w.cache.join(w, node, i, ref)
                   if t is None and w.cache.past_behind(v) is not None else t
                   for i, (v, t) in enumerate(zip(node.inputs, tin))]
        if any(t is None or not t.same(ref) for t in tin):
            raise w.refuse(node, "concatenates widened and plain tensors")
        return [ref]
    pos: list[int] = []
    old_off = new_off = 0
    for v, t in zip(node.inputs, tin):
        if t is None:
            width = w.dims.static(v, ref.axis)
            c = const_array(v)
            width = c.shape[ref.axis] if c is not None else width
            if width is None:
                raise w.refuse(node, f"width of {v.name!r} unknown")
            t = Track(ref.axis, ref.rank, identity(width), width)
        pos.extend(new_off + p for p in t.pos)
        old_off += t.old
        new_off += t.new
    return [Track(ref.axis, ref.rank, tuple(pos), new_off)]


HANDLERS = {("", "Slice"): op_Slice, ("", "Split"): op_Split, ("", "Concat"): op_Concat}
