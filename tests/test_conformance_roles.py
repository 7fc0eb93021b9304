"""Input roles that hold on every exporter version (tuner/graph/roles.py): ranked structural
evidence, a refusal naming both inputs when two claim one role, and `--roles NAME=ROLE` on
every command, recorded in the artifact's manifest for serve."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from models import optimum
from tuner.cli import main
from tuner.errors import BadInput
from tuner.graph.load import load_model
from tuner.graph.role_overrides import overriding, parse_roles, role_overrides
from tuner.graph.roles import _reach, input_specs

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _two_masks(path, second: str = "m2"):
    """A toy LM whose two int inputs both build an additive attention bias: the structure
    cannot tell which is the mask. h = E[ids] + bias(m) + bias(m2); logits =
    softmax(h h^T) h W."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((50, 8)).astype(np.float32), "E"),
             numpy_helper.from_array(rng.standard_normal((8, 50)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array(-1e9, np.float32), "neg"),
             numpy_helper.from_array(np.array([-1], np.int64), "last")]
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["emb"])]  # (B, S, 8)
    total = "emb"
    for m in ("m", second):
        nodes += [helper.make_node("Cast", [m], [f"{m}_f"], to=TensorProto.FLOAT),
                  helper.make_node("Sub", ["one", f"{m}_f"], [f"{m}_inv"]),
                  helper.make_node("Mul", [f"{m}_inv", "neg"], [f"{m}_bias"]),  # (B, S)
                  helper.make_node("Unsqueeze", [f"{m}_bias", "last"], [f"{m}_b3"]),  # (B, S, 1)
                  helper.make_node("Add", [total, f"{m}_b3"], [f"{total}_{m}"])]
        total = f"{total}_{m}"
    nodes += [helper.make_node("Transpose", [total], ["hT"], perm=[0, 2, 1]),  # (B, 8, S)
              helper.make_node("MatMul", [total, "hT"], ["scores"]),  # (B, S, S)
              helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", total], ["attn"]),  # (B, S, 8)
              helper.make_node("MatMul", ["attn", "W"], ["logits"])]  # (B, S, 50)
    ints = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "sequence"])
            for n in ("input_ids", "m", second)]
    graph = helper.make_graph(nodes, "two_masks", ints, [helper.make_tensor_value_info(
        "logits", TensorProto.FLOAT, ["batch", "sequence", 50])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_two_inputs_claiming_the_mask_is_a_refusal_naming_both(tmp_path):
    m = _two_masks(tmp_path / "two.onnx")
    # (a toy, not a transformer `inspect` reads: verify is the command that reads its roles)
    code, _, err = _run(["verify", str(m), str(m)])
    assert code == 2, err
    assert "'m' and 'm2'" in err and "--roles NAME=ROLE overrides" in err, err
    with pytest.raises(BadInput, match=r"inputs 'm' and 'm2' both look like the attention_mask"):
        input_specs(m)


def test_roles_override_decides_what_the_structure_cannot(tmp_path):
    m = _two_masks(tmp_path / "two.onnx")
    with overriding(parse_roles(["m2=other"])):
        roles = {s.name: s.role for s in input_specs(m)}
    assert roles == {"input_ids": "token_ids", "m": "attention_mask", "m2": "other"}
    code, out, err = _run(["verify", str(m), str(m), "--roles", "m2=other"])
    assert code == 0 and "PASS" in out, err
    # and the override is for that command only
    with pytest.raises(BadInput, match="both look like"):
        input_specs(m)


@pytest.mark.parametrize("value, message", [
    ("m2", "expected NAME=ROLE"), ("m2=bogus", "unknown role 'bogus'"),
    ("=other", "expected NAME=ROLE")])
def test_a_malformed_override_is_bad_input(tmp_path, value, message):
    m = _two_masks(tmp_path / "two.onnx")
    code, _, err = _run(["verify", str(m), str(m), "--roles", value])
    assert code == 2 and message in err, err


def test_an_override_naming_no_input_is_bad_input(tmp_path):
    m = _two_masks(tmp_path / "two.onnx")
    code, _, err = _run(["verify", str(m), str(m), "--roles", "m2=other", "--roles", "zz=other"])
    assert code == 2 and "'zz', which the model does not take" in err, err


def test_parse_roles_keeps_the_last_of_repeated_names():
    assert parse_roles(["a=other", "a=attention_mask"]) == {"a": "attention_mask"}
    with overriding({"a": "other"}):
        assert role_overrides() == {"a": "other"}


def test_positions_that_also_reach_the_mask_arithmetic_are_positions():
    """The trap (STYLE.md): transformers 4.57 routes Optimum's position_ids into the mask
    construction too. The rotary path outranks it; the mask is the past + seq input."""
    path = optimum.cached("llama", optimum.TASKS[0])
    model = load_model(path)
    pos = next(v for v in model.graph.inputs if v.name == "position_ids")
    ops, bias = _reach(pos)
    assert (bias or "Where" in ops) and {"Cos", "Sin"} & ops  # both kinds of evidence
    roles = {s.name: s.role for s in input_specs(model)}
    assert roles["position_ids"] == "position_ids" and roles["attention_mask"] == "attention_mask"


def test_positions_into_a_fused_rotary_are_positions(tmp_path):
    """ONNX Runtime's optimizer fuses each rotary into com.microsoft.RotaryEmbedding, which
    takes position_ids itself and holds its cos/sin caches: no Cos or Sin is left to reach,
    and the positions, still reaching the scores' Softmax, were taken for a second mask (a
    fused variant that optimize selected could not be served)."""
    from tuner.runtime.ort_fusion import fuse_file

    src, fused = optimum.cached("llama", optimum.TASKS[0]), tmp_path / "fused.onnx"
    assert fuse_file(src, fused, num_heads=4, hidden_size=96)["RotaryEmbedding"] == 4
    roles = {s.name: s.role for s in input_specs(fused)}
    assert roles == {s.name: s.role for s in input_specs(src)}
    assert roles["position_ids"] == "position_ids" and roles["attention_mask"] == "attention_mask"


def test_optimize_records_the_overrides_and_serve_reads_them(tmp_path):
    from tuner.artifact.store import read_manifest

    src = optimum.cached("gpt2", optimum.TASKS[1])
    traffic = tmp_path / "t.jsonl"
    traffic.write_text('{"seq": 8}\n')
    out = tmp_path / "art"
    code, _, err = _run(["optimize", str(src), "-o", str(out), "--requests", str(traffic),
                         "--roles", "position_ids=position_ids", "--rounds", "2", "--warmup",
                         "0", "--bucket-rounds", "1", "--no-probe", "--no-fuse", "--no-plots",
                         "--max-variants", "1", "--no-cache", "--max-buckets", "1"])
    assert code == 0, err
    assert json.loads((out / "manifest.json").read_text())["roles"] == {
        "position_ids": "position_ids"}
    assert read_manifest(out).roles == {"position_ids": "position_ids"}
