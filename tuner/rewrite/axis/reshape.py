"""Reshape and Expand along a widened axis (see tuner.rewrite.axis.engine).

Their target shapes are constants, or Concats of constants and pieces computed from Shape
nodes (TorchScript): each entry is read as the exported graph had it, the one that encodes
the widened size is rewritten, and a Reshape that splits (.., n*e) into (.., n, e) or merges
it back moves the track between the flat axis and the per-head (or per-count) axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from tuner.rewrite.axis.engine import Track, Widen
from tuner.rewrite.axis.shapemath import scalar
from tuner.rewrite.common import original_const, private_node


@dataclass
class Entry:
    """One entry of a shape vector (Reshape/Expand target): its constant value, or the
    dynamic value it is computed from, and how to rewrite it."""

    value: int | None
    source: ir.Value | None  # the piece it comes from, for evaluation
    setter: Callable[[int], None] | None
    # where `source` enters: the node whose target this is and the input indices walked up
    # from it (see common.private_node), so that a rewrite of the piece stays private
    where: tuple[ir.Node, tuple[int, ...]] | None = None


class _Editable:
    """A constant that several entries may rewrite, reached from the node whose target it
    spells (`root`) through input indices `trail`: copy on write, for the tensor and for every
    shared node on the way (another reader of the same Concat keeps what it read)."""

    def __init__(self, widen: "Widen", root: ir.Node, trail: tuple[int, ...],
                 array: np.ndarray) -> None:
        self.widen, self.root, self.trail, self.array = widen, root, trail, array.copy()

    def setter(self, k: int) -> Callable[[int], None]:
        def set_(v: int) -> None:
            self.array.reshape(-1)[k] = v
            node = private_node(self.widen.graph, self.root, self.trail)
            self.widen.set_const(node, self.trail[-1], self.array, "dims")
        return set_


def entries(w: Widen, node: ir.Node, index: int) -> list[Entry] | None:
    return _entries_of(w, node, (index,), depth=0)


def _entries_of(w: Widen, root: ir.Node, trail: tuple[int, ...],
                depth: int) -> list[Entry] | None:
    node = _walk(root, trail[:-1])
    v = node.inputs[trail[-1]]
    c = original_const(v, w.token)
    c = w.math.folded(v) if c is None else c
    if c is not None:
        ed = _Editable(w, root, trail, c)
        return [Entry(int(x), None, ed.setter(k)) for k, x in enumerate(c.reshape(-1))]
    p = v.producer() if v is not None else None
    if p is None or depth > 6:
        return None
    if p.op_type == "Concat":
        out: list[Entry] = []
        for j, piece in enumerate(p.inputs):
            pc = original_const(piece, w.token)
            pc = w.math.folded(piece) if pc is None else pc
            if pc is not None:
                ed = _Editable(w, root, trail + (j,), pc)
                out.extend(Entry(int(x), None, ed.setter(k)) for k, x in enumerate(pc.reshape(-1)))
                continue
            n = _length(w, piece)
            if n is None:
                return None
            out.extend(Entry(None, piece if n == 1 else None, None, (root, trail + (j,)))
                       for _ in range(n))
        return out
    if p.op_type in ("Cast", "Identity", "Reshape"):
        return _entries_of(w, root, trail + (0,), depth + 1)
    if p.op_type == "Where":  # TorchScript: Where(Equal(x, -1), ones, x)
        return _entries_of(w, root, trail + (2,), depth + 1)
    n = _length(w, v)
    return [Entry(None, None, None) for _ in range(n)] if n is not None else None


def _walk(node: ir.Node, trail: tuple[int, ...]) -> ir.Node:
    """The producer reached from `node` by following input indices `trail`."""
    for index in trail:
        node = node.inputs[index].producer()
    return node


def _length(w: Widen, v: ir.Value) -> int | None:
    p = v.producer()
    if p is not None and p.op_type == "Unsqueeze":
        src = p.inputs[0]
        r = w.rank(src)
        if r == 0 or (r is None and scalar(w.math.eval(src, "old")) is not None):
            return 1
    s = w.dims.shape(v)
    if s is not None and len(s) == 1 and isinstance(s[0], int):
        return s[0]
    ev = w.math.eval(v, "old")
    return int(ev.size) if ev is not None and ev.ndim == 1 else None


def _entry_value(w: Widen, e: Entry, mode: str) -> int | None:
    if e.value is not None:
        return e.value
    x = scalar(w.math.eval(e.source, mode)) if e.source is not None else None
    return int(x) if x is not None else None


def op_Reshape(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    if t is None:
        raise w.refuse(node, "a widened shape vector")
    ents = entries(w, node, 1)
    if ents is None:
        raise w.refuse(node, "target shape is neither constant nor a Concat of pieces")
    r_out = len(ents)
    if t.axis == -2 and r_out < t.rank:
        return [_merge_outer(w, node, ents, t, r_out)]
    if t.axis <= -3 and r_out == t.rank - 1:
        merged = _merge_with_outer(w, node, ents, t, r_out)
        if merged is not None:
            return [merged]
    if t.axis != -1:
        return [_same_axis(w, node, ents, t, r_out)]
    last = ents[-1]
    v_old = _entry_value(w, last, "old")
    v_new = _entry_value(w, last, "new") if last.value is None else None
    if last.value is None and v_new is not None:
        if v_new == t.new:
            return [t.moved(rank=r_out)]
        if v_new > t.new and v_new % t.new == 0 and r_out < t.rank:
            return [_merge(w, t, v_new // t.new, r_out)]
    if v_old == t.old and last.value is not None:
        last.setter(t.new)
        # leading axes regrouped (GQA's (kv, n_rep) -> heads): the heads count is not known
        return [t.moved(rank=r_out, group=t.group if r_out == t.rank else None)]
    if v_old is not None and v_old > t.old and v_old % t.old == 0 and r_out < t.rank:
        # (.., heads, d) -> (.., heads * d): the heads count is what the target says
        merged = v_old // t.old * t.new
        computed = _entry_value(w, last, "new") if last.setter is None else None
        if last.setter is not None:
            last.setter(merged)
        elif computed not in (None, merged) and not _set_piece(w, last, merged):
            # a width read from an unpadded shape, and no piece to write it into
            raise w.refuse(node, "computed merge target does not follow the widened axis")
        return [_merge(w, t, v_old // t.old, r_out)]
    if v_old is not None and 0 < v_old < t.old and t.old % v_old == 0:
        return [_split(w, node, ents, t, t.old // v_old, v_old, r_out)]
    if v_old in (None, -1, 0):
        before = _entry_value(w, ents[-2], "old") if r_out >= 2 else None
        if r_out > t.rank and before and before > 0 and t.old % before == 0:
            return [_split(w, node, ents, t, before, t.old // before, r_out)]
        heads = w.dims.static(node.inputs[0], -2) or t.group
        if r_out < t.rank and heads:
            return [_merge(w, t, heads, r_out)]
        if r_out <= t.rank:
            return [t.moved(rank=r_out)]
    raise w.refuse(node, f"cannot tell where the widened axis goes (target ends in {v_old})")


def _set_piece(w: Widen, e: Entry, value: int) -> bool:
    """A Concat piece computed from a static width (CLIP's and SigLIP's attention reshape
    their output to `hidden_states.shape`'s embed_dim, a Shape -> Gather -> Unsqueeze of the
    unpadded residual) becomes the constant `value` (in a private copy of the Concat)."""
    if e.where is None or e.source is None:
        return False
    root, trail = e.where
    concat = private_node(w.graph, root, trail)  # walks to the Concat; trail[-1]: the piece
    w.set_const(concat, trail[-1], np.array([value], np.int64), "dims")
    return True


def _merge_outer(w: Widen, node: ir.Node, ents: list[Entry], t: Track, r_out: int) -> Track:
    """(.., heads, e) -> (.., heads * e) with the heads axis widened."""
    last = ents[-1]
    v_old = _entry_value(w, last, "old")
    e = w.dims.static(node.inputs[0], -1)
    if e is None and v_old and v_old > 0 and v_old % t.old == 0:
        e = v_old // t.old
    if e is None:
        raise w.refuse(node, "cannot tell the size of the merged inner axis")
    if v_old == e:  # (b, s, heads, e) -> (b*s, heads, e): leading axes merged, not heads
        return _same_axis(w, node, ents, t, r_out)
    if last.value is not None and last.value == t.old * e:
        last.setter(t.new * e)
    elif last.value not in (None, -1, 0):
        raise w.refuse(node, f"merges into {last.value}, not {t.old} x {e}")
    elif last.value is None and _entry_value(w, last, "new") not in (None, t.new * e):
        raise w.refuse(node, "computed merge target does not follow the widened axis")
    return Track(-1, r_out, tuple(p * e + j for p in t.pos for j in range(e)), t.new * e)


def _merge_with_outer(w: Widen, node: ir.Node, ents: list[Entry], t: Track,
                      r_out: int) -> Track | None:
    """(.., g, n, ..) -> (.., g*n, ..) with n widened: GQA's repeated kv heads (kv, n_rep)
    become heads. None when the target does not merge the tracked axis with its outer one."""
    g = w.dims.static(node.inputs[0], t.axis - 1)
    if not g:
        return None
    e = ents[r_out + t.axis]
    v_old = _entry_value(w, e, "old")
    if v_old != g * t.old:
        return None
    if e.value is not None:
        e.setter(g * t.new)
    elif _entry_value(w, e, "new") != g * t.new and not _fix_product(w, e, t):
        raise w.refuse(node, "computed target does not follow the widened axis")
    return Track(t.axis, r_out, tuple(i * t.new + p for i in range(g) for p in t.pos), g * t.new)


def _fix_product(w: Widen, e: Entry, t: Track) -> bool:
    """TorchScript computes GQA's head count as kv * n_rep: a Mul by the constant n_rep
    (behind Unsqueeze/Cast) becomes a Mul by the widened count (in a private copy of the
    chain, when other targets read it too)."""
    if e.where is None or e.source is None:
        return False
    root, trail = e.where
    v = e.source
    while v.producer() is not None and v.producer().op_type in ("Unsqueeze", "Cast", "Identity"):
        v = v.producer().inputs[0]
        trail += (0,)
        if v is None:
            return False
    node = v.producer()
    if node is None or node.op_type != "Mul":
        return False
    for j, operand in enumerate(node.inputs):
        c = original_const(operand, w.token)
        if c is not None and c.size == 1 and int(c.reshape(-1)[0]) == t.old:
            w.set_const(private_node(w.graph, root, trail + (j,)), j, np.full_like(c, t.new),
                        "count")
            return True
    return False


def _kept_axis(w: Widen, node: ir.Node, t: Track, r_out: int) -> int:
    """Where a Reshape that neither splits nor merges the tracked axis puts it (negative).
    Counted from the end unless the axes after it are regrouped and those before it are
    not: GPT-J's rotate_every_two stacks (.., heads, r/2, 2) and flattens it to
    (.., heads, r), which keeps the heads axis third from the front, not from the end."""
    si, so = w.dims.shape(node.inputs[0]), w.dims.shape(node.outputs[0])
    if si is None or so is None or len(si) != t.rank or len(so) != r_out:
        return t.axis
    k, back = t.rank + t.axis, r_out + t.axis

    def same(a, b) -> bool:
        return a is not None and a == b  # an int, or the same symbolic dim name

    if back >= 0 and all(same(si[k + i], so[back + i]) for i in range(-t.axis)):
        return t.axis
    if k < r_out and all(same(si[i], so[i]) for i in range(k + 1)):
        return k - r_out
    return t.axis


def _same_axis(w: Widen, node: ir.Node, ents: list[Entry], t: Track, r_out: int) -> Track:
    axis = _kept_axis(w, node, t, r_out)
    e = ents[r_out + axis]
    val = _entry_value(w, e, "old")
    if val == t.old and e.value is not None:
        e.setter(t.new)
    elif val not in (None, -1, 0, t.old):
        raise w.refuse(node, f"target puts {val} where the widened axis of {t.old} was")
    return t.moved(rank=r_out, axis=axis)


def _split(w: Widen, node: ir.Node, ents: list[Entry], t: Track, n: int, e: int, r_out: int) -> Track:
    """(.., n*e) -> (.., n, e): every block must be widened alike, to new/n."""
    pos = np.array(t.pos).reshape(n, e)
    s = t.new // n
    inner = pos[0]
    if t.new % n == 0 and all((pos[i] == inner + i * s).all() for i in range(n)) \
            and inner.max() < s:
        # every part widened alike: the track moves to the inner axis (head dim)
        if ents[-1].value is not None and ents[-1].value == e:
            ents[-1].setter(s)
        return Track(-1, r_out, tuple(int(x) for x in inner), s, group=n)
    starts = pos[:, 0]
    if t.new % e == 0 and (starts % e == 0).all() and \
            all((pos[i] == starts[i] + np.arange(e)).all() for i in range(n)):
        # whole parts moved or added: the track moves to the outer axis (head count)
        if ents[-2].value is not None and ents[-2].value == n:
            ents[-2].setter(t.new // e)
        return Track(-2, r_out, tuple(int(x) for x in starts // e), t.new // e)
    raise w.refuse(node, "the parts of the split axis are widened differently")


def _merge(w: Widen, t: Track, g: int, r_out: int) -> Track:
    pos = [i * t.new + p for i in range(g) for p in t.pos]
    return Track(-1, r_out, tuple(pos), g * t.new)


def op_Expand(w: Widen, node: ir.Node, tin: list) -> list:
    t = tin[0]
    if t is None:
        raise w.refuse(node, "a widened shape vector")
    ents = entries(w, node, 1)
    if ents is None:
        raise w.refuse(node, "expand shape is not understood")
    r_out = max(len(ents), t.rank)
    if len(ents) >= -t.axis:
        e = ents[len(ents) + t.axis]
        val = _entry_value(w, e, "old")
        if val == t.old and e.value is not None:
            e.setter(t.new)
        elif val not in (None, -1, 1, t.old):
            raise w.refuse(node, f"expands the widened axis to {val}")
    return [t.moved(rank=r_out)]


HANDLERS = {("", "Reshape"): op_Reshape, ("", "Expand"): op_Expand}
