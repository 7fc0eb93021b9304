"""KServe v2 messages <-> numpy, and the one table that maps errors to gRPC status codes.

Pure functions: no server state, no model. Decoding checks only what the wire itself can
contradict (raw and typed contents together, byte sizes, unknown datatypes); what depends on
the model (names, dtypes, shapes, token ids) is checked by serving.engine.
"""

from __future__ import annotations

import math
import struct
from typing import Collection, Iterable, Mapping, Sequence

import grpc
import numpy as np

from serving.classify import class_count
from serving.datatypes import DATATYPES, datatype_of
from serving.errors import (AlreadyExists, InvalidArgument, NotFound, ResourceExhausted,
                            Unauthenticated, Unavailable)
from serving.shared_memory import Place, SystemRegions, place_of
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
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client gets for `exc`."""
    for kind, code in STATUS_CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def retry_trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """gRPC's retry pushback for a refusal a retry gets past (a full server or queue): a
    channel whose service config has a retryPolicy for the code waits this long before its
    next attempt, instead of its own backoff (milliseconds: gRFC A6), as HTTP's clients
    wait Retry-After."""
    after = getattr(exc, "retry_after_s", None)
    return (("grpc-retry-pushback-ms", str(int(after * 1000))),) if after else ()


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


def decode_inputs(request: pb.ModelInferRequest, regions: SystemRegions | None = None
                  ) -> dict[str, np.ndarray]:
    """The request's input tensors as numpy arrays, keyed by name (read-only views of the
    message's bytes where possible; an input whose parameters name a shared memory region
    is read from it, in the raw format). InvalidArgument on anything the wire contradicts."""
    model = request.model_name
    raw = request.raw_input_contents
    places = [place_of(parameter_values(t.parameters), f"input '{t.name}'")
              for t in request.inputs]
    in_body = places.count(None)  # raw entries skip the inputs in shared memory, as Triton
    if raw and len(raw) != in_body:
        raise InvalidArgument(f"expected {in_body} raw input contents (one per input not in "
                              f"shared memory) but got {len(raw)} for model '{model}'")
    feeds: dict[str, np.ndarray] = {}
    index = 0
    for tensor, place in zip(request.inputs, places):
        if tensor.name in feeds:
            raise InvalidArgument(f"input '{tensor.name}' is given twice for model '{model}'")
        if tensor.datatype not in DATATYPES:
            raise InvalidArgument(f"input '{tensor.name}' has unknown datatype "
                                  f"'{tensor.datatype}'")
        has_typed = tensor.HasField("contents") and tensor.contents.ByteSize() > 0
        if place is not None:
            feeds[tensor.name] = _decode_shared(tensor, place, regions, has_typed, model)
        elif raw:
            if has_typed:
                raise InvalidArgument(f"contents field must not be specified when using "
                                      f"raw_input_contents for '{tensor.name}' for model "
                                      f"'{model}'")
            feeds[tensor.name] = _decode_raw(tensor, raw[index])
            index += 1
        else:
            feeds[tensor.name] = _decode_typed(tensor)
    return feeds


def _decode_shared(tensor, place: Place, regions: SystemRegions | None, has_typed: bool,
                   model: str) -> np.ndarray:
    what = f"input '{tensor.name}'"
    if has_typed:
        raise InvalidArgument(f"unexpected 'content' provided when using shared memory for "
                              f"input tensor '{tensor.name}' for model '{model}'")
    if regions is None:
        raise InvalidArgument(f"{what}: shared memory is not served on this path")
    return _decode_raw(tensor, regions.read(place, what))


def output_places(request: pb.ModelInferRequest) -> dict[str, Place]:
    """The requested outputs whose parameters name a shared memory region, by name."""
    places = {}
    for o in request.outputs:
        place = place_of(parameter_values(o.parameters), f"output '{o.name}'")
        if place is not None:
            places[o.name] = place
    return places


def write_placed(regions: SystemRegions, places: Mapping[str, Place],
                 outputs: Mapping[str, np.ndarray]) -> None:
    """Each placed output's raw bytes into its region (the response then carries its name,
    shape and datatype, and no data: Triton's way)."""
    for name, place in places.items():
        if name in outputs:
            regions.write(place, raw_bytes(outputs[name]), f"output '{name}'")


def parameter_values(parameters) -> dict[str, bool | int | float | str]:
    """A request's `parameters` map as plain Python values (InferParameter's oneof)."""
    values = {}
    for name, p in parameters.items():
        kind = p.WhichOneof("parameter_choice")
        if kind is not None:
            values[name] = getattr(p, kind)
    return values


def class_counts(request: pb.ModelInferRequest) -> dict[str, int]:
    """The requested outputs asking for Triton's classification (`classification` k)."""
    counts = {}
    for o in request.outputs:
        count = class_count(parameter_values(o.parameters), o.name)
        if count is not None:
            counts[o.name] = count
    return counts


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
                    outputs: Mapping[str, np.ndarray], order: Sequence[str],
                    placed: Collection[str] = ()) -> pb.ModelInferResponse:
    """A response with every output in `order` as raw bytes (tritonclient decodes only
    raw_output_contents), one entry per output in the same order as `outputs`; an output
    in `placed` was written to shared memory: its entry is empty, as Triton keeps one per
    output (tritonclient finds an output's bytes by its index)."""
    response = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    for name in order:
        array = outputs[name]
        response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
        response.raw_output_contents.append(b"" if name in placed else raw_bytes(array))
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
