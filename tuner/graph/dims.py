"""Tensor shapes for inspect: what the exporter annotated, completed by ONNX Runtime's
symbolic shape inference when that leaves a dim unknown.

Dynamo exports carry symbolic shapes on every value. TorchScript exports carry almost none,
and `onnx.shape_inference` cannot see through their Shape -> Gather -> Concat -> Reshape
plumbing; ORT's `SymbolicShapeInference` can (STYLE.md). It runs on a *light* copy of the
graph: every weight larger than a few elements becomes a graph input with its type and shape,
so nothing of a 2 GB model is read or copied.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import onnx
import onnx_ir as ir
from onnx import helper

Dim = int | str | None

_KEEP_DATA = 64  # initializers up to this many elements keep their values (shape constants)
log = logging.getLogger(__name__)


def _light_proto(model: ir.Model) -> onnx.ModelProto:
    g = model.graph
    graph = onnx.GraphProto(name=g.name or "main")
    graph.node.extend(ir.serde.serialize_node(n) for n in g)
    graph.input.extend(ir.serde.serialize_value(v) for v in g.inputs)
    graph.output.extend(ir.serde.serialize_value(v) for v in g.outputs)
    input_names = {v.name for v in g.inputs}
    for name, v in g.initializers.items():
        t = v.const_value
        if t is None or name in input_names:
            continue
        ints = t.dtype in (ir.DataType.INT64, ir.DataType.INT32)
        if t.size <= _KEEP_DATA or (ints and t.size <= 4096):
            graph.initializer.append(ir.serde.serialize_tensor(t))
            graph.initializer[-1].name = name
        else:
            graph.input.append(helper.make_tensor_value_info(
                name, int(t.dtype), [int(d) for d in t.shape]))
    proto = helper.make_model(graph, opset_imports=[
        helper.make_opsetid(domain, version) for domain, version in model.opset_imports.items()])
    proto.ir_version = model.ir_version
    proto.functions.extend(ir.serde.serialize_function(f) for f in model.functions.values())
    return proto


@functools.lru_cache(maxsize=1)
def _symbolic_shape_inference():
    """ORT's SymbolicShapeInference, loaded from its own file: imported through
    `onnxruntime.tools`, that package's __init__ imports torch wherever torch is installed
    (1.4 s of every `tuner inspect` / `pad` / `verify` on a machine that exports with it);
    the module itself needs only onnx and numpy."""
    import onnxruntime

    path = Path(onnxruntime.__file__).parent / "tools" / "symbolic_shape_infer.py"
    spec = importlib.util.spec_from_file_location("_ort_symbolic_shape_infer", path)
    if spec is None or not path.is_file():  # moved in some release: the package's way
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

        return SymbolicShapeInference
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # its warnings ("Cannot determine if 256 - past_sequence_length + ... < 0", GLM) are
    # about dims it leaves unknown, which the callers handle: not the user's concern
    logging.getLogger(module.__name__).setLevel(logging.ERROR)
    return module.SymbolicShapeInference


def infer_symbolic(model: ir.Model) -> Mapping[str, tuple[Dim, ...]]:
    """value name -> dims, from ORT's symbolic shape inference, or from onnx's own (with data
    propagation) where ORT's stops: it asserts on an Expand whose shape it cannot compute
    (Optimum's Cohere and Helium exports), and onnx's still gives every value its rank.
    {} when both fail. Read-only: one answer per graph in the process (`_inferred_from`)."""
    return _inferred_from(_light_proto(model).SerializeToString())


# One command asks for the same graph's shapes several times (optimize: the audit, the LM
# head cut, the gate's vocabulary; pad: the command and the job), each from a model object of
# its own; the inference is most of an inspect (0.1-0.25 s for two layers, seconds for a deep
# model). Keyed by the light graph's bytes (no weights: a few MB at most), so a graph that was
# edited is a new key and its shapes are inferred afresh.
@functools.lru_cache(maxsize=8)
def _inferred_from(light_bytes: bytes) -> Mapping[str, tuple[Dim, ...]]:
    light = onnx.ModelProto.FromString(light_bytes)
    return MappingProxyType(_infer(light))


def _infer(light: onnx.ModelProto) -> dict[str, tuple[Dim, ...]]:
    try:
        out = _symbolic_shape_inference().infer_shapes(light, auto_merge=True,
                                                       guess_output_rank=True)
    except Exception as e:  # noqa: BLE001 - inference is a helper: fall back to onnx's
        log.debug("symbolic shape inference failed: %s", e)
        out = None
    if out is None:
        try:
            out = onnx.shape_inference.infer_shapes(light, data_prop=True)
        except Exception as e:  # noqa: BLE001 - fall back to annotations
            log.debug("onnx shape inference failed: %s", e)
            return {}
    shapes: dict[str, tuple[Dim, ...]] = {}
    for vi in list(out.graph.value_info) + list(out.graph.output):
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            continue
        shapes[vi.name] = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
    return shapes


# onnx's shape inference names each dim it could not infer `unk__N`, and tools that ran it
# before saving (onnxruntime.transformers.float16's conversion: transformers.js' fp16 and
# q4f16 copies) leave those names on every value: they say nothing, where inference here can
# (a head's 80 read as a symbol refused every head-dim padding of such a graph).
_UNKNOWN = "unk__"


def _annotated(v: ir.Value) -> tuple[Dim, ...] | None:
    if v.shape is None:
        return None
    out: list[Dim] = []
    for d in v.shape:
        if isinstance(d, int):
            out.append(d)
        else:
            name = d.value
            out.append(name if isinstance(name, str) and not name.startswith(_UNKNOWN) else None)
    return tuple(out)


class Dims:
    """Shape lookup with the symbolic inference run lazily, once, only when needed."""

    def __init__(self, model: ir.Model) -> None:
        self._model = model
        self._inferred: Mapping[str, tuple[Dim, ...]] | None = None

    def inferred(self) -> Mapping[str, tuple[Dim, ...]]:
        if self._inferred is None:
            self._inferred = infer_symbolic(self._model)
        return self._inferred

    def shape(self, v: ir.Value | None) -> tuple[Dim, ...] | None:
        if v is None:
            return None
        own = _annotated(v)
        if own is not None and all(isinstance(d, int) or isinstance(d, str) for d in own):
            return own
        other = self.inferred().get(v.name or "")
        if own is None:
            return other
        if other is None or len(other) != len(own):
            return own
        return tuple(a if a is not None and not (isinstance(a, str) and isinstance(b, int))
                     else b for a, b in zip(own, other))

    def static(self, v: ir.Value | None, axis: int) -> int | None:
        """One dim of `v` as an int, or None when it is symbolic or unknown."""
        s = self.shape(v)
        if s is None or not -len(s) <= axis < len(s):
            return None
        d = s[axis]
        return d if isinstance(d, int) and d > 0 else None
