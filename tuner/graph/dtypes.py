"""Element types by their three names: ONNX's (TensorProto / onnx_ir.DataType), numpy's (what
tuner.graph.roles.InputSpec.dtype holds; "bfloat16" is ml_dtypes') and the KServe v2
protocol's. The one table; every map of dtype names is read from it.

ONNX Runtime names a type "tensor(" + ONNX's name in lower case + ")": tensor(float),
tensor(float16), tensor(bfloat16), tensor(int64).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

# (ONNX, numpy, KServe v2)
DTYPES: tuple[tuple[str, str, str], ...] = (
    ("FLOAT", "float32", "FP32"), ("FLOAT16", "float16", "FP16"),
    ("BFLOAT16", "bfloat16", "BF16"), ("DOUBLE", "float64", "FP64"),
    ("INT64", "int64", "INT64"), ("INT32", "int32", "INT32"), ("INT16", "int16", "INT16"),
    ("INT8", "int8", "INT8"), ("UINT64", "uint64", "UINT64"), ("UINT32", "uint32", "UINT32"),
    ("UINT16", "uint16", "UINT16"), ("UINT8", "uint8", "UINT8"), ("BOOL", "bool", "BOOL"),
    ("STRING", "object", "BYTES"),
)
NUMPY_BY_ONNX: dict[str, str] = {o: n for o, n, _ in DTYPES if o != "STRING"}
KSERVE_BY_ONNX: dict[str, str] = {o: k for o, _, k in DTYPES}
NUMPY_BY_ORT: dict[str, str] = {f"tensor({o.lower()})": n for o, n in NUMPY_BY_ONNX.items()}


def np_dtype(name: str) -> np.dtype:
    """numpy's dtype for a numpy dtype name; "bfloat16" is ml_dtypes' (numpy has none)."""
    if name == "bfloat16":
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def onnx_name(elem_type: int) -> str | None:
    """ONNX's name of an element type number (TensorProto.FLOAT is 1: "FLOAT"); None when
    the number is no element type."""
    import onnx_ir as ir

    try:
        return ir.DataType(elem_type).name
    except ValueError:
        return None
