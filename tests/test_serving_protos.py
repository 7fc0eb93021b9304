"""protos/inference.proto: the committed stubs are what `python -m serving.wire.gen_protos` writes,
and every message, field and RPC we declare matches Triton's own (as shipped in tritonclient)
by name, number, type and label: the wire compatibility that existing clients rely on."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from serving.wire import gen_protos
from serving.wire._generated import POOL
from serving.wire._generated import inference_pb2 as pb

triton_service = pytest.importorskip("tritonclient.grpc.service_pb2")


# What a generator writes besides the descriptor (class headers, version checks) changes
# between grpcio-tools versions; what the stubs mean is the serialized descriptor they load
# and the RPC paths they route. Those are compared.
_DESCRIPTOR = re.compile(r"AddSerializedFile\((b'.*?')\)\n", re.S)
_PATHS = re.compile(r"'(/inference\.GRPCInferenceService/\w+)'")


def _meaning(pb2: str, pb2_grpc: str) -> tuple[bytes, list[str]]:
    match = _DESCRIPTOR.search(pb2)
    assert match, "no serialized descriptor in the generated module"
    assert "_POOL.AddSerializedFile(" in pb2, "descriptors must go to the private pool"
    return ast.literal_eval(match.group(1)), sorted(set(_PATHS.findall(pb2_grpc)))


def _read(folder: Path) -> tuple[bytes, list[str]]:
    return _meaning((folder / "inference_pb2.py").read_text(),
                    (folder / "inference_pb2_grpc.py").read_text())


def test_committed_stubs_are_current(tmp_path: Path) -> None:
    gen_protos.generate(tmp_path)
    assert _read(gen_protos.OUT_DIR) == _read(tmp_path), (
        "serving/wire/_generated/ is stale: run `python -m serving.wire.gen_protos`")


def test_stale_stubs_are_detected(tmp_path: Path) -> None:
    """The check above can fail: one field renamed in the .proto changes the stubs."""
    edited = gen_protos.PROTO.read_text().replace("bool live = 1;", "bool alive = 1;")
    assert edited != gen_protos.PROTO.read_text()
    gen_protos.generate(tmp_path, proto_text=edited)
    assert _read(tmp_path)[0] != _read(gen_protos.OUT_DIR)[0]
    assert len(_read(tmp_path)[1]) == 18  # the RPC paths are all found


def test_descriptors_live_in_a_private_pool_next_to_tritonclient() -> None:
    # Both define inference.ModelInferRequest; importing both in one process must work.
    assert pb.DESCRIPTOR.pool is POOL
    assert triton_service.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"
    assert pb.ModelInferRequest.DESCRIPTOR.full_name == "inference.ModelInferRequest"


def _triton_message(full_name: str):
    return triton_service.DESCRIPTOR.pool.FindMessageTypeByName(full_name)


def _compare(ours, theirs, path: str, checked: list[str]) -> None:
    for field in ours.fields:
        other = theirs.fields_by_name.get(field.name)
        assert other is not None, f"{path}.{field.name} is not in Triton's proto"
        assert (field.number, field.type) == (other.number, other.type), (
            f"{path}.{field.name}: ours is #{field.number} type {field.type}, Triton's is "
            f"#{other.number} type {other.type}")
        assert field.is_repeated == other.is_repeated, f"{path}.{field.name}: label differs"
        if field.message_type is not None:
            assert field.message_type.full_name == other.message_type.full_name
        checked.append(f"{path}.{field.name}")
    for nested in ours.nested_types:
        _compare(nested, theirs.nested_types_by_name[nested.name], f"{path}.{nested.name}",
                 checked)
    for enum in ours.enum_types:
        theirs_enum = theirs.enum_types_by_name[enum.name]
        for value in enum.values:
            assert theirs_enum.values_by_name[value.name].number == value.number


def test_every_field_matches_triton() -> None:
    checked: list[str] = []
    for name, message in pb.DESCRIPTOR.message_types_by_name.items():
        _compare(message, _triton_message(message.full_name), name, checked)
    assert "ModelInferRequest.raw_input_contents" in checked
    assert "InferParameter.double_param" in checked and "InferParameter.uint64_param" in checked
    assert "ModelConfig.max_batch_size" in checked and "ModelConfig.dynamic_batching" in checked
    assert len(checked) > 100


def test_data_type_enum_matches_triton() -> None:
    from tritonclient.grpc import model_config_pb2

    theirs = model_config_pb2.DataType
    for value in pb.DESCRIPTOR.enum_types_by_name["DataType"].values:
        assert theirs.Value(value.name) == value.number


def test_rpcs_match_triton() -> None:
    ours = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    theirs = triton_service.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    assert ours.full_name == "inference.GRPCInferenceService"
    for method in ours.methods:
        other = theirs.methods_by_name[method.name]
        assert method.input_type.full_name == other.input_type.full_name
        assert method.output_type.full_name == other.output_type.full_name
        assert (method.client_streaming, method.server_streaming) == (
            other.client_streaming, other.server_streaming)
    assert {"ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata",
            "ModelInfer", "ModelStreamInfer", "ModelConfig"} <= set(ours.methods_by_name)
