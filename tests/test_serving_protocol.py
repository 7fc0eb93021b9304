"""serving.wire.protocol alone: protobuf <-> numpy, and the one error table."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from serving.datatypes import datatype_of, triton_type
from serving.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from serving.wire import protocol
from serving.wire._generated import inference_pb2 as pb
from tuner.errors import BadInput


def _request(**arrays: np.ndarray) -> pb.ModelInferRequest:
    return protocol.encode_inputs(arrays, "m")


@pytest.mark.parametrize("dtype", ["int64", "int32", "float32", "float16", "float64", "bool",
                                   "uint8", "uint64", "int8"])
def test_raw_round_trip_keeps_values_dtype_and_shape(dtype: str) -> None:
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((2, 3, 4)) * 10).astype(dtype)
    got = protocol.decode_inputs(_request(x=a))["x"]
    assert got.dtype == a.dtype and got.shape == a.shape
    np.testing.assert_array_equal(got, a)


def test_bytes_round_trip() -> None:
    a = np.array([b"ab", b"", b"\x00xyz"], dtype=object)
    got = protocol.decode_inputs(_request(s=a))["s"]
    assert list(got) == list(a)


def test_typed_contents_are_decoded() -> None:
    request = pb.ModelInferRequest(model_name="m")
    t = request.inputs.add(name="ids", datatype="INT64", shape=[2, 2])
    t.contents.int64_contents.extend([1, 2, 3, 4])
    f = request.inputs.add(name="x", datatype="FP32", shape=[3])
    f.contents.fp32_contents.extend([0.5, 1.5, -2.0])
    got = protocol.decode_inputs(request)
    np.testing.assert_array_equal(got["ids"], [[1, 2], [3, 4]])
    assert got["ids"].dtype == np.int64
    np.testing.assert_array_equal(got["x"], np.array([0.5, 1.5, -2.0], np.float32))


def test_raw_and_typed_together_are_refused() -> None:
    request = _request(ids=np.zeros((1, 2), np.int64))
    request.inputs[0].contents.int64_contents.extend([0, 0])
    with pytest.raises(InvalidArgument, match="contents field must not be specified when using "
                                              "raw_input_contents for 'ids'"):
        protocol.decode_inputs(request)


def test_byte_size_mismatch() -> None:
    request = _request(ids=np.zeros((1, 4), np.int64))
    request.raw_input_contents[0] = request.raw_input_contents[0][:-8]
    with pytest.raises(InvalidArgument, match="unexpected total byte size 24 for input 'ids', "
                                              "expecting 32"):
        protocol.decode_inputs(request)


def test_raw_count_must_match_inputs() -> None:
    request = _request(a=np.zeros(2, np.int64), b=np.zeros(2, np.int64))
    del request.raw_input_contents[1]
    with pytest.raises(InvalidArgument, match="expected 2 raw input contents"):
        protocol.decode_inputs(request)


def test_typed_element_count_and_unknown_datatype() -> None:
    request = pb.ModelInferRequest(model_name="m")
    t = request.inputs.add(name="ids", datatype="INT64", shape=[2, 2])
    t.contents.int64_contents.extend([1, 2, 3])
    with pytest.raises(InvalidArgument, match="unexpected number of elements 3 for input 'ids'"):
        protocol.decode_inputs(request)
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP8", shape=[1])
    with pytest.raises(InvalidArgument, match="unknown datatype 'FP8'"):
        protocol.decode_inputs(request)


def test_negative_dims_and_duplicates_are_refused() -> None:
    request = pb.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="INT64", shape=[-1])
    request.raw_input_contents.append(b"")
    with pytest.raises(InvalidArgument, match="negative dimension"):
        protocol.decode_inputs(request)
    request = _request(x=np.zeros(1, np.int64))
    request.inputs.add(name="x", datatype="INT64", shape=[1])
    request.raw_input_contents.append(np.zeros(1, np.int64).tobytes())
    with pytest.raises(InvalidArgument, match="given twice"):
        protocol.decode_inputs(request)


def test_response_is_raw_in_order() -> None:
    outs = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.array([1, 2], np.int64)}
    response = protocol.encode_response("m", "1", "req-7", outs, ["b", "a"])
    assert [o.name for o in response.outputs] == ["b", "a"]
    assert [o.datatype for o in response.outputs] == ["FP32", "INT64"]
    assert list(response.outputs[0].shape) == [2, 3]
    assert len(response.raw_output_contents) == 2 and response.id == "req-7"
    assert not response.outputs[0].HasField("contents")
    back = protocol.decode_outputs(response)
    np.testing.assert_array_equal(back["b"], outs["b"])


def test_requested_outputs_in_order_and_unique() -> None:
    request = protocol.encode_inputs({}, "m", outputs=["y", "x"])
    assert protocol.requested_outputs(request) == ["y", "x"]
    request.outputs.add(name="y")
    with pytest.raises(InvalidArgument, match="requested twice"):
        protocol.requested_outputs(request)


@pytest.mark.parametrize("error, code", [
    (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (BadInput("x"), grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound("x"), grpc.StatusCode.NOT_FOUND),
    (Unavailable("x"), grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_error_table(error: Exception, code: grpc.StatusCode) -> None:
    got, message = protocol.status_for(error)
    assert got == code
    assert ("boom" in message and "RuntimeError" in message) if code == grpc.StatusCode.INTERNAL \
        else message == "x"


def test_datatype_names() -> None:
    assert datatype_of(np.dtype("int64")) == "INT64"
    assert datatype_of(np.dtype(">f4")) == "FP32"
    assert datatype_of(np.dtype(object)) == "BYTES"
    assert triton_type("BYTES") == "TYPE_STRING" and triton_type("FP32") == "TYPE_FP32"
    with pytest.raises(InvalidArgument, match="no KServe v2 datatype"):
        datatype_of(np.dtype("complex64"))
