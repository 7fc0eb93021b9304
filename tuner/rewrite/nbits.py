"""Zero padding of ONNX Runtime's block-quantized GEMM, com.microsoft.MatMulNBits, exactly.

    Y (.., N) = A (.., K) @ dequant(B)^T,  dequant(B)[n, k] = (q[n, k] - zp[n, k // bs]) * scale[n, k // bs]

B is stored N-major, (N, blocks, blob bytes) with blocks = ceil(K / block_size), `bits` bits per
element packed low bits first; scales are (N, blocks) (or flat), zero points (optional: packed
like B, (N, ceil(blocks * bits / 8)) bytes, or of the scales' dtype) default to 2^(bits-1).

- Along N (new output features: the LM head's vocabulary, an FFN's up/gate units): each new
  row is whole blocks of q == zp with scale 0, so it dequantizes to exactly 0 whatever the
  kernel's accuracy level (its int8 path multiplies (q - zp) by the block's scale too).
- Along K (new input features: an FFN's down projection): the new entries must dequantize to
  exactly 0. Entries past K in the last, partly used block were never read before; they are
  set to their block's zero point, and whole new blocks are appended as q == zp with scale 0.
  Anything the formula above does not describe (a g_idx: act-order reordering of K) is refused,
  naming the node.
- Float zero points that are not integers (HQQ's: ONNX Runtime's quantizer with
  HQQWeightOnlyQuantConfig) leave no stored value that dequantizes to exactly 0. New rows and
  whole new blocks still do (scale 0, whatever q). The entries past K in the old last block
  get the q nearest their zero point and dequantize to a little more or less than 0; they
  are read only against the new input features, which FFN padding makes exactly 0 (zero
  up/gate units: act(0) * 0), so the product is still exact (`widen_in(exact_zero=False)`).
  The gate runs it, as every rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.rewrite.common import const_array, new_initializer, refuse_smaller, set_gemm_sizes

OP = "MatMulNBits"
_B, _SCALES, _ZP, _G_IDX, _BIAS = 1, 2, 3, 4, 5


def is_nbits(node: ir.Node) -> bool:
    return node.op_type == OP and node.domain == "com.microsoft"


@dataclass(frozen=True)
class NBits:
    """One MatMulNBits node's weight, unpacked to one integer per element: q (N, blocks, bs),
    scales (N, blocks), zero points (N, blocks) as integers or floats."""

    node: ir.Node
    k: int
    n: int
    bits: int
    block: int
    q: np.ndarray
    scales: np.ndarray
    zero: np.ndarray
    zero_packed: bool  # the zero points were stored as packed uint8 (else the scales' dtype)
    zero_given: bool  # the node had a zero-point input (else the default 2^(bits-1))

    @property
    def blocks(self) -> int:
        return self.q.shape[1]


def _attr(node: ir.Node, name: str, default: int | None = None) -> int:
    a = node.attributes.get(name)
    if a is None:
        if default is None:
            raise RewriteRefused(f"node {node.name!r}: MatMulNBits without its {name} attribute")
        return default
    return int(a.value)


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """(rows, bytes) uint8 -> (rows, count) integers, low bits first."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    vals = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)  # (rows, bytes, per)
    return vals.reshape(packed.shape[0], -1)[:, :count]


def _pack(values: np.ndarray, bits: int, nbytes: int) -> np.ndarray:
    """(rows, count) integers -> (rows, nbytes) uint8, low bits first (zero-filled tail)."""
    per = 8 // bits
    rows = values.shape[0]
    full = np.zeros((rows, nbytes * per), np.uint8)
    full[:, :values.shape[1]] = values
    shifts = (np.arange(per, dtype=np.uint8) * bits)
    return np.bitwise_or.reduce(full.reshape(rows, nbytes, per) << shifts, axis=-1).astype(np.uint8)


def _input(node: ir.Node, i: int) -> ir.Value | None:
    return node.inputs[i] if len(node.inputs) > i else None


