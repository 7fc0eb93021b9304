"""Zero padding of a DequantizeLinear weight, exactly, whatever its scales' layout:

    W (K, N) = (Wq - zp) * scale            the MatMul's weight, Wq stored as int8/uint8/int4

  per tensor   scale, zp scalars            quantize_static
  per axis     scale, zp (N,) on axis 1     a scale per output column
  block-wise   scale, zp (ceil(K / bs), N)  opset 21's block_size: ONNX Runtime's 4-bit
               on axis 0                    quantizer with quant_format=QDQ (or (K, ceil(N / bs))
                                            on axis 1)

Every new entry of Wq holds the zero point of its own scale group, so it dequantizes to
exactly 0: a new column's or a new block's group is new (zero point 0, scale 0); a new row
inside the old last, partly used block takes that block's zero point. Old entries keep their
groups: an output column may move (`columns`, a fused gate+up projection's halves) only where
its group moves with it (not block-wise along N).

    widen(graph, dq, tag, new_k=448)                  # K -> 448 (a down projection)
    widen(graph, dq, tag, new_n=1024, columns=...)    # N -> 1024 (a head, an up projection)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite.common import const_array, new_initializer


@dataclass(frozen=True)
class DqWeight:
    """A weight DequantizeLinear's Wq (K, N), its scale and zero point as stored, and the
    group each element belongs to: `axis` None (per tensor), or the axis of the scales with
    `block` elements per group along it (1: per axis)."""

    node: ir.Node
    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    axis: int | None
    block: int

    def params_shape(self, k: int, n: int) -> tuple[int, ...]:
        """The scales' shape for a (k, n) weight."""
        if self.axis is None:
            return self.scale.shape
        if self.block == 1:  # per axis: one per row (axis 0) or column (axis 1)
            return ((k,) if self.axis == 0 else (n,))
        return (-(-k // self.block), n) if self.axis == 0 else (k, -(-n // self.block))

    def grid(self, params: np.ndarray, k: int, n: int) -> np.ndarray:
        """`params` (scales or zero points) broadcast to every element of a (k, n) weight."""
        if self.axis is None:
            return np.broadcast_to(params.reshape(()), (k, n))
        if self.block == 1:
            return np.broadcast_to(params[:, None] if self.axis == 0 else params[None, :], (k, n))
        rows = np.arange(k) // (self.block if self.axis == 0 else 1)
        cols = np.arange(n) // (self.block if self.axis == 1 else 1)
        return params[rows[:, None], cols[None, :]]


def read(dq: ir.Node) -> DqWeight:
    """The DequantizeLinear's weight; RewriteRefused where it is not constant or its scales
    fit no layout above."""
    q = const_array(dq.inputs[0])
    scale = const_array(dq.inputs[1]) if len(dq.inputs) > 1 else None
    zp = const_array(dq.inputs[2]) if len(dq.inputs) > 2 and dq.inputs[2] is not None else None
    if q is None or q.ndim != 2 or scale is None:
        raise RewriteRefused(f"node {dq.name!r}: DequantizeLinear weight or scale not constant")
    if len(dq.inputs) > 2 and dq.inputs[2] is not None and zp is None:
        raise RewriteRefused(f"node {dq.name!r}: DequantizeLinear zero point not constant")
    axis = dq.attributes["axis"].as_int() if "axis" in dq.attributes else 1
    axis = axis + 2 if axis < 0 else axis
    block = dq.attributes["block_size"].as_int() if "block_size" in dq.attributes else 0
    if scale.size == 1:
        w = DqWeight(dq, q, scale, zp, None, 0)
    else:
        w = DqWeight(dq, q, scale, zp, axis, block or 1)
    if w.axis is not None and scale.shape != w.params_shape(*q.shape):
        raise RewriteRefused(f"node {dq.name!r}: scales {scale.shape} do not match the weight "
                             f"{q.shape} on axis {axis}, block {block or '-'}")
    if zp is not None and zp.shape != scale.shape:
        raise RewriteRefused(f"node {dq.name!r}: zero points {zp.shape} and scales "
                             f"{scale.shape} differ")
    return w


def _grown(w: DqWeight, params: np.ndarray | None, k: int, n: int,
           columns: np.ndarray) -> np.ndarray | None:
    """`params` for a (k, n) weight: new groups 0, old ones where their rows and `columns`
    went."""
    if params is None or w.axis is None:
        return params
    out = np.zeros(w.params_shape(k, n), params.dtype)
    if w.block == 1:  # per axis: (K,) or (N,)
        out[columns if w.axis == 1 else slice(0, len(params))] = params
    elif w.axis == 0:  # (ceil(K / bs), N)
        out[: params.shape[0], columns] = params
    else:  # (K, ceil(N / bs)): columns stay where they were (checked)
        out[: params.shape[0], : params.shape[1]] = params
    return out


def widen(graph: ir.Graph, dq: ir.Node, tag: str, new_k: int | None = None,
          new_n: int | None = None, columns: np.ndarray | None = None) -> None:
    """Wq (K, N) -> (new_k, new_n), old entries at rows [0, K) and `columns` (default the
    first N), every new entry its group's zero point; the scales and zero points grown."""
    w = read(dq)
    k, n = w.q.shape
    k2, n2 = new_k or k, new_n or n
    columns = np.arange(n) if columns is None else np.asarray(columns)
    if k2 < k or n2 < n:
        raise RewriteRefused(f"node {dq.name!r}: weight {w.q.shape}; cannot pad to ({k2}, {n2})")
    if w.axis == 1 and w.block > 1 and not np.array_equal(columns, np.arange(n)):
        raise RewriteRefused(f"node {dq.name!r}: block-wise scales along N: moved columns "
                             "would leave their blocks")
    scale, zero = _grown(w, w.scale, k2, n2, columns), _grown(w, w.zero, k2, n2, columns)
    zeros = (w.grid(zero, k2, n2) if zero is not None
             else np.zeros((k2, n2), w.q.dtype))
    q = np.array(zeros, dtype=w.q.dtype)  # (k2, n2): every entry its group's zero point
    q[:k, columns] = w.q
    dq.replace_input_with(0, new_initializer(graph, f"{dq.name}.{tag}.q", q))
    if w.axis is not None:
        dq.replace_input_with(1, new_initializer(graph, f"{dq.name}.{tag}.scale", scale))
        if zero is not None:
            dq.replace_input_with(2, new_initializer(graph, f"{dq.name}.{tag}.zp", zero))
    dq.outputs[0].shape = None  # the dequantized weight's annotation is stale now
