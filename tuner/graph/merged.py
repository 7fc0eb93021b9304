"""Optimum's legacy merged decoder (`decoder_model_merged.onnx`, still on many hub
repositories): the decoder without and with its KV cache, merged into one If node on a
boolean input `use_cache_branch` (then_branch: with the cache; else_branch: without), the
weights shared from the outer graph. Every stage reads the layers from the top-level graph,
so such a file is first made plain by `tuner unmerge` (tuner.rewrite.unmerge)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

FLAG = "use_cache_branch"  # the merged file's input that picks the branch
# ops that carry the layers
WEIGHTED = ("MatMul", "Gemm", "MatMulNBits", "MatMulBnb4", "MatMulInteger")
CONTROL_FLOW = ("If", "Loop", "Scan")


def holds_layers(node: ir.Node) -> bool:
    """Whether a node's subgraphs hold the model's matrix products."""
    graphs = [a.as_graph() for a in node.attributes.values() if a.type == ir.AttributeType.GRAPH]
    return any(n.op_type in WEIGHTED for g in graphs for n in g)


def layers_inside(model: ir.Model) -> ir.Node | None:
    """The first top-level control-flow node that holds layers, or None."""
    return next((n for n in model.graph if n.op_type in CONTROL_FLOW and holds_layers(n)), None)


def merged_if(model: ir.Model) -> ir.Node | None:
    """The If on the graph input `use_cache_branch` that holds the layers, or None."""
    flag = next((v for v in model.graph.inputs if v.name == FLAG), None)
    return next((n for n in model.graph if flag is not None and n.op_type == "If"
                 and n.inputs[0] is flag and holds_layers(n)), None)


def with_cache(model: ir.Model) -> np.ndarray:
    """The `use_cache_branch` value that picks the with-cache branch: True, in the input's
    shape ([1] where it is not fixed, as Optimum declares it)."""
    flag = next(v for v in model.graph.inputs if v.name == FLAG)
    shape = flag.shape.numpy() if flag.shape is not None and flag.shape.is_static() else (1,)
    return np.ones(shape, np.bool_)
