"""Small graph helpers the detectors share: constants behind Identity/Constant, linear layers
(MatMul/Gemm onto a 2-D constant weight), and bounded walks along the data path.

Detection never looks at names: a weight is a weight because a MatMul reads a 2-D constant,
not because it is called `q_proj`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import onnx_ir as ir

MS = "com.microsoft"


def op(node: ir.Node | None) -> str:
    """"Add" for the default domain, "com.microsoft.Attention" otherwise."""
    if node is None:
        return ""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def source(v: ir.Value | None) -> ir.Value | None:
    """The value behind any chain of Identity nodes (TorchScript hides biases behind them)."""
    while v is not None:
        p = v.producer()
        if p is not None and op(p) == "Identity" and p.inputs and p.inputs[0] is not None:
            v = p.inputs[0]
            continue
        return v
    return None


def const_tensor(v: ir.Value | None) -> ir.TensorProtocol | None:
    """The constant a value holds (initializer, Constant node, through Identity), else None."""
    v = source(v)
    if v is None:
        return None
    if v.const_value is not None:
        return v.const_value
    p = v.producer()
    if p is not None and op(p) == "Constant":
        for key, attr in p.attributes.items():
            if key == "value":
                return attr.value
            if key in ("value_float", "value_int", "value_floats", "value_ints"):
                return ir.tensor(np.asarray(attr.value))
    return None


def is_const(v: ir.Value | None) -> bool:
    return const_tensor(v) is not None


def const_array(v: ir.Value | None, max_size: int = 4096) -> np.ndarray | None:
    """A small constant as numpy (shape constants, scales); None for big or dynamic ones."""
    t = const_tensor(v)
    if t is None or t.size > max_size:
        return None
    return np.asarray(t.numpy())


def const_scalar(v: ir.Value | None) -> float | None:
    a = const_array(v, max_size=1)
    return None if a is None else float(a.reshape(-1)[0])


_UNARY = {"Sqrt": np.sqrt, "Reciprocal": np.reciprocal, "Cast": float, "Identity": float}
_BINARY = {"Div": np.divide, "Mul": np.multiply, "Add": np.add, "Sub": np.subtract,
           "Pow": np.power}


def folded_scalar(v: ir.Value | None, depth: int = 6) -> float | None:
    """A scalar made of constants alone, evaluated: a constant, or a Sqrt / Div / Mul ... of
    such (the softmax scale tuner.rewrite.head_dim pins, Sqrt(1 / sqrt(d)) on each of q and
    k where TorchScript computed it from the shape); None otherwise."""
    c = const_scalar(v)
    node = v.producer() if v is not None and c is None and depth > 0 else None
    if node is None or not node.inputs:
        return c
    args = [folded_scalar(i, depth - 1) for i in node.inputs]
    if any(a is None for a in args):
        return None
    fn = (_UNARY if len(args) == 1 else _BINARY if len(args) == 2 else {}).get(op(node))
    if fn is None:
        return None
    with np.errstate(all="ignore"):
        out = float(fn(*args))
    return out if np.isfinite(out) else None


def const_shape(v: ir.Value | None) -> tuple[int, ...] | None:
    t = const_tensor(v)
    return None if t is None else tuple(int(d) for d in t.shape)


def consumers(v: ir.Value) -> list[ir.Node]:
    """Nodes that read `v`, each once, in graph order of first use."""
    seen: dict[int, ir.Node] = {}
    for use in v.uses():
        seen.setdefault(id(use.node), use.node)
    return list(seen.values())


@dataclass(frozen=True)
class Linear:
    """A MatMul/Gemm of an activation with a 2-D constant weight (or ORT's MatMulNBits or
    MatMulBnb4). `weight` is the value that holds the stored tensor (the initializer; behind an
    exporter's Transpose when `transposed`); in_dim/out_dim are the GEMM's K and N whatever
    the storage order."""

    node: ir.Node
    weight: ir.Value
    in_dim: int
    out_dim: int
    transposed: bool  # stored as (out, in): Gemm transB=1 or a Transpose before the MatMul
    bias: ir.Value | None = None
    # TorchScript's separate Add(bias, MatMul), or the Mul that dequantizes a MatMulInteger's
    # int32 result (quantize_dynamic: MatMulInteger -> Cast -> Mul by x_scale * w_scale)
    bias_add: ir.Node | None = None

    @property
    def output(self) -> ir.Value:
        """The projection's result, after its bias Add when there is one."""
        return (self.bias_add or self.node).outputs[0]


def _weight_of(v: ir.Value | None) -> tuple[ir.Value, bool] | None:
    """(stored weight value, transposed) when `v` is a 2-D constant, possibly transposed."""
    v = source(v)
    if v is None:
        return None
    shape = const_shape(v)
    if shape is not None:
        return (v, False) if len(shape) == 2 else None
    p = v.producer()
    if p is not None and op(p) == "DequantizeLinear":  # static QDQ: DQ(int8 W, scale, zp)
        inner = source(p.inputs[0])
        ishape = const_shape(inner)
        return (inner, False) if ishape is not None and len(ishape) == 2 else None  # type: ignore[return-value]
    if p is not None and op(p) == "Transpose":
        inner = source(p.inputs[0])
        perm = p.attributes.get("perm")
        ishape = const_shape(inner)
        if ishape is not None and len(ishape) == 2 and (perm is None or list(perm.value) == [1, 0]):
            return inner, True
    return None


def _bias_add(out: ir.Value, width: int) -> tuple[ir.Value, ir.Node] | None:
    users = consumers(out)
    if len(users) != 1 or op(users[0]) != "Add":
        return None
    add = users[0]
    other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
    shape = const_shape(other)
    if shape is not None and shape[-1:] == (width,) and int(np.prod(shape)) == width:
        return source(other), add
    return None


def as_linear(node: ir.Node) -> Linear | None:
    kind = op(node)
    if kind == "MatMul":
        a, b = node.inputs[0], node.inputs[1]
        if is_const(a):
            return None
        w = _weight_of(b)
        if w is None:
            return None
        value, transposed = w
        rows, cols = const_shape(value)  # type: ignore[misc]
        k, n = (cols, rows) if transposed else (rows, cols)
        bias = _bias_add(node.outputs[0], n)
        return Linear(node, value, k, n, transposed, *(bias or (None, None)))
    if kind == "Gemm":
        attrs = node.attributes
        if attrs.get("transA") is not None and attrs["transA"].value:
            return None
        if is_const(node.inputs[0]):
            return None
        w = _weight_of(node.inputs[1])
        if w is None:
            return None
        value, transposed = w
        rows, cols = const_shape(value)  # type: ignore[misc]
        trans_b = bool(attrs["transB"].value) if attrs.get("transB") is not None else False
        transposed = transposed != trans_b
        k, n = (cols, rows) if transposed else (rows, cols)
        bias = source(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else None
        if bias is None:
            found = _bias_add(node.outputs[0], n)
            if found:
                return Linear(node, value, k, n, transposed, *found)
        return Linear(node, value, k, n, transposed, bias)
    if kind == "MatMulInteger":  # quantize_dynamic: (DynamicQuantizeLinear(x), int8 W)
        shape = const_shape(node.inputs[1])
        tail = _dequantizing_mul(node)
        if shape is None or len(shape) != 2 or tail is None:
            return None
        return Linear(node, source(node.inputs[1]), shape[0], shape[1], False, None, tail)  # type: ignore[arg-type]
    if kind == f"{MS}.MatMulNBits":
        # Block-quantized weight (ORT's int4/int8 GEMM): K and N are attributes; the packed
        # weight is stored N-major, (N, blocks, blob bytes).
        attrs = node.attributes
        if attrs.get("K") is None or attrs.get("N") is None or not is_const(node.inputs[1]):
            return None
        k, n = int(attrs["K"].value), int(attrs["N"].value)
        bias = source(node.inputs[5]) if len(node.inputs) > 5 and node.inputs[5] is not None else None
        found = None if bias is not None else _bias_add(node.outputs[0], n)
        return Linear(node, source(node.inputs[1]), k, n, True, *(found or (bias, None)))  # type: ignore[arg-type]
    if kind == f"{MS}.MatMulBnb4":
        # bitsandbytes' 4-bit weight (FP4 / NF4; transformers.js' model_bnb4.onnx): K and N
        # are attributes; the packed weight is one flat array of the (N, K) values' nibbles
        attrs = node.attributes
        if attrs.get("K") is None or attrs.get("N") is None or not is_const(node.inputs[1]):
            return None
        k, n = int(attrs["K"].value), int(attrs["N"].value)
        return Linear(node, source(node.inputs[1]), k, n, True,  # type: ignore[arg-type]
                      *(_bias_add(node.outputs[0], n) or (None, None)))
    return None


def _dequantizing_mul(node: ir.Node) -> ir.Node | None:
    """The Mul after Cast(MatMulInteger) that scales the int32 product back to floats."""
    users = consumers(node.outputs[0])
    if len(users) != 1 or op(users[0]) != "Cast":
        return None
    after = consumers(users[0].outputs[0])
    return after[0] if len(after) == 1 and op(after[0]) == "Mul" else None


def linears(graph: ir.Graph) -> list[Linear]:
    """Every linear layer of the main graph, in graph order."""
    return [lin for node in graph if (lin := as_linear(node)) is not None]


# Ops along which a tensor keeps "being the same activation" when walking the data path.
# The value is the input positions to follow (None: every non-constant input).
DATA_INPUTS: dict[str, tuple[int, ...] | None] = {
    "Reshape": (0,), "Transpose": (0,), "Squeeze": (0,), "Unsqueeze": (0,), "Flatten": (0,),
    "Cast": (0,), "Identity": (0,), "Expand": (0,), "Tile": (0,), "Slice": (0,), "Split": (0,),
    "Dropout": (0,), "Concat": None, "Mul": None, "Div": None, "Add": None, "Sub": None,
    "Neg": (0,), "Where": (1, 2),
    # quantized graphs: the activation is quantized on its way into the GEMM
    "DynamicQuantizeLinear": (0,), "QuantizeLinear": (0,), "DequantizeLinear": (0,),
}


def walk_back(start: ir.Value, follow: Callable[[ir.Node], Iterable[int] | None],
              stop: Callable[[ir.Value], bool], limit: int = 400
              ) -> tuple[list[ir.Value], list[ir.Node]]:
    """Breadth-first walk from `start` towards the graph inputs. `stop(v)` ends the walk at
    `v` (collected as a hit); `follow(node)` names the input positions to continue through,
    or None to stop there. Returns (hits, nodes walked through)."""
    hits: list[ir.Value] = []
    walked: list[ir.Node] = []
    seen: set[int] = set()
    queue: deque[ir.Value] = deque([start])
    while queue and len(walked) < limit:
        v = queue.popleft()
        if id(v) in seen or is_const(v):
            continue
        seen.add(id(v))
        if stop(v):
            hits.append(v)
            continue
        node = v.producer()
        if node is None:
            continue
        positions = follow(node)
        if positions is None:
            continue
        walked.append(node)
        for i in positions:
            if i < len(node.inputs) and node.inputs[i] is not None:
                queue.append(node.inputs[i])
    return hits, walked


def walk_forward(start: ir.Value, follow: Callable[[ir.Node], bool],
                 want: Callable[[ir.Node], bool], limit: int = 400) -> list[ir.Node]:
    """Breadth-first walk from `start` towards the graph outputs: a node with `want(node)`
    is collected (and not walked through); `follow(node)` continues through its outputs.
    At most `limit` nodes are visited. Returns the collected nodes in the order met."""
    found: list[ir.Node] = []
    seen: set[int] = set()
    queue: deque[ir.Value] = deque([start])
    while queue and len(seen) < limit:
        for node in consumers(queue.popleft()):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if want(node):
                found.append(node)
            elif follow(node):
                queue.extend(node.outputs)
    return found