def read(node: ir.Node) -> NBits:
    """The node's weight, unpacked; RewriteRefused for what this module cannot pad exactly."""
    k, n = _attr(node, "K"), _attr(node, "N")
    bits, block = _attr(node, "bits", 4), _attr(node, "block_size")
    if bits not in (2, 4, 8):
        raise RewriteRefused(f"node {node.name!r}: MatMulNBits with {bits} bits per weight")
    if _input(node, _G_IDX) is not None:
        raise RewriteRefused(f"node {node.name!r}: MatMulNBits with a g_idx (act-order): the "
                             "padded K entries would not stay in their blocks")
    packed, scales = const_array(_input(node, _B)), const_array(_input(node, _SCALES))
    if packed is None or scales is None:
        raise RewriteRefused(f"node {node.name!r}: MatMulNBits weight or scales not constant")
    blocks = -(-k // block)
    if packed.shape[:2] != (n, blocks) or scales.size != n * blocks:
        raise RewriteRefused(f"node {node.name!r}: MatMulNBits weight {packed.shape} / scales "
                             f"{scales.shape} do not match K={k}, N={n}, block {block}")
    q = _unpack(packed.reshape(n * blocks, -1), bits, block).reshape(n, blocks, block)
    zp_value = _input(node, _ZP)
    zp = const_array(zp_value) if zp_value is not None else None
    if zp_value is not None and zp is None:
        raise RewriteRefused(f"node {node.name!r}: MatMulNBits zero points not constant")
    if zp is None:
        zero, zero_packed = np.full((n, blocks), 1 << (bits - 1), np.uint8), True
    elif zp.dtype == np.uint8:
        zero = _unpack(zp.reshape(n, -1), bits, blocks)
        zero_packed = True
    else:
        zero, zero_packed = zp.reshape(n, blocks), False
    return NBits(node, k, n, bits, block, q, scales.reshape(n, blocks), zero, zero_packed,
                 zp is not None)


def _zero_q(w: NBits, zero: np.ndarray, exact: bool = True) -> np.ndarray:
    """q values that dequantize to 0 for blocks with zero point `zero` (N, blocks); `exact`
    False: the nearest ones where float zero points are not integers (for entries whose
    block's scale is 0, or that multiply exact zeros)."""
    if w.zero_packed:
        return zero.astype(np.uint8)
    if exact and not np.all(zero == np.round(zero)):
        raise RewriteRefused(f"node {w.node.name!r}: float zero points that are not integers: "
                             "no stored value dequantizes to exactly 0")
    return np.clip(np.round(zero), 0, (1 << w.bits) - 1).astype(np.uint8)


def _write(graph: ir.Graph, w: NBits, q: np.ndarray, scales: np.ndarray, zero: np.ndarray,
           k: int, n: int, tag: str) -> None:
    node, blocks = w.node, q.shape[1]
    blob = w.block * w.bits // 8
    packed = _pack(q.reshape(n * blocks, w.block), w.bits, blob).reshape(n, blocks, blob)
    node.replace_input_with(_B, new_initializer(graph, f"{node.name}.{tag}.q", packed))
    old_scales = const_array(_input(node, _SCALES))
    shape = (n, blocks) if old_scales.ndim == 2 else (n * blocks,)
    node.replace_input_with(_SCALES, new_initializer(
        graph, f"{node.name}.{tag}.scales", scales.astype(old_scales.dtype).reshape(shape)))
    if w.zero_given:
        old = const_array(_input(node, _ZP))
        if w.zero_packed:
            nbytes = -(-blocks * w.bits // 8)
            arr = _pack(zero, w.bits, nbytes)
            arr = arr.reshape(-1) if old.ndim == 1 else arr
        else:
            arr = zero.astype(old.dtype).reshape((n, blocks) if old.ndim == 2 else (n * blocks,))
        node.replace_input_with(_ZP, new_initializer(graph, f"{node.name}.{tag}.zp", arr))
    set_gemm_sizes(node, k, n)


def widen_out(graph: ir.Graph, node: ir.Node, new_n: int, tag: str,
              rows: np.ndarray | None = None) -> int:
    """N -> new_n output features; `rows` says where each old feature goes (default: first).
    Returns the old N."""
    w = read(node)
    refuse_smaller(node, "N", w.n, new_n)
    rows = np.arange(w.n) if rows is None else np.asarray(rows)
    default_zero = np.full((new_n, w.blocks), 1 << (w.bits - 1), w.zero.dtype)
    zero = default_zero.copy()
    zero[rows] = w.zero
    # new rows: q == zp (the nearest q for HQQ's float zero points), and scale 0
    q = np.repeat(_zero_q(w, zero, exact=False)[:, :, None], w.block, axis=2)
    q[rows] = w.q
    scales = np.zeros((new_n, w.blocks), w.scales.dtype)
    scales[rows] = w.scales
    _write(graph, w, q, scales, zero, w.k, new_n, tag)
    bias = const_array(_input(node, _BIAS))
    if bias is not None:
        new_bias = np.zeros((new_n,), bias.dtype)
        new_bias[rows] = bias.reshape(-1)
        node.replace_input_with(_BIAS, new_initializer(graph, f"{node.name}.{tag}.bias", new_bias))
    return w.n


def widen_in(graph: ir.Graph, node: ir.Node, new_k: int, tag: str,
             exact_zero: bool = True) -> int:
    """K -> new_k input features, the new ones appended and multiplied by exact zeros.
    `exact_zero` False: the caller feeds the new features exact zeros (FFN padding), so the
    old last block's new entries may dequantize to nearly 0 (HQQ's float zero points).
    Returns the old K."""
    w = read(node)
    refuse_smaller(node, "K", w.k, new_k)
    blocks = -(-new_k // w.block)
    zero = np.concatenate([w.zero, np.full((w.n, blocks - w.blocks), 1 << (w.bits - 1),
                                           w.zero.dtype)], axis=1)
    zq = _zero_q(w, zero, exact_zero and w.k % w.block != 0)  # (N, blocks')
    q = np.repeat(zq[:, :, None], w.block, axis=2)  # (N, blocks', bs)
    flat = q.reshape(w.n, -1)
    flat[:, :w.k] = w.q.reshape(w.n, -1)[:, :w.k]  # old entries; the old block's tail -> zp
    scales = np.concatenate([w.scales, np.zeros((w.n, blocks - w.blocks), w.scales.dtype)], 1)
    _write(graph, w, flat.reshape(w.n, blocks, w.block), scales, zero, new_k, w.n, tag)
    return w.k
