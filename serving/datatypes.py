"""KServe v2 datatype names <-> numpy dtypes (no grpc: the engine uses these too)."""

from __future__ import annotations

import numpy as np

from serving.errors import InvalidArgument
from tuner.graph.dtypes import DTYPES, np_dtype

# Little-endian, as the protocol's raw bytes are; BF16 is ml_dtypes' (raw contents only, as
# Triton's); from the one table of dtype names (tuner.graph.dtypes).
DATATYPES: dict[str, np.dtype] = {
    k: np.dtype(object) if k == "BYTES" else np_dtype(n).newbyteorder("<")
    for _, n, k in DTYPES}
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
