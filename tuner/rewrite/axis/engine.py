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

Each op family's handlers live in a module of their own beside this one (elementwise, layout,
matmul, gather, reshape, slice, reduce, attention_op); the package's __init__ lists them.

Whatever the engine does not understand refuses with the node's name: nothing is guessed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite.axis.shapemath import ShapeMath, is_int, scalar
from tuner.rewrite.common import const_array, set_const_input

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
# handler(widen, node, input tracks) -> one Track (or None) per output.
Handler = Callable[["Widen", ir.Node, list], list]

# (domain, op type) -> handler: the one table the engine reads. It is filled by the package's
# __init__ from an explicit list of op-family modules (elementwise, layout, matmul, ...), so
# this module imports none of them.
HANDLERS: dict[tuple[str, str], Handler] = {}


class Widen:
    def __init__(self, model: ir.Model, dims, what: str, cache=None) -> None:
        self.model, self.graph, self.dims, self.what = model, model.graph, dims, what
        # A decoder's KV cache met on the way (tuner.rewrite.axis.cache.CacheInterface, or
        # None): pads or widens the past at its Concat, slices or widens present.
        self.cache = cache
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

    def rank_any(self, v: ir.Value) -> int | None:
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
            domain = "" if node.domain == "ai.onnx" else node.domain
            handler = HANDLERS.get((domain, node.op_type))
            if handler is None:
                raise self.refuse(node, "this op on the widened axis is not understood")
            outs = handler(self, node, tin)
            for out, t in zip(node.outputs, outs):
                if t is not None:
                    if out.is_graph_output() and (self.cache is None
                                                  or not self.cache.output(self, out, t)):
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
                self.pin_one(node, j)

    def pin_one(self, node: ir.Node, j: int) -> bool:
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

    # -- helpers the op-family handlers share ---------------------------------------------------
    def axes(self, node: ir.Node, index: int) -> list[int] | None:
        if len(node.inputs) > index and node.inputs[index] is not None:
            c = const_array(node.inputs[index])
            return None if c is None else [int(x) for x in c.reshape(-1)]
        if "axes" in node.attributes:
            return list(node.attributes["axes"].value)
        return None
