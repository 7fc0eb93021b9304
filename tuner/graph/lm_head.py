"""The token embedding and the LM head, found by structure.

- Token embedding: a Gather from a 2-D constant whose indices come from a graph input (not
  through a Shape or Range: those are position or token-type tables).
- LM head: the last linear layer whose output reaches a graph output through shape-only ops
  (or a bias / softcap), that is not part of a transformer block.
- Tied: the head reads the embedding's own initializer (dynamo: through a Transpose), or a
  copy with equal bytes (TorchScript folds the transpose into a duplicate initializer).
- Cut: the graph takes `logits_to_keep` (tuner.rewrite.logits_to_keep), the head run on the
  last positions only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tuner.graph.ffn import NONLINEAR
from tuner.graph.walk import Linear, const_shape, const_tensor, consumers, op, source, walk_back

_INDEX_PATH = {"Reshape": (0,), "Cast": (0,), "Unsqueeze": (0,), "Squeeze": (0,), "Flatten": (0,),
               "Identity": (0,), "Expand": (0,)}
# Ops allowed between the head's GEMM and the graph output: shape plumbing, bias, logit softcap.
_TO_OUTPUT = {"Reshape", "Cast", "Identity", "Slice", "Squeeze", "Unsqueeze", "Transpose",
              "QuantizeLinear", "DequantizeLinear",
              "Add", "Mul", "Div", "Tanh"}


KEEP = "logits_to_keep"  # Hugging Face's name (transformers' forward(logits_to_keep=...))


def keep_input(graph: ir.Graph) -> str | None:
    """The name of the graph's `logits_to_keep` input (an int64 scalar, with a default), or
    None: the server and the gate feed it only where the graph has it."""
    for v in graph.inputs:
        if v.name == KEEP and v.dtype == ir.DataType.INT64 and v.const_value is not None:
            return v.name
    return None


@dataclass(frozen=True)
class Embedding:
    gather: ir.Node
    weight: ir.Value  # (vocab, hidden)

    @property
    def vocab(self) -> int:
        return const_shape(self.weight)[0]  # type: ignore[index]

    @property
    def hidden(self) -> int:
        return const_shape(self.weight)[1]  # type: ignore[index]


def token_embedding(graph: ir.Graph) -> Embedding | None:
    """The Gather that turns token ids into vectors (the largest one fed by a graph input)."""
    found: list[Embedding] = []
    for node in graph:
        if op(node) != "Gather" or len(node.inputs) < 2:
            continue
        axis = node.attributes.get("axis")
        if axis is not None and axis.value != 0:
            continue
        table = source(node.inputs[0])
        shape = const_shape(table)
        if shape is None or len(shape) != 2:
            continue
        hits, _ = walk_back(node.inputs[1], lambda n: _INDEX_PATH.get(op(n)),
                            lambda v: v.is_graph_input())
        if hits:
            found.append(Embedding(node, table))  # type: ignore[arg-type]
    return max(found, key=lambda e: e.vocab, default=None)


def token_ids(emb: Embedding | None) -> ir.Value | None:
    """The graph input whose ids the embedding gathers (None: computed ids, or no embedding)."""
    if emb is None:
        return None
    hits, _ = walk_back(emb.gather.inputs[1], lambda n: _INDEX_PATH.get(op(n)),
                        lambda v: v.is_graph_input())
    return hits[0] if len(hits) == 1 else None


def reaches_output(v: ir.Value, limit: int = 16) -> bool:
    """True when `v` flows into a graph output through shape-only / elementwise-constant ops."""
    frontier = [v]
    for _ in range(limit):
        nxt: list[ir.Value] = []
        for value in frontier:
            if value.is_graph_output():
                return True
            for user in consumers(value):
                kind = op(user)
                if kind not in _TO_OUTPUT:
                    continue
                if kind in ("Add", "Mul", "Div"):
                    other = [i for i in user.inputs if i is not value]
                    if not all(const_tensor(i) is not None for i in other):
                        continue  # a residual or another branch: not the model's tail
                nxt.extend(user.outputs)
        frontier = nxt
        if not frontier:
            return False
    return False


def lm_head(linears: list[Linear], taken: set[int], embedding: Embedding | None,
            hidden: int | None) -> Linear | None:
    """The last linear onto the vocabulary feeding the output, outside transformer blocks."""
    for lin in reversed(linears):
        if id(lin.node) in taken or not reaches_output(lin.output):
            continue
        if hidden is not None and lin.in_dim != hidden:
            continue
        if embedding is not None and lin.out_dim != embedding.vocab and lin.out_dim <= lin.in_dim:
            continue  # a small classifier or pooler head, not a vocabulary projection
        return lin
    return None


def is_masked_lm_head(head: Linear, linears: list[Linear], taken: set[int]) -> bool:
    """Whether the vocabulary projection is a masked LM's (BERT's and its kin's: RoBERTa,
    DeBERTa, DistilBERT, ALBERT, ELECTRA, MPNet, ModernBERT): it reads a transform of its own,
    a linear outside the blocks then an activation (then a norm), where a decoder's reads the
    last block's output through a norm alone. A bidirectional model generates nothing, so
    this is what tells an encoder with an LM head from a decoder."""
    ends = {id(v): lin for lin in linears for v in (lin.output, lin.node.outputs[0])}
    hits, walked = walk_back(head.node.inputs[0], lambda n: range(len(n.inputs)),
                             lambda v: id(v) in ends, limit=64)
    own = [ends[id(v)] for v in hits if id(ends[id(v)].node) not in taken]
    return any(lin.out_dim == head.in_dim for lin in own) and \
        any(op(n) in NONLINEAR for n in walked)


def is_tied(head: Linear, embedding: Embedding | None, compare_bytes: bool = True) -> bool:
    """Same storage, or (TorchScript) a duplicate whose bytes equal the embedding's."""
    if embedding is None:
        return False
    if head.weight is embedding.weight:
        return True
    if not compare_bytes:
        return False
    hw, ew = const_tensor(head.weight), const_tensor(embedding.weight)
    if hw is None or ew is None:
        return False
    hshape, eshape = tuple(hw.shape), tuple(ew.shape)
    # The stored head is (vocab, hidden) when transposed, else (hidden, vocab).
    if (hshape if head.transposed else hshape[::-1]) != eshape:
        return False
    h, e = np.asarray(hw.numpy()), np.asarray(ew.numpy())
    if not head.transposed:
        h = h.T
    if h.dtype != e.dtype:
        return False
    # Row blocks (a few rows first): untied heads differ at once, and a big table is compared
    # without a full-size temporary.
    step = 4
    start = 0
    while start < e.shape[0]:
        if not np.array_equal(h[start:start + step], e[start:start + step]):
            return False
        start += step
        step = 4096
    return True
