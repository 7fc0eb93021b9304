"""An image transformer's pixel input (ViT, DeiT, CLIP's and SigLIP's vision towers, the
encoder of an image captioner): `pixel_values` (batch, channels, height, width), cut into
patches by a Conv whose kernel and stride are the patch size.

Optimum declares every axis symbolic, yet the graph takes one size only: its position table
has a row per patch (SigLIP: 16 rows for a 4 x 4 grid) or one more for the class token (ViT,
CLIP: 17). The channels are the Conv weight's, the size is the grid's side times the
stride: what the gate and the benchmark must feed.

    pixels = pixel_input(graph)     # PixelInput("pixel_values", 3, 32, 32) or None
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from tuner.graph.walk import const_shape, op

_PASS_THROUGH = ("Cast", "Identity")


@dataclass(frozen=True)
class PixelInput:
    name: str
    channels: int
    height: int
    width: int


def _patch_conv(v: ir.Value) -> ir.Node | None:
    """The Conv that reads `v` (through casts), with a constant 4-D weight."""
    for node, index in v.uses():
        if op(node) in _PASS_THROUGH:
            found = _patch_conv(node.outputs[0])
            if found is not None:
                return found
        elif op(node) == "Conv" and index == 0:
            shape = const_shape(node.inputs[1]) if len(node.inputs) > 1 else None
            if shape is not None and len(shape) == 4:
                return node
    return None


def _position_table(value: ir.Value, width: int) -> bool:
    """A learned position table of `width`: (1, rows, width) added to the patches (ViT), or
    (rows, width) gathered by the positions (CLIP, SigLIP); not a (width, width) weight."""
    shape = const_shape(value)
    if shape is None or shape[-1] != width:
        return False
    uses = {(op(node), index) for node, index in value.uses()}
    if len(shape) == 3 and shape[0] == 1:
        return any(kind == "Add" for kind, _ in uses)
    return len(shape) == 2 and ("Gather", 0) in uses


def _grid(graph: ir.Graph, width: int) -> int | None:
    """The side of the patch grid: from the largest position table whose rows are a square,
    or a square and one (a class token)."""
    sides = []
    for value in graph.initializers.values():
        if not _position_table(value, width):
            continue
        rows = const_shape(value)[-2]
        for patches in (rows, rows - 1):
            side = math.isqrt(max(patches, 0))
            if side >= 2 and side * side == patches:
                sides.append(side)
                break
    return max(sides, default=None)


def pixel_input(graph: ir.Graph) -> PixelInput | None:
    """The graph's pixel input and the one size it takes, None when it has none (or its
    grid cannot be read)."""
    initializers = set(graph.initializers)
    for v in graph.inputs:
        if v.name in initializers or v.shape is None or len(v.shape) != 4:
            continue
        conv = _patch_conv(v)
        if conv is None:
            continue
        hidden, channels, _, _ = const_shape(conv.inputs[1])
        strides = conv.attributes.get("strides")
        stride = strides.value if strides is not None else [1, 1]
        side = _grid(graph, hidden)
        if side is None:
            return None
        return PixelInput(v.name, channels, side * stride[0], side * stride[1])
    return None
