"""The float model of a half-precision graph: the same graph computing in float32, the gate's
own copy (tuner.gate.float_reference holds variants of an fp16 or bf16 original to it), not
a variant to serve. Here, not in rewrite/: nothing is written beside the user's files.

Every half-precision tensor becomes float32 and every op that makes one is told to make
float32 instead; the values are the stored ones (fp16 and bf16 widen to float32 exactly), so
the copy computes what the weights compute, without the half-precision rounding between
ops:

    initializer (fp16)          -> the same numbers in float32
    Cast(to=FLOAT16)            -> Cast(to=FLOAT)           (a keep_io_types boundary too)
    Constant / ConstantOfShape  -> their half value in float32
    any dtype attribute (EyeLike, RandomNormal, ...) of a half type -> FLOAT
    inputs, outputs, values typed half -> typed FLOAT (subgraphs too: an If's branches)

    model = upcast(load_model(path))    # a new graph; `path`'s model untouched
    runner = float_runner(model)        # on ONNX Runtime's CPU provider, half feeds widened
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx_ir as ir

from tuner.runtime.base import SessionSettings
from tuner.runtime.ort import OrtRunner, load_cpu

HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
# attributes that name the type an op makes
_TYPE_ATTRIBUTES = ("to", "dtype", "output_dtype")
# attributes that hold a tensor an op makes (Constant, ConstantOfShape)
_TENSOR_ATTRIBUTES = ("value",)


def is_half(array: np.ndarray) -> bool:
    return array.dtype.name in ("float16", "bfloat16")


def as_float32(array: np.ndarray) -> np.ndarray:
    """`array` in float32 when it is half precision, else itself."""
    return array.astype(np.float32) if is_half(array) else array


def upcast(model: ir.Model) -> ir.Model:
    """A float32 copy of `model` (see the module's docstring); `model` is left as it was."""
    copy = model.clone()  # tensors shared, not copied: those widened are replaced
    graphs = [copy.graph, *(g for n in ir.traversal.RecursiveGraphIterator(copy.graph)
                            for a in n.attributes.values()
                            for g in _subgraphs(a))]
    for graph in graphs:
        for value in graph.initializers.values():
            if value.const_value is not None and value.dtype in HALF:
                value.const_value = ir.tensor(value.const_value.numpy().astype(np.float32),
                                              name=value.name)
        for value in (*graph.inputs, *graph.outputs, *graph.initializers.values()):
            _widen_type(value)
        for node in graph:
            _widen_node(node)
    return copy


def _subgraphs(attr: ir.Attr) -> list[ir.Graph]:
    if attr.type == ir.AttributeType.GRAPH:
        return [attr.value]
    if attr.type == ir.AttributeType.GRAPHS:
        return list(attr.value)
    return []


def _widen_type(value: ir.Value) -> None:
    if value.dtype in HALF:
        # a new type: a clone's values share their type objects with the original's
        value.type = ir.TensorType(ir.DataType.FLOAT)


def _widen_node(node: ir.Node) -> None:
    for name in _TYPE_ATTRIBUTES:
        attr = node.attributes.get(name)
        if attr is not None and attr.type == ir.AttributeType.INT and attr.value in HALF:
            node.attributes[name] = ir.AttrInt64(name, ir.DataType.FLOAT)
    for name in _TENSOR_ATTRIBUTES:
        attr = node.attributes.get(name)
        if attr is not None and attr.type == ir.AttributeType.TENSOR and attr.value.dtype in HALF:
            node.attributes[name] = ir.AttrTensor(
                name, ir.tensor(attr.value.numpy().astype(np.float32)))
    for out in node.outputs:
        _widen_type(out)


class FloatRunner:
    """An OrtRunner of a float copy, fed what its half-precision original is fed: half
    arrays (a cache's pasts, a float input) are widened to float32 first."""

    name = "float32 copy"

    def __init__(self, runner: OrtRunner) -> None:
        self.runner = runner

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.runner.infer({k: as_float32(np.asarray(v)) for k, v in feeds.items()})

    def close(self) -> None:
        self.runner.close()


def float_runner(model: ir.Model, settings: SessionSettings = SessionSettings()) -> FloatRunner:
    """`model` (a float copy) on ONNX Runtime's CPU provider. Written to a private folder
    with its weights beside it (a float copy of a 1 GB half model is over protobuf's 2 GB),
    which goes once the session has read it."""
    with tempfile.TemporaryDirectory(prefix="shapetuner-float-") as folder:
        path = Path(folder) / "float32.onnx"
        ir.save(model, path, external_data="float32.onnx.data")
        return FloatRunner(OrtRunner(load_cpu(path, settings)))
