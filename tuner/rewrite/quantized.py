"""Zero padding of quantized GEMMs, exactly: a padded weight entry must DEQUANTIZE to exactly 0,
so it is stored as its zero point, never as a plain 0 (with zero point z, (0 - z) * s != 0).

- com.microsoft.MatMulNBits (block-quantized int4/int8): tuner.rewrite.nbits.
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
  are not 0 is refused (tuner.rewrite.ffn). Per-channel weight scales (a scale per column) are
  refused, naming the node: the scale product is computed at run time, not a constant to pad.

The functions here take a tuner.rewrite.common.Projection whose `quantized` says which kind.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite import dq_weight, nbits
from tuner.rewrite.common import Projection, const_array, new_initializer

INTEGER = "integer"
NBITS = "nbits"
QDQ = "qdq"


def kind(node: ir.Node) -> str | None:
    """"nbits" / "integer" for the quantized GEMMs padded here, None otherwise."""
    if nbits.is_nbits(node):
        return NBITS
    if node.op_type == "MatMulInteger" and node.domain in ("", "ai.onnx"):
        return INTEGER
    return None


def widen_out(graph: ir.Graph, proj: Projection, new_n: int, tag: str,
              columns: np.ndarray | None = None) -> None:
    """N -> new_n output features; `columns`: where each old feature goes (default: first)."""
    if proj.quantized == NBITS:
        nbits.widen_out(graph, proj.node, new_n, tag, columns)
        return
    if proj.quantized == QDQ:
        dq_weight.widen(graph, _dq_of(proj), tag, new_n=new_n, columns=columns)
        return
    node, (w, zp) = _weight_holder(proj)
    n = w.shape[1]
    columns = np.arange(n) if columns is None else np.asarray(columns)
    out = np.full((w.shape[0], new_n), zp, w.dtype)  # new columns: the zero point
    out[:, columns] = w
    _set_weight(graph, proj, node, out, tag)


def widen_in(graph: ir.Graph, proj: Projection, new_k: int, tag: str,
             fed_zeros: bool = False) -> None:
    """K -> new_k input features, appended, each stored as the zero point (dequantized: 0);
    `fed_zeros`: the new features are exact zeros (MatMulNBits may then take HQQ's float
    zero points, tuner.rewrite.nbits)."""
    if proj.quantized == NBITS:
        nbits.widen_in(graph, proj.node, new_k, tag, exact_zero=not fed_zeros)
        return
    if proj.quantized == QDQ:
        dq_weight.widen(graph, _dq_of(proj), tag, new_k=new_k)
        return
    node, (w, zp) = _weight_holder(proj)
    out = np.full((new_k, w.shape[1]), zp, w.dtype)
    out[: w.shape[0]] = w
    _set_weight(graph, proj, node, out, tag)


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


def _weight_holder(proj: Projection) -> tuple[ir.Node, tuple[np.ndarray, int]]:
    """(the MatMulInteger, (Wq, zero point))."""
    return proj.node, _integer_weight(proj.node)


def _set_weight(graph: ir.Graph, proj: Projection, holder: ir.Node, w: np.ndarray,
                tag: str) -> None:
    holder.replace_input_with(1, new_initializer(graph, f"{proj.node.name}.{tag}.weight", w))


def _dq_of(proj: Projection) -> ir.Node:
    """The DequantizeLinear that makes a static QDQ projection's weight, its own."""
    dq = proj.node.inputs[proj.weight_index].producer()
    if len(dq.outputs[0].uses()) > 1:
        raise RewriteRefused(f"node {dq.name!r}: a DequantizeLinear weight shared by "
                             "several nodes")
    return dq


def _integer_weight(node: ir.Node) -> tuple[np.ndarray, int]:
    """Wq (K, N) and its per-tensor zero point; RewriteRefused for a per-channel one."""
    w = const_array(node.inputs[1])
    if w is None or w.ndim != 2:
        raise RewriteRefused(f"node {node.name!r}: MatMulInteger weight is not a 2-D constant")
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    zp = const_array(zp_value) if zp_value is not None else np.zeros((), w.dtype)
    if zp is None:
        raise RewriteRefused(f"node {node.name!r}: MatMulInteger weight zero point not constant")
    if zp.size != 1:
        raise RewriteRefused(f"node {node.name!r}: per-channel weight quantization (a zero "
                             "point and scale per column): the run-time scale product would "
                             "need padding too")
    _per_tensor_scale(node)
    return w, int(zp.reshape(-1)[0])


def _per_tensor_scale(node: ir.Node) -> None:
    """RewriteRefused unless the dequantizing Mul's scale (x_scale * w_scale) is a scalar."""
    tail = output_node(Projection(node, 1, 1, 0, None, INTEGER))
    for v in tail.inputs:
        p = v.producer() if v is not None else None
        if p is not None and p.op_type == "Mul":
            consts = [const_array(i) for i in p.inputs]
            if any(c is not None and c.size > 1 for c in consts):
                raise RewriteRefused(f"node {node.name!r}: per-channel weight scales "
                                     f"({p.name!r}): the run-time scale product would need "
                                     "padding too")
