"""Constant tables that a graph input indexes: the token embedding a Gather looks ids up in
(a plain table, a Transpose or Reshape of one, or ONNX Runtime's GatherBlockQuantized on
4-bit blocks), and position tables repeated over the batch. tuner.graph.roles reads the
inputs' roles from them, tuner.graph.io the embedding's rows.
"""

from __future__ import annotations

import onnx_ir as ir

from tuner.graph.walk import MS, const_tensor, op

# Ops a token id passes through unchanged on its way to the embedding Gather.
PASS_THROUGH = {"Reshape", "Cast", "Identity", "Flatten", "Squeeze", "Unsqueeze", "Expand"}


def const_table(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of a constant (an initializer or a Constant node's, or a Transpose or a
    Reshape of one: onnxruntime-genai's tied embedding is the LM head's weight transposed,
    or, quantized, reshaped), None when `value` is computed."""
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "Transpose" and const_tensor(node.inputs[0]):
        shape = tuple(int(d) for d in const_tensor(node.inputs[0]).shape)
        perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else None
        return tuple(shape[i] for i in (perm or range(len(shape) - 1, -1, -1)))
    if node is not None and node.op_type == "Reshape" and const_tensor(node.inputs[0]):
        # its quantized tied embedding: the LM head's packed weight reshaped to (vocab, bytes)
        target = const_tensor(node.inputs[1])
        dims = [int(d) for d in target.numpy().reshape(-1)] if target is not None else []
        return tuple(dims) if dims and all(d > 0 for d in dims) else None
    tensor = const_tensor(value)
    return None if tensor is None else tuple(int(d) for d in tensor.shape)


def gathered_table(node: ir.Node, index: int) -> tuple[int, ...] | None:
    """(rows, width) of the constant table that `node` looks its input `index` up in: a
    Gather's data, or ONNX Runtime's GatherBlockQuantized (an embedding its quantizer
    stored in blocks: rows along `gather_axis`, the width packed); None otherwise."""
    if index != 1 or op(node) not in ("Gather", f"{MS}.GatherBlockQuantized"):
        return None
    shape = const_table(node.inputs[0])
    if shape is None or node.op_type == "Gather" or len(shape) != 2:
        return shape
    axis = node.attributes["gather_axis"].as_int() if "gather_axis" in node.attributes else 0
    return (shape[axis], shape[1 - axis])


def embedding_tables(value: ir.Value) -> list[tuple[str, tuple[int, ...]]]:
    """The 2-D constant tables that `value` indexes through a Gather (following pass-through
    ops): (table name, table shape)."""
    frontier, seen, found = [value], set(), []
    while frontier:
        v = frontier.pop()
        if v in seen:
            continue
        seen.add(v)
        for node, index in v.uses():
            shape = gathered_table(node, index)
            if shape is not None:
                if len(shape) == 2:
                    found.append((node.inputs[0].name or "", shape))
            elif node.op_type in PASS_THROUGH and index == 0:
                frontier.extend(node.outputs)
    return found


def tiled_table(value: ir.Value | None) -> bool:
    """Whether `value` is a constant table, or one repeated over the batch (GPT-J's
    `embed_positions.repeat(batch, 1, 1)`: Unsqueeze/Expand/Tile of an initializer)."""
    for _ in range(8):
        if value is None:
            return False
        if const_tensor(value) is not None:
            return True
        node = value.producer()
        if node is None or node.op_type not in PASS_THROUGH | {"Tile"}:
            return False
        value = node.inputs[0]
    return False
