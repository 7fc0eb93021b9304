"""Widen one axis through a graph region, exactly: the engine under the head-dim rewrite.

A *track* says that one axis of a value was widened from `old` to `new` entries and where each
old entry went (`pos[i]`, the rest are zeros). Seeds (the padded projections, a rotary
inverse-frequency table) get tracks; the engine then visits every node in graph order and
carries the tracks forward, rewriting what encodes the old size on the way:

- elementwise ops: tracked operands must agree entry for entry; constant operands spanning
  the axis are scattered the same way; a scalar computed from a shape at run time (the
  attention scale) is pinned to the value it had;
- Reshape/Expand targets (constants, or Concats of constants and shape pieces), Slice bounds
  and Split sizes along the axis are moved to the new positions;
- Reshapes that split a flat (heads * d) axis into (heads, d), or merge it back, switch the
  track between the flat and the per-head form;
- a MatMul contracting two tracked axes with equal tracks ends them (q . k over d);
- sinks (the output projection) take the tracked input as zero-padded weight rows.

Whatever the engine does not understand refuses with the node's name: nothing is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite.common import const_array, original_const, set_const_input
from tuner.rewrite.shapemath import ShapeMath, is_int, scalar

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Neg", "Cast", "Identity",
               "IsNaN", "Equal", "Sigmoid", "Tanh", "Relu", "Erf", "Cos", "Sin", "Abs", "Sqrt",
               "Exp", "Not", "And", "Or", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
               "CastLike", "Dropout"}
ONE_FILL = {("Div", 1), ("Pow", 1)}
INT_MAX = 2**62


@dataclass(frozen=True)
class Track:
    axis: int  # negative: counted from the end
    rank: int
    pos: tuple[int, ...]  # new index of each old entry
    new: int
    group: int | None = None  # heads, when this is the per-head axis split from a flat one

    @property
    def old(self) -> int:
        return len(self.pos)

    def same(self, other: "Track") -> bool:
        return self.axis == other.axis and self.pos == other.pos and self.new == other.new

    def moved(self, **kw) -> "Track":
        return Track(**{**self.__dict__, **kw})

    def map_bound(self, b: int) -> int:
        """A slice bound in old coordinates -> new coordinates."""
        return self.new if b >= self.old else self.pos[b]


def identity(n: int) -> tuple[int, ...]:
    return tuple(range(n))


def scatter(array: np.ndarray, axis: int, t: Track, fill: float = 0.0) -> np.ndarray:
    shape = list(array.shape)
    shape[axis] = t.new
    out = np.full(shape, fill, dtype=array.dtype)
    index = [slice(None)] * array.ndim
    index[axis] = list(t.pos)
    out[tuple(index)] = array
    return out


@dataclass
class Entry:
    """One entry of a shape vector (Reshape/Expand target): its constant value, or the
    dynamic value it is computed from, and how to rewrite it."""

    value: int | None
    source: ir.Value | None  # the piece it comes from, for evaluation
    setter: Callable[[int], None] | None


class _Editable:
    """A constant input of a node that several entries may rewrite (copy on write)."""

    def __init__(self, graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray) -> None:
        self.graph, self.node, self.index, self.array = graph, node, index, array.copy()

    def setter(self, k: int) -> Callable[[int], None]:
        def set_(v: int) -> None:
            self.array.reshape(-1)[k] = v
            set_const_input(self.graph, self.node, self.index, self.array, "dims")
        return set_


Sink = Callable[[ir.Node, list["Track | None"]], None]


class Widen:
    def __init__(self, model: ir.Model, dims, what: str) -> None:
        self.model, self.graph, self.dims, self.what = model, model.graph, dims, what
        self.tracks: dict[ir.Value, Track] = {}
        self.sinks: dict[ir.Node, Sink] = {}
        self.stops: set[ir.Node] = set()  # nodes the region must not reach
        self.math = ShapeMath(self._shape_of)
        self.touched: list[ir.Value] = []

    # -- shapes -------------------------------------------------------------------------------
    def rank(self, v: ir.Value) -> int | None:
        t = self.tracks.get(v)
        if t is not None:
            return t.rank
        s = self.dims.shape(v)
        return len(s) if s is not None else None

    def _rank_any(self, v: ir.Value) -> int | None:
        c = const_array(v)
        return c.ndim if c is not None else self.rank(v)

    def _shape_of(self, v: ir.Value, mode: str) -> np.ndarray | None:
        s = self.dims.shape(v)
        t = self.tracks.get(v)
        rank = t.rank if t is not None else (len(s) if s is not None else None)
        if rank is None:
            return None
        out = np.full(rank, np.nan)
        if s is not None and len(s) == rank:
            out[:] = [d if isinstance(d, int) and d > 0 else np.nan for d in s]
        if t is not None:
            out[t.axis] = t.old if mode == "old" else t.new
        return out

    def refuse(self, node: ir.Node, why: str) -> RewriteRefused:
        return RewriteRefused(f"{self.what}: node {node.name!r} ({node.op_type}): {why}")

    # -- driver -------------------------------------------------------------------------------
    def seed(self, value: ir.Value, track: Track) -> None:
        self.tracks[value] = track

    def run(self) -> None:
        for node in list(self.graph):
            tin = [self.tracks.get(v) if v is not None else None for v in node.inputs]
            if node in self.sinks:
                self.sinks[node](node, tin)
                continue
            if not any(tin):
                self._untracked(node)
                continue
            if node in self.stops:
                raise self.refuse(node, "the widened axis reaches a node it must not")
            handler = getattr(self, f"_op_{node.op_type}", None)
            if node.domain not in ("", "ai.onnx"):
                handler = None
            if node.op_type in ELEMENTWISE and node.domain in ("", "ai.onnx"):
                handler = self._elementwise
            if handler is None:
                raise self.refuse(node, "this op on the widened axis is not understood")
            outs = handler(node, tin)
            for out, t in zip(node.outputs, outs):
                if t is not None:
                    if out.is_graph_output():
                        raise self.refuse(node, "the widened axis reaches a graph output")
                    self.tracks[out] = t
                    out.shape = None
                    self.touched.append(out)

    # -- nodes without a tracked input: pin computed scales ---------------------------------
    def _untracked(self, node: ir.Node) -> None:
        if node.op_type not in ("Mul", "Div", "Add", "Sub", "Pow") or node.domain not in ("", "ai.onnx"):
            return
        self._pin_computed(node, set())

    def _pin_computed(self, node: ir.Node, skip: set[int]) -> None:
        for j in range(len(node.inputs)):
            if j not in skip:
                self._pin_one(node, j)

    def _pin_one(self, node: ir.Node, j: int) -> bool:
        """A float operand computed from a widened shape keeps the value it had (TorchScript's
        1/sqrt(d) from the query's shape). True when it was pinned."""
        v = node.inputs[j]
        if v is None or const_array(v) is not None or v in self.tracks:
            return False
        if is_int(v) or (v.dtype is not None and not v.dtype.is_floating_point()):
            return False  # integer shape math (sizes, bounds) follows the new shape on purpose
        old, new = scalar(self.math.eval(v, "old")), scalar(self.math.eval(v, "new"))
        if old is None or new is None or old == new:
            return False
        dtype = v.dtype.numpy() if v.dtype is not None else np.float32
        set_const_input(self.graph, node, j, np.array(old, dtype=dtype), "pinned")
        return True

    # -- handlers: each returns one Track (or None) per output --------------------------------
    def _elementwise(self, node: ir.Node, tin: list) -> list:
        ref = next(t for t in tin if t is not None)
        ranks = [t.rank if t is not None else self._rank_any(v) for v, t in zip(node.inputs, tin)
                 if v is not None]
        rank = max(r for r in ranks if r is not None)  # numpy broadcasting: the widest operand
        for j, (v, t) in enumerate(zip(node.inputs, tin)):
            if v is None:
                continue
            if t is not None:
                if not t.same(ref):
                    raise self.refuse(node, f"operands widened differently (input {j})")
                continue
            c = const_array(v)
            if c is not None:
                self._const_operand(node, j, c, ref)
                continue
            if self._pin_one(node, j) or scalar(self.math.eval(v, "old")) is not None:
                continue  # a scalar: pinned if it followed the widened shape, else kept
            r = self.rank(v)
            s = self.dims.shape(v)
            if r is not None and r < -ref.axis:
                continue  # broadcasts along the widened axis
            if s is not None and len(s) >= -ref.axis and s[ref.axis] == 1:
                continue
            raise self.refuse(node, f"operand {v.name!r} spans the widened axis but is not "
                              "widened with it")
        return [ref.moved(rank=rank) for _ in node.outputs]

    def _const_operand(self, node: ir.Node, j: int, c: np.ndarray, t: Track) -> None:
        if c.ndim < -t.axis or c.shape[t.axis] == 1:
            return
        if c.shape[t.axis] != t.old:
            raise self.refuse(node, f"constant of shape {c.shape} on the widened axis of {t.old}")
        fill = 1.0 if (node.op_type, j) in ONE_FILL else 0.0
        set_const_input(self.graph, node, j, scatter(c, t.axis, t, fill), "widened")

    def _op_Transpose(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        perm = list(node.attributes["perm"].value) if "perm" in node.attributes \
            else list(range(t.rank))[::-1]
        k = perm.index(t.rank + t.axis)
        return [t.moved(axis=k - t.rank)]

    def _axes(self, node: ir.Node, index: int) -> list[int] | None:
        if len(node.inputs) > index and node.inputs[index] is not None:
            c = const_array(node.inputs[index])
            return None if c is None else [int(x) for x in c.reshape(-1)]
        if "axes" in node.attributes:
            return list(node.attributes["axes"].value)
        return None

    def _op_Unsqueeze(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        axes = self._axes(node, 1)
        if axes is None:
            raise self.refuse(node, "axes are not constant")
        r_out = t.rank + len(axes)
        axes = sorted(a % r_out for a in axes)
        kept = [i for i in range(r_out) if i not in axes]
        k = kept[t.rank + t.axis]
        return [t.moved(axis=k - r_out, rank=r_out)]

    def _op_Squeeze(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        axes = self._axes(node, 1)
        if axes is None:
            raise self.refuse(node, "squeezed axes are not constant")
        axes = [a % t.rank for a in axes]
        k = t.rank + t.axis
        if k in axes:
            raise self.refuse(node, "squeezes the widened axis")
        r_out = t.rank - len(axes)
        return [t.moved(axis=(k - sum(a < k for a in axes)) - r_out, rank=r_out)]

    def _op_Shape(self, node: ir.Node, tin: list) -> list:
        return [None]

    def _op_Softmax(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        axis = node.attributes["axis"].value if "axis" in node.attributes else -1
        if axis % t.rank == t.rank + t.axis:
            raise self.refuse(node, "softmax over the widened axis")
        return [t]

    # -- shape vectors --------------------------------------------------------------------------
    def entries(self, node: ir.Node, index: int) -> list[Entry] | None:
        return self._entries_of(node, index, depth=0)

    def _entries_of(self, node: ir.Node, index: int, depth: int) -> list[Entry] | None:
        v = node.inputs[index]
        c = original_const(v)
        if c is not None:
            ed = _Editable(self.graph, node, index, c)
            return [Entry(int(x), None, ed.setter(k)) for k, x in enumerate(c.reshape(-1))]
        p = v.producer() if v is not None else None
        if p is None or depth > 6:
            return None
        if p.op_type == "Concat":
            out: list[Entry] = []
            for j, piece in enumerate(p.inputs):
                pc = original_const(piece)
                if pc is not None:
                    ed = _Editable(self.graph, p, j, pc)
                    out.extend(Entry(int(x), None, ed.setter(k)) for k, x in enumerate(pc.reshape(-1)))
                    continue
                n = self._length(piece)
                if n is None:
                    return None
                out.extend(Entry(None, piece if n == 1 else None, None) for _ in range(n))
            return out
        if p.op_type in ("Cast", "Identity"):
            return self._entries_of(p, 0, depth + 1)
        if p.op_type == "Reshape":
            return self._entries_of(p, 0, depth + 1)
        if p.op_type == "Where":  # TorchScript: Where(Equal(x, -1), ones, x)
            return self._entries_of(p, 2, depth + 1)
        n = self._length(v)
        return [Entry(None, None, None) for _ in range(n)] if n is not None else None

    def _length(self, v: ir.Value) -> int | None:
        p = v.producer()
        if p is not None and p.op_type == "Unsqueeze":
            src = p.inputs[0]
            r = self.rank(src)
            if r == 0 or (r is None and scalar(self.math.eval(src, "old")) is not None):
                return 1
        s = self.dims.shape(v)
        if s is not None and len(s) == 1 and isinstance(s[0], int):
            return s[0]
        ev = self.math.eval(v, "old")
        return int(ev.size) if ev is not None and ev.ndim == 1 else None

    def _entry_value(self, e: Entry, mode: str) -> int | None:
        if e.value is not None:
            return e.value
        x = scalar(self.math.eval(e.source, mode)) if e.source is not None else None
        return int(x) if x is not None else None

    def _op_Reshape(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        if t is None:
            raise self.refuse(node, "a widened shape vector")
        ents = self.entries(node, 1)
        if ents is None:
            raise self.refuse(node, "target shape is neither constant nor a Concat of pieces")
        r_out = len(ents)
        if t.axis != -1:
            return [self._same_axis(node, ents, t, r_out)]
        last = ents[-1]
        v_old = self._entry_value(last, "old")
        v_new = self._entry_value(last, "new") if last.value is None else None
        if last.value is None and v_new is not None:
            if v_new == t.new:
                return [t.moved(rank=r_out)]
            if v_new > t.new and v_new % t.new == 0 and r_out < t.rank:
                return [self._merge(t, v_new // t.new, r_out)]
        if v_old == t.old and last.value is not None:
            last.setter(t.new)
            return [t.moved(rank=r_out)]
        if v_old is not None and v_old > t.old and v_old % t.old == 0 and r_out < t.rank:
            # (.., heads, d) -> (.., heads * d): the heads count is what the target says
            if last.setter is not None:
                last.setter(v_old // t.old * t.new)
            return [self._merge(t, v_old // t.old, r_out)]
        if v_old is not None and 0 < v_old < t.old and t.old % v_old == 0:
            return [self._split(node, ents, t, t.old // v_old, v_old, r_out)]
        if v_old in (None, -1, 0):
            before = self._entry_value(ents[-2], "old") if r_out >= 2 else None
            if r_out > t.rank and before and before > 0 and t.old % before == 0:
                return [self._split(node, ents, t, before, t.old // before, r_out)]
            heads = self.dims.static(node.inputs[0], -2) or t.group
            if r_out < t.rank and heads:
                return [self._merge(t, heads, r_out)]
            if r_out <= t.rank:
                return [t.moved(rank=r_out)]
        raise self.refuse(node, f"cannot tell where the widened axis goes (target ends in {v_old})")

    def _same_axis(self, node: ir.Node, ents: list[Entry], t: Track, r_out: int) -> Track:
        e = ents[r_out + t.axis]
        val = self._entry_value(e, "old")
        if val == t.old and e.value is not None:
            e.setter(t.new)
        elif val not in (None, -1, 0, t.old):
            raise self.refuse(node, f"target puts {val} where the widened axis of {t.old} was")
        return t.moved(rank=r_out)

    def _split(self, node: ir.Node, ents: list[Entry], t: Track, n: int, e: int, r_out: int) -> Track:
        """(.., n*e) -> (.., n, e): every block must be widened alike, to new/n."""
        if t.new % n:
            raise self.refuse(node, f"the widened axis of {t.new} does not split into {n} parts")
        s = t.new // n
        pos = np.array(t.pos).reshape(n, e)
        inner = pos[0]
        if not all((pos[i] == inner + i * s).all() for i in range(n)) or inner.max() >= s:
            raise self.refuse(node, "the parts of the split axis are widened differently")
        if ents[-1].value is not None and ents[-1].value == e:
            ents[-1].setter(s)
        return Track(-1, r_out, tuple(int(x) for x in inner), s, group=n)

    def _merge(self, t: Track, g: int, r_out: int) -> Track:
        pos = [i * t.new + p for i in range(g) for p in t.pos]
        return Track(-1, r_out, tuple(pos), g * t.new)

    def _op_Expand(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        if t is None:
            raise self.refuse(node, "a widened shape vector")
        ents = self.entries(node, 1)
        if ents is None:
            raise self.refuse(node, "expand shape is not understood")
        r_out = max(len(ents), t.rank)
        if len(ents) >= -t.axis:
            e = ents[len(ents) + t.axis]
            val = self._entry_value(e, "old")
            if val == t.old and e.value is not None:
                e.setter(t.new)
            elif val not in (None, -1, 1, t.old):
                raise self.refuse(node, f"expands the widened axis to {val}")
        return [t.moved(rank=r_out)]

    # -- slicing along the axis -----------------------------------------------------------------
    def _bound(self, node: ir.Node, index: int, j: int, mode: str) -> int | None:
        arr = self.math.eval(node.inputs[index], mode)
        if arr is None or arr.size <= j or not np.isfinite(arr.reshape(-1)[j]):
            return None
        return int(min(max(arr.reshape(-1)[j], -INT_MAX), INT_MAX))

    def _op_Slice(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        if t is None or any(tin[1:]):
            raise self.refuse(node, "slice bounds from a widened tensor")
        axes = self._axes(node, 3)
        n_bounds = len(self.math.eval(node.inputs[1], "old") or [0]) if axes is None else len(axes)
        axes = axes if axes is not None else list(range(n_bounds))
        k = t.rank + t.axis
        norm = [a % t.rank for a in axes]
        if k not in norm:
            return [t]
        j = norm.index(k)
        if len(node.inputs) > 4 and node.inputs[4] is not None:
            steps = self.math.eval(node.inputs[4], "old")
            if steps is None or steps.reshape(-1)[j] != 1:
                raise self.refuse(node, "strided slice of the widened axis")
        new_bounds = []
        for index in (1, 2):
            b_old = self._bound(node, index, j, "old")
            if b_old is None:
                raise self.refuse(node, "slice bound not computable")
            b = b_old + t.old if b_old < 0 else b_old
            b = min(max(b, 0), t.old)
            mapped = t.map_bound(b)
            c = const_array(node.inputs[index])
            if c is not None:
                if b_old != mapped and not (b_old >= t.old and index == 2):
                    arr = c.copy()
                    arr.reshape(-1)[j] = mapped
                    set_const_input(self.graph, node, index, arr, "bound")
            else:
                b_new = self._bound(node, index, j, "new")
                b_new = None if b_new is None else min(max(b_new + t.new if b_new < 0 else b_new, 0), t.new)
                if b_new != mapped:
                    raise self.refuse(node, f"computed slice bound becomes {b_new}, needs {mapped}")
            new_bounds.append((b, mapped))
        (s_old, s_new), (e_old, e_new) = new_bounds
        pos = [t.pos[i] - s_new for i in range(s_old, e_old)]
        if any(p < 0 or p >= e_new - s_new for p in pos):
            raise self.refuse(node, "the slice cuts through the widened entries")
        if pos == list(range(len(pos))) and e_new - s_new == len(pos):
            return [None]  # this part is unchanged
        return [t.moved(pos=tuple(pos), new=e_new - s_new, group=None)]

    def _op_Split(self, node: ir.Node, tin: list) -> list:
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
                raise self.refuse(node, "split sizes are not constant")
            sizes = [int(x) for x in c]
        elif "split" in node.attributes:
            sizes = list(node.attributes["split"].value)
        if sizes is None:
            if t.old % n:
                raise self.refuse(node, "uneven split")
            sizes = [t.old // n] * n
        bounds = np.cumsum([0] + sizes)
        new_b = [t.map_bound(int(b)) for b in bounds]
        new_sizes = list(np.diff(new_b))
        if new_sizes != sizes:
            arr = np.array(new_sizes, dtype=np.int64)
            if len(node.inputs) > 1 and node.inputs[1] is not None:
                set_const_input(self.graph, node, 1, arr, "split")
            elif "split" in node.attributes:
                node.attributes["split"] = ir.AttrInt64s("split", new_sizes)
            else:
                opset = self.model.opset_imports.get("", 0)
                if opset < 13:
                    node.attributes["split"] = ir.AttrInt64s("split", new_sizes)
                else:
                    node.attributes.pop("num_outputs", None)
                    node.resize_inputs(2)
                    set_const_input(self.graph, node, 1, arr, "split")
        outs = []
        for i in range(n):
            pos = [t.pos[x] - new_b[i] for x in range(int(bounds[i]), int(bounds[i + 1]))]
            if any(p < 0 or p >= new_sizes[i] for p in pos):
                raise self.refuse(node, "the split cuts through the widened entries")
            same = pos == list(range(len(pos))) and new_sizes[i] == len(pos)
            outs.append(None if same else t.moved(pos=tuple(pos), new=int(new_sizes[i]), group=None))
        return outs

    def _op_Concat(self, node: ir.Node, tin: list) -> list:
        ref = next(t for t in tin if t is not None)
        axis = node.attributes["axis"].value
        k = axis % ref.rank
        if k != ref.rank + ref.axis:
            if any(t is None or not t.same(ref) for t in tin):
                raise self.refuse(node, "concatenates widened and plain tensors")
            return [ref]
        pos: list[int] = []
        old_off = new_off = 0
        for v, t in zip(node.inputs, tin):
            if t is None:
                w = self.dims.static(v, ref.axis)
                c = const_array(v)
                w = c.shape[ref.axis] if c is not None else w
                if w is None:
                    raise self.refuse(node, f"width of {v.name!r} unknown")
                t = Track(ref.axis, ref.rank, identity(w), w)
            pos.extend(new_off + p for p in t.pos)
            old_off += t.old
            new_off += t.new
        return [Track(ref.axis, ref.rank, tuple(pos), new_off)]

    def _op_MatMul(self, node: ir.Node, tin: list) -> list:
        ta, tb = tin
        if const_array(node.inputs[1]) is not None or const_array(node.inputs[0]) is not None:
            raise self.refuse(node, "a projection the widened axis was not meant to reach")
        if ta is not None and ta.axis == -1:
            if tb is None or tb.axis != -2 or not tb.same(ta.moved(axis=-2)):
                raise self.refuse(node, "contracts the widened axis with an unwidened one")
            return [None]
        if tb is not None and tb.axis == -2:
            raise self.refuse(node, "contracts the widened axis with an unwidened one")
        r = max(ta.rank if ta else 0, tb.rank if tb else 0)
        if ta is not None and tb is not None:
            raise self.refuse(node, "two widened axes meet")
        if ta is not None and ta.axis == -2:
            return [ta.moved(rank=r)]
        if tb is not None and tb.axis == -1:
            return [tb.moved(rank=r)]
        raise self.refuse(node, "widened batch axis in a MatMul")

    def _op_Gather(self, node: ir.Node, tin: list) -> list:
        t = tin[0]
        if t is None or tin[1] is not None:
            raise self.refuse(node, "gathers with widened indices")
        axis = (node.attributes["axis"].value if "axis" in node.attributes else 0) % t.rank
        k = t.rank + t.axis
        if axis == k:
            raise self.refuse(node, "gathers along the widened axis")
        r_idx = self.rank(node.inputs[1])
        if r_idx is None:
            raise self.refuse(node, "index rank unknown")
        r_out = t.rank - 1 + r_idx
        k_out = k - 1 + r_idx if axis < k else k
        return [t.moved(axis=k_out - r_out, rank=r_out)]
