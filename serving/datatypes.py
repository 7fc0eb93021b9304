"""KServe v2 datatype names <-> numpy dtypes (no grpc: the engine uses these too)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from serving.errors import InvalidArgument

# Little-endian, as the protocol's raw bytes are.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("bool"),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),  # raw contents only, as Triton's (ml_dtypes there too)
    "BYTES": np.dtype(object),
}
_BY_NUMPY = {dt: name for name, dt in DATATYPES.items() if name != "BYTES"}


def datatype_of(dtype: np.dtype) -> str:
    """The KServe datatype name of a numpy dtype (object and string arrays are BYTES)."""
    dtype = np.dtype(dtype)
    if dtype == np.dtype(object) or dtype.kind in "SU":
        return "BYTES"
    try:
        return _BY_NUMPY[dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype]
    except KeyError:
        raise InvalidArgument(f"data type {dtype} has no KServe v2 datatype") from None


def triton_type(datatype: str) -> str:
    """Triton's model-config enum name for a KServe datatype (BYTES is TYPE_STRING)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
