"""Zero padding of quantized GEMMs, exactly: a padded weight entry must DEQUANTIZE to exactly 0,
so it is stored as its zero point, never as a plain 0 (with zero point z, (0 - z) * s != 0).

- com.microsoft.MatMulNBits (block-quantized int4/int8): tuner.rewrite.nbits.
- com.microsoft.MatMulBnb4 (bitsandbytes' FP4 / NF4): tuner.rewrite.bnb4.
- static QDQ (quantize_static): MatMul(DQ(Q(x)), DequantizeLinear(Wq (K, N), scale, zp)). New
  entries of Wq hold the zero point; the activations' scales are constants, so a padded
  activation quantizes to its zero point and back to exactly 0 (tuner.rewrite.axis.quantize),
  and whatever it is, it meets zero weights. The weight's scales may be per tensor, per axis
  or block-wise (ONNX Runtime's 4-bit quantizer with quant_format=QDQ): tuner.rewrite.dq_weight.
- MatMulInteger, as onnxruntime.quantization.quantize_dynamic writes it:

      x --DynamicQuantizeLinear--> (xq, x_scale, x_zp)
      MatMulInteger(xq, Wq (K, N) int8, x_zp, W_zp) --Cast--> --Mul(x_scale * W_scale)--> y

  New output columns and new input rows of Wq hold W_zp, so (Wq - W_zp) is 0 there and the
  int32 product gains exact zeros. New input rows meet padded activations: DynamicQuantizeLinear
  takes its range from min(0, x) .. max(0, x), so padded entries that are exactly 0 (a gated
  FFN's act(g) * 0, or act(0) = 0) leave x's quantization as it was; an FFN whose padded units
  are not 0 is refused (tuner.rewrite.ffn). Per-channel weights (a zero point and a scale per
  column: Optimum's ORTQuantizer with per_channel) get new columns of zero point 0 and weight
  0, and the constant weight scale that the dequantizing Mul multiplies into x_scale grows
  with them (0 for the new columns).

The functions here take a tuner.rewrite.common.Projection whose `quantized` says which kind.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite import bnb4, dq_weight, nbits
from tuner.rewrite.common import Projection, const_array, new_initializer

INTEGER = "integer"
NBITS = "nbits"
BNB4 = "bnb4"
QDQ = "qdq"


def kind(node: ir.Node) -> str | None:
    """"nbits" / "bnb4" / "integer" for the quantized GEMMs padded here, None otherwise."""
    if nbits.is_nbits(node):
        return NBITS
    if bnb4.is_bnb4(node):
        return BNB4
    if node.op_type == "MatMulInteger" and node.domain in ("", "ai.onnx"):
        return INTEGER
    return None


def widen_out(graph: ir.Graph, proj: Projection, new_n: int, tag: str,
              columns: np.ndarray | None = None) -> list[ir.Value]:
    """N -> new_n output features; `columns`: where each old feature goes (default: first).
    Returns the values besides the node's output that now span new_n (a per-column scale
    product), for the caller's axis engine."""
    if proj.quantized == NBITS:
        nbits.widen_out(graph, proj.node, new_n, tag, columns)
        return []
    if proj.quantized == BNB4:
        bnb4.widen_out(graph, proj.node, new_n, tag, columns)
        return []
    if proj.quantized == QDQ:
        dq_weight.widen(graph, _dq_of(proj), tag, new_n=new_n, columns=columns)
        return []
    w = _integer_weight(proj.node)
    n = w.q.shape[1]
    columns = np.arange(n) if columns is None else np.asarray(columns)
    zero = w.zero.reshape(-1)
    if w.zero.size > 1:  # per column: the new columns' zero point 0, their entries 0
        zero = np.zeros(new_n, w.zero.dtype)
        zero[columns] = w.zero.reshape(-1)
        proj.node.replace_input_with(3, new_initializer(graph, f"{proj.node.name}.{tag}.zp",
                                                        zero))
    if w.scale.size > 1:  # per column: the new columns' scale 0
        scale = np.zeros(new_n, w.scale.dtype)
        scale[columns] = w.scale.reshape(-1)
        shape = w.scale.shape[:-1] + (new_n,)
        w.scale_mul.replace_input_with(w.scale_index, new_initializer(
            graph, f"{proj.node.name}.{tag}.scale", scale.reshape(shape)))
    out = np.array(np.broadcast_to(zero, (w.q.shape[0], new_n)), w.q.dtype)  # zero points
    out[:, columns] = w.q
    _set_weight(graph, proj, out, tag)
    return [w.scale_mul.outputs[0]] if w.scale.size > 1 else []


