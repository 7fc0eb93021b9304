"""KServe v2 messages <-> numpy, and the one table that maps errors to gRPC status codes.

Pure functions: no server state, no model. Decoding checks only what the wire itself can
contradict (raw and typed contents together, byte sizes, unknown datatypes); what depends on
the model (names, dtypes, shapes, token ids) is checked by serving.engine.
"""

from __future__ import annotations

import math
import struct
from typing import Iterable, Mapping, Sequence

import grpc
import numpy as np

from serving.datatypes import DATATYPES, datatype_of
from serving.errors import (InvalidArgument, NotFound, ResourceExhausted, Unauthenticated,
                            Unavailable)
from serving.wire._generated import inference_pb2 as pb
from tuner.errors import BadInput

# Which InferTensorContents field carries each datatype when a client sends typed values.
_TYPED_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
    "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
    "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}

# ONE table: exception type -> status code. First match wins; anything else is INTERNAL.
STATUS_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (BadInput, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for `exc`."""
    for kind, code in STATUS_CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _shape(tensor, where: str) -> tuple[int, ...]:
    shape = tuple(int(d) for d in tensor.shape)
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{where} '{tensor.name}' has a negative dimension in shape "
                              f"{list(shape)}")
    return shape


def _decode_bytes(raw: bytes, count: int, name: str) -> np.ndarray:
    """BYTES raw format: each element is a 4-byte little-endian length, then its bytes."""
    items, off = [], 0
    while off < len(raw):
        if off + 4 > len(raw):
            raise InvalidArgument(f"input '{name}': truncated BYTES element length")
        (n,) = struct.unpack_from("<I", raw, off)
        off += 4
        if off + n > len(raw):
            raise InvalidArgument(f"input '{name}': BYTES element runs past the end of the data")
        items.append(raw[off:off + n])
        off += n
    if len(items) != count:
        raise InvalidArgument(f"input '{name}' holds {len(items)} BYTES elements, "
                              f"its shape needs {count}")
    return np.array(items, dtype=object)


def _decode_raw(tensor, raw: bytes) -> np.ndarray:
    return decode_raw(tensor.name, tensor.datatype, _shape(tensor, "input"), raw)


def decode_raw(name: str, datatype: str, shape: tuple[int, ...], raw: bytes) -> np.ndarray:
    """One tensor from its raw bytes (KServe's raw format, shared by gRPC's
    raw_input_contents and REST's binary-data extension)."""
    dtype = DATATYPES[datatype]
    count = math.prod(shape)
    if datatype == "BYTES":
        return _decode_bytes(raw, count, name).reshape(shape)
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidArgument(f"unexpected total byte size {len(raw)} for input "
                              f"'{name}', expecting {expected}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _decode_typed(tensor) -> np.ndarray:
    field = _TYPED_FIELD.get(tensor.datatype)
    if field is None:
        raise InvalidArgument(f"input '{tensor.name}' with datatype {tensor.datatype} must be "
                              "sent in raw_input_contents")
    values = getattr(tensor.contents, field)
    shape = _shape(tensor, "input")
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidArgument(f"unexpected number of elements {len(values)} for input "
                              f"'{tensor.name}', expecting {count} for shape {list(shape)}")
    dtype = DATATYPES[tensor.datatype]
    try:
        return np.array(list(values), dtype=dtype).reshape(shape)
    except OverflowError:
        raise InvalidArgument(f"input '{tensor.name}' holds values outside "
                              f"{tensor.datatype}") from None


def decode_inputs(request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
    """The request's input tensors as numpy arrays, keyed by name (read-only views of the
    message's bytes where possible). InvalidArgument on anything the wire contradicts."""
    model = request.model_name
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(f"expected {len(request.inputs)} raw input contents (one per "
                              f"input) but got {len(raw)} for model '{model}'")
    feeds: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in feeds:
            raise InvalidArgument(f"input '{tensor.name}' is given twice for model '{model}'")
        if tensor.datatype not in DATATYPES:
            raise InvalidArgument(f"input '{tensor.name}' has unknown datatype "
                                  f"'{tensor.datatype}'")
        has_typed = tensor.HasField("contents") and tensor.contents.ByteSize() > 0
        if raw:
            if has_typed:
                raise InvalidArgument(f"contents field must not be specified when using "
                                      f"raw_input_contents for '{tensor.name}' for model "
                                      f"'{model}'")
            feeds[tensor.name] = _decode_raw(tensor, raw[i])
        else:
            feeds[tensor.name] = _decode_typed(tensor)
    return feeds


def parameter_values(parameters) -> dict[str, bool | int | float | str]:
    """A request's `parameters` map as plain Python values (InferParameter's oneof)."""
    values = {}
    for name, p in parameters.items():
        kind = p.WhichOneof("parameter_choice")
        if kind is not None:
            values[name] = getattr(p, kind)
    return values


def requested_outputs(request: pb.ModelInferRequest) -> list[str]:
    """Names of the outputs the client asked for, in its order (empty: all of them)."""
    names = [o.name for o in request.outputs]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"an output is requested twice for model '{request.model_name}'")
    return names


def raw_bytes(array: np.ndarray) -> bytes:
    """An array in KServe's raw format (BYTES: 4-byte little-endian length, then bytes)."""
    if array.dtype == np.dtype(object) or array.dtype.kind in "SU":
        parts = []
        for item in array.reshape(-1):
            b = item if isinstance(item, bytes) else str(item).encode()
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    if array.dtype.byteorder == ">":  # the wire is little-endian
        array = array.astype(array.dtype.newbyteorder("<"))
    return array.tobytes()  # C order whatever the array's layout: one copy, no other call


def encode_response(model: str, version: str, request_id: str,
                    outputs: Mapping[str, np.ndarray], order: Sequence[str]
                    ) -> pb.ModelInferResponse:
    """A response with every output in `order` as raw bytes (tritonclient decodes only
    raw_output_contents), one entry per output in the same order as `outputs`."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for name in order:
        array = outputs[name]
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        response.raw_output_contents.append(raw_bytes(array))
    return response


def encode_inputs(feeds: Mapping[str, np.ndarray], model: str,
                  outputs: Iterable[str] = ()) -> pb.ModelInferRequest:
    """A request with raw inputs: what a client sends (tests and benchmarks build theirs here)."""
    request = pb.ModelInferRequest(model_name=model)
    for name, array in feeds.items():
        request.inputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        request.raw_input_contents.append(raw_bytes(np.asarray(array)))
    for name in outputs:
        request.outputs.add(name=name)
    return request


def decode_outputs(response: pb.ModelInferResponse) -> dict[str, np.ndarray]:
    """The response's outputs as numpy arrays (raw contents only, as this server sends)."""
    result = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        result[tensor.name] = _decode_raw(tensor, raw)
    return result
