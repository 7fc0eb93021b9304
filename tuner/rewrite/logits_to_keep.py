"""Exact on the positions kept: the LM head runs on the last k positions only.

A decoder's graph projects every position onto the vocabulary, yet generation reads one
position per row, its last. On a prompt of S tokens the head does S x hidden x vocab
multiply-adds for one row of logits that is used (GPT-2 small at S = 128: 31% of the
prompt's work; Qwen2-0.5B: 27%), and writes S x vocab floats nobody reads (a 2,048-token
chunk of Qwen2's 151,936 logits: 1.2 GB). This rule adds the input `logits_to_keep`
(Hugging Face's name and meaning: the last k positions; 0 keeps all) and slices the head's
own input on the sequence axis:

    x (B, S, h) -> Slice(x, starts=[-k'], ends=[INT64_MAX], axes=[1]) -> (B, k', h) -> head
    k' = S when k == 0, else k          (k > S keeps all: Slice clamps)

The input has a default, an initializer of the same name holding 0, so a caller that does not
feed it (ONNX Runtime, onnxruntime-genai, a plain loop) runs the graph it had. Only the head's
own input is sliced, after any quantization of it (DynamicQuantizeLinear takes its range
from the whole tensor), and every op from the head to the logits must work position by
position (a bias, a softcap, a cast, the vocab padding's slice): so the kept logits are the
same numbers, which the gate checks by running (tuner.gate.kv_gate, `kept`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from tuner.errors import RewriteRefused
from tuner.graph.dims import Dims
from tuner.graph.inspect import inspect_model
from tuner.graph.lm_head import KEEP, keep_input
from tuner.rewrite.common import const_array, find_node, new_initializer, unique_name

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div"}  # with a constant: a bias, a scale, a softcap
_UNARY = {"Tanh", "Cast", "Identity"}


def add_logits_to_keep(model: ir.Model, head_name: str | None = None) -> str:
    """Slice the input of the LM head `head_name` (default: the one inspect finds) to the
    last `logits_to_keep` positions; returns the new input's name. RewriteRefused when the
    graph already has it, has no LM head, or when the path from the head to the logits is
    not position by position on a (batch, seq, vocab) output."""
    graph = model.graph
    if keep_input(graph) is not None or KEEP in graph.initializers:
        raise RewriteRefused(f"the graph already has an input {KEEP!r}")
    head_name = head_name or inspect_model(model).sites.lm_head
    if head_name is None:
        raise RewriteRefused("no LM head found to cut")
    head = find_node(graph, head_name)
    x = head.inputs[0]
    if x is None:
        raise RewriteRefused(f"LM head {head_name!r} has no activation input")
    path = _path_to_output(head, Dims(model))
    logits = path[-1]
    if logits.shape is None or len(logits.shape) != 3:
        raise RewriteRefused(f"the logits {logits.name!r} are not (batch, seq, vocab): "
                             f"shape {logits.shape}")
    # checked: from here on the graph is edited
    keep = ir.Value(name=KEEP, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.INT64),
                    const_value=ir.tensor(np.array(0, np.int64), name=KEEP))
    graph.inputs.append(keep)
    graph.register_initializer(keep)
    nodes = _slice_nodes(graph, x, keep, head_name)
    graph.insert_before(head, nodes)
    head.replace_input_with(0, nodes[-1].outputs[0])
    kept = ir.SymbolicDim("kept_positions")
    for v in path:  # (B, S, ...) -> (B, k', ...) on every value the slice reaches
        if v.shape is not None and len(v.shape) == 3:
            v.shape = ir.Shape([v.shape[0], kept, v.shape[2]])
    return keep.name


def _slice_nodes(graph: ir.Graph, x: ir.Value, keep: ir.Value, base: str) -> list[ir.Node]:
    one = new_initializer(graph, f"{base}.keep_one", np.array([1], np.int64))
    zero = new_initializer(graph, f"{base}.keep_zero", np.array([0], np.int64))
    end = new_initializer(graph, f"{base}.keep_end", np.array([np.iinfo(np.int64).max], np.int64))

    def node(op: str, inputs: list, **attrs) -> ir.Node:
        n = ir.node(op, inputs, attributes=attrs or None,
                    name=unique_name(graph, f"{base}/keep_{op}"))
        n.outputs[0].name = unique_name(graph, f"{base}.keep_{op.lower()}")
        return n

    shape = node("Shape", [x])                                       # [B, S, h]
    seq = node("Gather", [shape.outputs[0], one], axis=0)             # [S]
    k = node("Reshape", [keep, one])                                  # [k]: a scalar or [1] fed
    everything = node("Equal", [k.outputs[0], zero])                  # k == 0: all positions
    count = node("Where", [everything.outputs[0], seq.outputs[0], k.outputs[0]])
    start = node("Neg", [count.outputs[0]])                           # [-k']
    cut = node("Slice", [x, start.outputs[0], end, one])              # (B, k', h)
    return [shape, seq, k, everything, count, start, cut]


def _path_to_output(head: ir.Node, dims: Dims) -> list[ir.Value]:
    """The values from the head's output to the graph output it reaches, each op on the way
    position by position; RewriteRefused naming the first op that is not."""
    v = head.outputs[0]
    path = [v]
    while not v.is_graph_output():
        users = [u for u, _ in v.uses()]
        if len(users) != 1:
            raise RewriteRefused(f"the LM head's output {v.name!r} has {len(users)} consumers "
                                 "before the logits")
        user = users[0]
        if not _positionwise(user, v, dims):
            raise RewriteRefused(f"{user.op_type} {user.name!r} between the LM head and the "
                                 "logits may mix positions")
        v = user.outputs[0]
        path.append(v)
    return path


def _positionwise(node: ir.Node, value: ir.Value, dims: Dims) -> bool:
    """Whether `node` computes each position from that position alone (with `value` as the
    running tensor). Its other inputs lie off the path (each path value has one consumer),
    so the cut leaves them as they were; they must only broadcast over the positions."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type in _UNARY:
        return True
    if node.op_type in _ELEMENTWISE:
        return all(_over_positions(i, dims) for i in node.inputs if i is not value)
    if node.op_type in ("QuantizeLinear", "DequantizeLinear"):  # quantize_static's QDQ
        return node.inputs[0] is value and all(_size(i, dims) == 1 for i in node.inputs[1:]
                                               if i is not None)
    if node.op_type == "Slice":
        axes = const_array(node.inputs[3]) if len(node.inputs) > 3 else None
        return axes is not None and all(int(a) in (-1, 2) for a in axes.reshape(-1))
    return False


def _dims(v: ir.Value | None, dims: Dims) -> tuple[int, ...] | None:
    """A constant's shape, else the value's static shape (annotated or inferred: None where
    any dim is unknown)."""
    arr = const_array(v)
    if arr is not None:
        return arr.shape
    shape = dims.shape(v)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)  # type: ignore[arg-type]


def _over_positions(v: ir.Value | None, dims: Dims) -> bool:
    """A bias, a scale, a softcap: at most the last axis has size > 1 (quantize_dynamic's
    run-time scale, x_scale * w_scale, is a scalar computed before the head)."""
    shape = _dims(v, dims)
    return shape is not None and all(d == 1 for d in shape[:-1])


def _size(v: ir.Value, dims: Dims) -> int | None:
    shape = _dims(v, dims)
    return None if shape is None else int(np.prod(shape, dtype=np.int64))