def widen_in(graph: ir.Graph, proj: Projection, new_k: int, tag: str,
             fed_zeros: bool = False) -> None:
    """K -> new_k input features, appended, each stored as the zero point (dequantized: 0);
    `fed_zeros`: the new features are exact zeros (MatMulNBits may then take HQQ's float
    zero points, tuner.rewrite.nbits)."""
    if proj.quantized == NBITS:
        nbits.widen_in(graph, proj.node, new_k, tag, exact_zero=not fed_zeros)
        return
    if proj.quantized == BNB4:
        bnb4.widen_in(graph, proj.node, new_k, tag)
        return
    if proj.quantized == QDQ:
        dq_weight.widen(graph, _dq_of(proj), tag, new_k=new_k)
        return
    w = _integer_weight(proj.node)
    out = np.array(np.broadcast_to(w.zero.reshape(-1), (new_k, w.q.shape[1])), w.q.dtype)
    out[: w.q.shape[0]] = w.q  # new rows: each column's zero point
    _set_weight(graph, proj, out, tag)


def output_node(proj: Projection) -> ir.Node:
    """The node whose output is the projection's float result: the dequantizing Mul after a
    MatMulInteger (Cast -> Mul), the node itself otherwise."""
    if proj.quantized != INTEGER:
        return proj.node
    users = [u.node for u in proj.node.outputs[0].uses()]
    if len(users) == 1 and users[0].op_type == "Cast":
        after = [u.node for u in users[0].outputs[0].uses()]
        if len(after) == 1 and after[0].op_type == "Mul":
            return after[0]
    raise RewriteRefused(f"node {proj.node.name!r}: MatMulInteger not followed by Cast -> Mul "
                         "(the dequantizing scale)")


def _set_weight(graph: ir.Graph, proj: Projection, w: np.ndarray, tag: str) -> None:
    proj.node.replace_input_with(1, new_initializer(graph, f"{proj.node.name}.{tag}.weight", w))


def _dq_of(proj: Projection) -> ir.Node:
    """The DequantizeLinear that makes a static QDQ projection's weight, its own."""
    dq = proj.node.inputs[proj.weight_index].producer()
    if len(dq.outputs[0].uses()) > 1:
        raise RewriteRefused(f"node {dq.name!r}: a DequantizeLinear weight shared by "
                             "several nodes")
    return dq


@dataclass(frozen=True)
class IntegerWeight:
    """A MatMulInteger's Wq (K, N), its zero point (a scalar, or one per column), and the
    constant weight scale of its dequantizing Mul (x_scale * w_scale: a scalar, or (N,))
    with the Mul that multiplies it in and its input slot there."""

    q: np.ndarray
    zero: np.ndarray
    scale: np.ndarray
    scale_mul: ir.Node
    scale_index: int


def _integer_weight(node: ir.Node) -> IntegerWeight:
    """Wq (K, N), its zero points and the weight scale, per tensor or per column (Optimum's
    ORTQuantizer with per_channel, quantize_dynamic(per_channel=True))."""
    w = const_array(node.inputs[1])
    if w is None or w.ndim != 2:
        raise RewriteRefused(f"node {node.name!r}: MatMulInteger weight is not a 2-D constant")
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    zp = const_array(zp_value) if zp_value is not None else np.zeros((), w.dtype)
    if zp is None:
        raise RewriteRefused(f"node {node.name!r}: MatMulInteger weight zero point not constant")
    mul, index, scale = _weight_scale(node)
    n = w.shape[1]
    if zp.size not in (1, n) or scale.size not in (1, n):
        raise RewriteRefused(f"node {node.name!r}: zero points {zp.shape} / weight scales "
                             f"{scale.shape} are neither per tensor nor per column of {n}")
    return IntegerWeight(w, zp, scale, mul, index)


def _weight_scale(node: ir.Node) -> tuple[ir.Node, int, np.ndarray]:
    """The Mul that multiplies the weight's constant scale into x_scale, the scale's input
    slot there, and the scale."""
    tail = output_node(Projection(node, 1, 1, 0, None, INTEGER))
    for v in tail.inputs:
        p = v.producer() if v is not None else None
        if p is not None and p.op_type == "Mul":
            for i, c in enumerate(const_array(x) for x in p.inputs):
                if c is not None:
                    return p, i, c
    raise RewriteRefused(f"node {node.name!r}: no constant weight scale multiplied into the "
                         f"dequantizing Mul {tail.name!r}")
