"""Zero padding of ONNX Runtime's bitsandbytes-style 4-bit GEMM, com.microsoft.MatMulBnb4
(transformers.js repositories ship it as onnx/model_bnb4.onnx), exactly.

    Y (.., N) = A (.., K) @ W^T,  W (N, K) flattened: w[i] = table[code[i]] * absmax[i // bs]

The (N, K) weight is one flat run of 4-bit codes, two to a byte, quantized in blocks of
block_size along that run with one absmax each; `quant_type` picks the table (FP4: 0, NF4: 1),
both of which hold an exact 0. Where each row is whole blocks and whole bytes (K a multiple of
block_size, as in real models' widths), a row is K/2 bytes and K/bs absmaxes:

- along N (new output features: the LM head's vocabulary, an FFN's up/gate units), each new
  row is the zero code with absmax 0;
- along K (new input features: an FFN's down projection), each row gets whole new blocks of
  the zero code with absmax 0.

Every new weight is table[zero] * 0 = 0. Rows that straddle blocks (K not a multiple of the
block size) are refused, naming the node: padding them would need the codes repacked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite.common import const_array, new_initializer, refuse_smaller, set_gemm_sizes

OP = "MatMulBnb4"
_B, _ABSMAX = 1, 2
# the byte whose two codes are 0.0 in each table: FP4's code 0, NF4's code 7
ZERO_BYTE = {0: 0x00, 1: 0x77}


def is_bnb4(node: ir.Node) -> bool:
    return node.op_type == OP and node.domain == "com.microsoft"


@dataclass(frozen=True)
class Bnb4:
    """One MatMulBnb4's weight by rows: bytes (N, K/2) and absmax (N, K/bs)."""

    node: ir.Node
    k: int
    n: int
    block: int
    zero_byte: int
    rows: np.ndarray
    absmax: np.ndarray


def _attr(node: ir.Node, name: str) -> int:
    a = node.attributes.get(name)
    if a is None:
        raise RewriteRefused(f"node {node.name!r}: MatMulBnb4 without its {name} attribute")
    return int(a.value)


def read(node: ir.Node) -> Bnb4:
    k, n, block = _attr(node, "K"), _attr(node, "N"), _attr(node, "block_size")
    quant_type = _attr(node, "quant_type")
    packed, absmax = const_array(node.inputs[_B]), const_array(node.inputs[_ABSMAX])
    if packed is None or absmax is None:
        raise RewriteRefused(f"node {node.name!r}: MatMulBnb4 weight or absmax not constant")
    if quant_type not in ZERO_BYTE:
        raise RewriteRefused(f"node {node.name!r}: MatMulBnb4 quant_type {quant_type} unknown")
    if k % block or k % 2 or packed.size != n * k // 2 or absmax.size != n * k // block:
        raise RewriteRefused(f"node {node.name!r}: MatMulBnb4 rows straddle its blocks (K {k}, "
                             f"block size {block}): only whole-block rows are padded")
    return Bnb4(node, k, n, block, ZERO_BYTE[quant_type], packed.reshape(n, k // 2),
                absmax.reshape(n, k // block))


def _write(graph: ir.Graph, w: Bnb4, rows: np.ndarray, absmax: np.ndarray, k: int, n: int,
           tag: str) -> None:
    node = w.node
    node.replace_input_with(_B, new_initializer(graph, f"{node.name}.{tag}.q",
                                                rows.reshape(-1).astype(np.uint8)))
    node.replace_input_with(_ABSMAX, new_initializer(graph, f"{node.name}.{tag}.absmax",
                                                     absmax.reshape(-1)))
    set_gemm_sizes(node, k, n)


def widen_out(graph: ir.Graph, node: ir.Node, new_n: int, tag: str,
              rows: np.ndarray | None = None) -> int:
    """N -> new_n output features, each new row the zero code at absmax 0; `rows`: where each
    old row goes (default: first). Returns the old N."""
    w = read(node)
    refuse_smaller(node, "N", w.n, new_n)
    where = np.arange(w.n) if rows is None else np.asarray(rows)
    packed = np.full((new_n, w.k // 2), w.zero_byte, np.uint8)
    packed[where] = w.rows
    absmax = np.zeros((new_n, w.absmax.shape[1]), w.absmax.dtype)
    absmax[where] = w.absmax
    _write(graph, w, packed, absmax, w.k, new_n, tag)
    return w.n


def widen_in(graph: ir.Graph, node: ir.Node, new_k: int, tag: str) -> int:
    """K -> new_k input features, appended as whole blocks of zeros. Returns the old K."""
    w = read(node)
    if new_k < w.k or (new_k - w.k) % w.block:
        raise RewriteRefused(f"node {node.name!r}: K {w.k} -> {new_k} is not whole blocks of "
                             f"{w.block}")
    extra = (new_k - w.k) // w.block
    packed = np.concatenate([w.rows, np.full((w.n, extra * w.block // 2), w.zero_byte,
                                             np.uint8)], axis=1)
    absmax = np.concatenate([w.absmax, np.zeros((w.n, extra), w.absmax.dtype)], axis=1)
    _write(graph, w, packed, absmax, new_k, w.n, tag)
    return w.k
