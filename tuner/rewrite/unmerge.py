"""Optimum's legacy merged decoder (tuner.graph.merged) as one plain graph. The with-cache
branch alone is the whole model (a past of length 0 is the first step), so the merged file
is that branch inlined: the flag becomes the constant True and onnxscript's constant folder
inlines the chosen branch (its If rule). Nothing numeric is evaluated (should_fold is False for every node); the folder's
shape-level rules may simplify, exactly. tuner.jobs.unmerge gates the result against the
merged file fed use_cache_branch = True.

    node = merged_if(model)          # the If on use_cache_branch, or None
    unmerge(model)                   # in place: no flag input, no If
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.optimizer import fold_constants

from tuner.errors import BadInput
from tuner.graph.merged import FLAG, layers_inside, merged_if, with_cache


def unmerge(model: ir.Model) -> ir.Model:
    """The with-cache branch inlined in place of the If; the flag input gone. BadInput when
    `model` is not a merged decoder."""
    if merged_if(model) is None:
        raise BadInput(f"not a merged decoder: no If on an input '{FLAG}' holding the layers")
    flag = next(v for v in model.graph.inputs if v.name == FLAG)
    flag.const_value = ir.tensor(with_cache(model), name=FLAG)
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
