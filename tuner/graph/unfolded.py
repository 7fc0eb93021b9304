"""torch's dynamo export without its optimizer (`torch.onnx.export(..., optimize=False)`, what
a user turns to when the optimizer is slow or fails on a big model), made to read like the
optimized one as it loads: its constant shape arithmetic folded to constants by onnxscript's
constant folder, which also turns its SplitToSequence -> SequenceAt pairs into the Split
they stand for.

Unfolded, a rotate_half's `x[..., : d // 2]` slices at starts and ends made by
Constant -> Cast -> Reshape chains (the head-dim rewrite reads them as constants to move
them), Gemma's norms scale by `1 + weight` computed at run time, and GPT-2's qkv split is a
sequence that no walk follows: inspect found "no attention" in GPT-2, and the head-dim
rewrite refused every rotary model ("operands widened differently").

The folder runs with its defaults, what torch's own optimizer runs, except that it reads no
weight (tuner.rewrite.transposed_weights stores a big one transposed when a rewrite needs
it). Only a graph with torch's unoptimized marks is folded (a sequence op, a Cast of a
constant to a non-float): every other export is read as it was written.

    folded = fold_unfolded(model)   # True where it folded anything
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.optimizer import fold_constants, remove_unused_nodes

from tuner.graph.walk import is_const

_SEQUENCES = {"SplitToSequence", "SequenceAt"}
_SMALL = 8192  # elements: the folder's own limit on the inputs it folds


def fold_unfolded(model: ir.Model) -> bool:
    """Fold `model`'s small constant expressions (edited in place) where it bears torch's
    unoptimized marks; whether it did."""
    if not any(_unfolded(node) for node in model.graph):
        return False
    fold_constants(model, should_fold=_small)
    remove_unused_nodes(model)  # e.g. the SequenceConstruct a folded SequenceAt no longer reads
    return True


def _small(node: ir.Node) -> bool | None:
    """The folder's own rules (None), except that no weight is read to fold it (False): its
    default folds a Transpose of a weight of any size, which would load every weight of a big
    model into memory as it loads (tuner.rewrite.transposed_weights stores them transposed
    when a rewrite reads them anyway)."""
    big = any(v is not None and v.const_value is not None and v.const_value.size > _SMALL
              for v in node.inputs)
    return False if big else None


def _unfolded(node: ir.Node) -> bool:
    """What torch's optimizer would have folded, as only its unoptimized export writes it: a
    sequence op, or a Cast of a constant to a non-float (its `Constant -> Cast` shape math).
    A graph an optimizer ran (every other export here: TorchScript's folded constants,
    onnxruntime-genai's, Optimum's) has neither and is read as it was written: the folder
    also simplifies what it meets."""
    if node.op_type in _SEQUENCES:
        return True
    if node.op_type != "Cast" or not node.inputs or not is_const(node.inputs[0]):
        return False
    to = node.attributes.get("to")
    return to is not None and not ir.DataType(to.as_int()).is_floating_point()
