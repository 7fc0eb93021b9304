"""Optimum's legacy merged decoder (tuner.graph.merged) as one plain graph. The with-cache
branch alone is the whole model (a past of length 0 is the first step), so the merged file
is that branch inlined: the flag becomes the constant True and onnxscript's constant folder
inlines the chosen branch (its If rule). Nothing numeric is evaluated (should_fold is False for every node); the folder's
shape-level rules may simplify, exactly. tuner.jobs.unmerge gates the result against the
merged file fed use_cache_branch = True.

    node = merged_if(model)          # the If on use_cache_branch, or None
    unmerge(model)                   # in place: no flag input, no If
    branch(model, with_cache=False)  # an encoder-decoder's: either branch, pruned
"""

from __future__ import annotations

import onnx_ir as ir
import numpy as np
from onnxscript.optimizer import fold_constants, remove_unused_nodes

from tuner.errors import BadInput
from tuner.graph.merged import FLAG, layers_inside, merged_if, with_cache


def unmerge(model: ir.Model) -> ir.Model:
    """The with-cache branch inlined in place of the If; the flag input gone. BadInput when
    `model` is not a merged decoder."""
    return _inline(model, with_cache(model))


def branch(model: ir.Model, with_cache_branch: bool) -> ir.Model:
    """An encoder-decoder's merged decoder as one of its two plain graphs, in place: False,
    the first step (it computes the cross keys and values from the encoder's states); True,
    the later steps (they take them as a cache). What the branch does not use is pruned: the
    inputs only the other branch reads, and the outputs it only fills with constants
    (Optimum's merge gives the with-cache branch placeholder cross presents)."""
    flag = with_cache(model)
    _inline(model, flag if with_cache_branch else np.zeros_like(flag))
    for out in list(model.graph.outputs):
        producer = out.producer()
        if out.const_value is not None or (producer is not None and producer.op_type == "Constant"):
            model.graph.outputs.remove(out)
    remove_unused_nodes(model)
    # (a value's uses still list the dropped branch's nodes: only the graph's own count)
    for value in [v for v in model.graph.inputs
                  if not any(node.graph is model.graph for node, _ in v.uses())]:
        model.graph.inputs.remove(value)
    return model


def _inline(model: ir.Model, value: np.ndarray) -> ir.Model:
    if merged_if(model) is None:
        raise BadInput(f"not a merged decoder: no If on an input '{FLAG}' holding the layers")
    flag = next(v for v in model.graph.inputs if v.name == FLAG)
    flag.const_value = ir.tensor(value, name=FLAG)
    model.graph.inputs.remove(flag)
    model.graph.register_initializer(flag)
    fold_constants(model, should_fold=lambda node: False)
    if flag.uses():
        raise BadInput(f"'{FLAG}' is still read after its If was inlined: not Optimum's merge")
    model.graph.initializers.pop(FLAG, None)  # (the folder may have dropped it already)
    left = layers_inside(model)
    if left is not None:
        raise BadInput(f"{left.op_type} {left.name!r} still holds layers after the merge was "
                       "undone")
    return model
