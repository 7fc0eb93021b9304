"""Evaluate the small shape computations exporters leave in graphs (Shape -> Gather -> Div ->
Unsqueeze -> Concat -> Reshape, Shape -> Cast -> Sqrt -> Div for the attention scale), with
one axis's size set to its old or its new value.

A rewrite that widens an axis uses it twice: to learn what a computed Reshape target or Slice
bound meant before (old) and becomes after (new), and to pin a computed scale to the value it
had (TorchScript's 1/sqrt(d) from the query's shape). Unknown dims are NaN; anything not
understood evaluates to None, which callers treat as "cannot tell".
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import onnx_ir as ir

from tuner.rewrite.common import const_array, original_const

# value -> its dims as floats (NaN unknown) in the given mode ("old" or "new"), or None
ShapeOf = Callable[[ir.Value, str], "np.ndarray | None"]

_MAX_SIZE = 64  # shape vectors and scalars only: never evaluate real tensors
_OPS = {"Shape", "Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Floor", "Ceil", "Sqrt",
        "Reciprocal", "Neg", "Gather", "Concat", "Slice", "Add", "Sub", "Mul", "Div", "Pow",
        "Max", "Min"}


class ShapeMath:
    def __init__(self, shape_of: ShapeOf, scope: object = None) -> None:
        self.shape_of = shape_of
        self.scope = scope  # the rewrite whose replaced constants "old" mode reads
        self.memo: dict[tuple[int, str], np.ndarray | None] = {}

    def eval(self, value: ir.Value | None, mode: str) -> np.ndarray | None:
        if value is None:
            return None
        key = (id(value), mode)
        if key not in self.memo:
            self.memo[key] = None  # cycles cannot happen in a DAG; this also bounds recursion
            try:
                out = self._eval(value, mode)
            except (ValueError, IndexError, TypeError, ZeroDivisionError, KeyError,
                    RecursionError):
                out = None
            if out is not None and out.size > _MAX_SIZE:
                out = None
            self.memo[key] = out
        return self.memo[key]

    def folded(self, value: ir.Value | None) -> np.ndarray | None:
        """The value as int64s when it is computed from constants alone (the same in both
        modes, every entry known), else None. A graph slimmer (onnxslim, which transformers.js'
        conversions run) folds a static `x.shape[-1]` into a constant and leaves the
        arithmetic after it: such a shape entry or slice bound reads no shape that a rewrite
        changes, so it is rewritten like a constant."""
        old, new = self.eval(value, "old"), self.eval(value, "new")
        if old is None or new is None or not np.isfinite(old).all() or not np.array_equal(old, new):
            return None
        return old.astype(np.int64)

    def _eval(self, value: ir.Value, mode: str) -> np.ndarray | None:
        c = original_const(value, self.scope) if mode == "old" else const_array(value)
        if c is not None:
            return c.astype(np.float64) if c.size <= _MAX_SIZE and c.dtype.kind in "biuf" else None
        node = value.producer()
        if node is None or node.op_type not in _OPS or node.domain not in ("", "ai.onnx"):
            return None  # data ops (MatMul, Softmax, ...) are never shape math: stop here
        op = node.op_type
        ins = node.inputs
        if op == "Shape":
            dims = self.shape_of(ins[0], mode)
            if dims is None:
                return None
            start = node.attributes["start"].value if "start" in node.attributes else 0
            end = node.attributes["end"].value if "end" in node.attributes else None
            return dims[start:end]
        args = [self.eval(v, mode) for v in ins]
        if op in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Floor", "Ceil", "Sqrt",
                  "Reciprocal", "Neg") and args[0] is None:
            return None
        if op in ("Identity",):
            return args[0]
        if op == "Cast":
            to = ir.DataType(node.attributes["to"].value)
            return np.trunc(args[0]) if to.is_integer() else args[0]
        if op == "Sqrt":
            return np.sqrt(args[0])
        if op == "Reciprocal":
            return 1.0 / args[0]
        if op == "Neg":
            return -args[0]
        if op == "Squeeze":
            return args[0].reshape(-1)[0] if args[0].size == 1 else args[0]
        if op == "Unsqueeze":
            return args[0].reshape(-1) if args[0].ndim == 0 else args[0][None]
        if op == "Reshape":
            target = args[1]
            return None if target is None else args[0].reshape([int(t) for t in target])
        if op == "Gather":
            if args[1] is None:
                return None
            idx = args[1].astype(np.int64)
            return np.take(args[0], idx, axis=0) if args[0] is not None else None
        if op == "Concat":
            if any(a is None for a in args):
                return None
            return np.concatenate([a.reshape(-1) for a in args])
        if op == "Slice":
            if args[0] is None or args[1] is None or args[2] is None:
                return None
            s, e = int(args[1].reshape(-1)[0]), int(min(args[2].reshape(-1)[0], 2**62))
            step = int(args[4].reshape(-1)[0]) if len(args) > 4 and args[4] is not None else 1
            return args[0][s:e:step]
        if op in ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"):
            if args[0] is None or args[1] is None:
                return None
            a, b = args
            integer = is_int(ins[0])
            if op == "Div":
                return np.floor_divide(a, b) if integer else a / b
            return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Pow": np.power,
                    "Max": np.maximum, "Min": np.minimum}[op](a, b)
        return None


def is_int(value: ir.Value | None, depth: int = 32) -> bool:
    """Integer-typed shape math divides with floor (torch's // on sizes). Follows first inputs
    back (TorchScript leaves types off) at most `depth` steps."""
    for _ in range(depth):
        if value is None:
            return False
        c = const_array(value)
        if c is not None:
            return c.dtype.kind in "iu"
        if value.dtype is not None:
            return value.dtype.is_integer()
        node = value.producer()
        if node is None:
            return False
        if node.op_type == "Cast":
            return ir.DataType(node.attributes["to"].value).is_integer()
        if node.op_type in ("Shape", "Size"):
            return True
        value = node.inputs[0] if node.inputs else None
    return False


def scalar(arr: np.ndarray | None) -> float | None:
    """The one finite number in `arr`, else None."""
    if arr is None or arr.size != 1:
        return None
    x = float(arr.reshape(-1)[0])
    return x if np.isfinite(x) else None
