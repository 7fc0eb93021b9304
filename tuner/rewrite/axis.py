"""Widen one axis through a graph region, exactly: the engine under the FFN, head-dim and
head-count rewrites.

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
- sinks (the down or output projection) take the tracked input as zero-padded weight rows.

Shape vectors (Reshape/Expand) are handled in axis_reshape, Slice/Split/Concat in axis_slice.

Whatever the engine does not understand refuses with the node's name: nothing is guessed.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite.common import const_array, set_const_input
from tuner.rewrite.shapemath import ShapeMath, is_int, scalar

ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "Neg", "Cast", "Identity",
               "IsNaN", "Equal", "Sigmoid", "Tanh", "Relu", "Erf", "Cos", "Sin", "Abs", "Sqrt",
               "Exp", "Not", "And", "Or", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
               "CastLike", "Dropout", "Reciprocal", "Log", "Softplus", "Softsign", "Sign", "Floor",
               "Ceil", "Round", "Gelu", "Elu", "Selu", "LeakyRelu", "HardSwish", "HardSigmoid",
               "Mish"}
# ONNX Runtime's fused activations (after its transformer optimizer): elementwise, a bias
# operand broadcast along the last axis.
MS_ELEMENTWISE = {"BiasGelu", "FastGelu", "Gelu", "QuickGelu", "BiasAdd"}
ONE_FILL = {("Div", 1), ("Pow", 1)}
INT_MAX = 2**62
_RUNS = itertools.count(1)


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


def _widened_shape(shape: ir.Shape | None, t: Track) -> ir.Shape | None:
    """The exporter's annotation with the widened dim updated (symbolic dims kept, so that
    inspect still reads the variant); None (unknown) when it does not fit the track."""
    if shape is None or len(shape) != t.rank or shape[t.axis] != t.old:
        return None
    dims = list(shape.dims)
    dims[t.axis] = t.new
    return ir.Shape(dims)


def scatter(array: np.ndarray, axis: int, t: Track, fill: float = 0.0) -> np.ndarray:
    shape = list(array.shape)
    shape[axis] = t.new
    out = np.full(shape, fill, dtype=array.dtype)
    index = [slice(None)] * array.ndim
    index[axis] = list(t.pos)
    out[tuple(index)] = array
    return out


Sink = Callable[[ir.Node, list["Track | None"]], None]
# op type -> handler(widen, node, input tracks) -> one Track (or None) per output; the shape
# and slicing handlers live in axis_reshape / axis_slice and register here.
HANDLERS: dict[str, Callable] = {}


def handler(op_type: str):
    def register(fn):
        HANDLERS[op_type] = fn
        return fn
    return register


class Widen:
    def __init__(self, model: ir.Model, dims, what: str) -> None:
        self.model, self.graph, self.dims, self.what = model, model.graph, dims, what
        self.tracks: dict[ir.Value, Track] = {}
        self.sinks: dict[ir.Node, Sink] = {}
        self.token = next(_RUNS)  # scopes the constants this run replaces
        self.math = ShapeMath(self._shape_of, scope=self.token)

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

    def set_const(self, node: ir.Node, index: int, array: np.ndarray, tag: str) -> ir.Value:
        self.math.memo.clear()  # "new" evaluations may read the constant being replaced
        return set_const_input(self.graph, node, index, array, tag, scope=self.token)

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
            handler = None
            if node.domain == "com.microsoft" and node.op_type in MS_ELEMENTWISE:
                handler = self._elementwise
            if node.domain in ("", "ai.onnx"):
                if node.op_type in ELEMENTWISE:
                    handler = self._elementwise
                elif node.op_type in HANDLERS:
                    handler = functools.partial(HANDLERS[node.op_type], self)
                else:
                    handler = getattr(self, f"_op_{node.op_type}", None)
            if handler is None:
                raise self.refuse(node, "this op on the widened axis is not understood")
            outs = handler(node, tin)
            for out, t in zip(node.outputs, outs):
                if t is not None:
                    if out.is_graph_output():
                        raise self.refuse(node, "the widened axis reaches a graph output")
                    self.tracks[out] = t
        for value, t in self.tracks.items():
            if not value.is_graph_output() and value.const_value is None:
                value.shape = _widened_shape(value.shape, t)



    # -- nodes without a tracked input: pin computed scales ---------------------------------
    def _untracked(self, node: ir.Node) -> None:
        """Arithmetic on plain values may still read a computed scale: Div(scores, sqrt(d))."""
        if node.op_type in ("Mul", "Div", "Add", "Sub", "Pow") and node.domain in ("", "ai.onnx"):
            for j in range(len(node.inputs)):
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
        self.set_const(node, j, np.array(old, dtype=dtype), "pinned")
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
        self.set_const(node, j, scatter(c, t.axis, t, fill), "widened")

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
            if ta.axis <= -3 and ta.same(tb):
                return [ta.moved(rank=r)]  # a widened batch axis (heads) on both sides
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

    def _op_GatherND(self, node: ir.Node, tin: list) -> list:
        """Constant indices into leading axes (dynamo's qkv[..., [-2], :] for Falcon's k and v):
        the trailing axes, the widened one among them, keep their place from the end."""
        t = tin[0]
        if t is None or tin[1] is not None or const_array(node.inputs[1]) is None:
            raise self.refuse(node, "gathers with widened or computed indices")
        idx = const_array(node.inputs[1])
        b = node.attributes["batch_dims"].value if "batch_dims" in node.attributes else 0
        if t.rank + t.axis < b + idx.shape[-1]:
            raise self.refuse(node, "gathers along the widened axis")
        r_out = idx.ndim - 1 + t.rank - b - idx.shape[-1]
        return [t.moved(rank=r_out)]


# The handlers of shape vectors and slicing register themselves on import.
from tuner.rewrite import axis_fused, axis_reduce, axis_reshape, axis_slice  # noqa: E402,F401
