"""The safe loader: models over 2 GB of external data load lazily; every node gets a unique
name (Sites refer to nodes by name); bad files are BadInput with a clear message."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tuner.errors import BadInput
from tuner.graph.load import load_model

BIG_ROWS, BIG_COLS = 262_144, 2_304  # 2.25 GiB of float32


def _external(name: str, shape: tuple[int, ...], location: str, offset: int) -> onnx.TensorProto:
    t = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape))
    t.data_location = TensorProto.EXTERNAL
    length = int(np.prod(shape)) * 4
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=k, value=v)
    return t


def test_model_over_2gb_of_external_data_loads_lazily(tmp_path):
    size = BIG_ROWS * BIG_COLS * 4
    assert size > 2 * 1024**3
    weights = tmp_path / "weights.bin"
    with open(weights, "wb") as f:
        f.truncate(size)  # sparse: costs no disk and no memory
    table = _external("embed", (BIG_ROWS, BIG_COLS), "weights.bin", 0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed", "ids"], ["y"])], "big",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", BIG_COLS])], [table])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = tmp_path / "big.onnx"
    onnx.save(model, str(path))
    assert path.stat().st_size < 10_000

    # ru_maxrss is a high-water mark: measured in this process it would hide a load that
    # stays under an earlier test's peak. A fresh interpreter reports its own peak.
    code = ("import resource, sys\n"
            "from tuner.graph.load import load_model\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "m = load_model(sys.argv[1])\n"
            "shape = tuple(m.graph.initializers['embed'].const_value.shape)\n"
            "print(shape[0], shape[1], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)\n")
    run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stderr
    rows, cols, grown_kib = (int(x) for x in run.stdout.split())
    assert (rows, cols) == (BIG_ROWS, BIG_COLS)
    assert grown_kib < 200 * 1024, f"loading read the weights: peak grew by {grown_kib} KiB"


def test_short_external_file_is_refused(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"\0" * 10)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])], "g", [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        [_external("w", (4, 4), "w.bin", 0)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))
    with pytest.raises(BadInput, match="shorter"):
        load_model(tmp_path / "m.onnx")


def test_absolute_external_location_is_refused(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["y"])], "g", [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
        [_external("w", (4, 4), str(tmp_path / "w.bin"), 0)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "m.onnx"))
    with pytest.raises(BadInput, match="absolute path"):
        load_model(tmp_path / "m.onnx")


def test_empty_and_repeated_node_names_become_unique(tmp_path):
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"]),  # no name
             helper.make_node("MatMul", ["a", "w"], ["b"]),  # no name
             helper.make_node("Relu", ["b"], ["c"], name="same"),
             helper.make_node("Relu", ["c"], ["y"], name="same")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    names = [n.name for n in load_model(path).graph]
    assert all(names) and len(set(names)) == 4
    assert names[2] == "same"  # a name that was already unique... the first keeps it
    # Loading twice gives the same names: a rewrite reloads the file and finds the nodes.
    assert names == [n.name for n in load_model(path).graph]


def test_unique_names_of_a_real_export_are_kept(reference_model):
    path = reference_model("gpt2", "small", "torchscript")
    proto = onnx.load(str(path), load_external_data=False)
    assert [n.name for n in load_model(path).graph] == [n.name for n in proto.graph.node]


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(BadInput, match="not a file"):
        load_model(tmp_path)


def test_empty_file_is_refused(tmp_path):
    p = tmp_path / "empty.onnx"
    p.write_bytes(b"")
    with pytest.raises(BadInput, match="not an ONNX model"):
        load_model(p)


def test_model_local_functions_are_inlined(tmp_path):
    """An FFN hidden in a model-local function becomes plain nodes that inspect can see."""
    import onnxruntime as ort

    from tuner.graph.ffn import find_ffns
    from tuner.graph.inspect import inspect_path
    from tuner.graph.walk import linears

    fn = helper.make_function(
        "local", "Mlp", ["x", "w_up", "w_down"], ["y"],
        [helper.make_node("MatMul", ["x", "w_up"], ["u"]), helper.make_node("Relu", ["u"], ["a"]),
         helper.make_node("MatMul", ["a", "w_down"], ["d"]), helper.make_node("Add", ["x", "d"], ["y"])],
        [helper.make_opsetid("", 17)])
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("up", (32, 96)), ("down", (96, 32)))]
    graph = helper.make_graph(
        [helper.make_node("Mlp", ["x", "up", "down"], ["y"], domain="local")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 32])], inits)
    model = helper.make_model(graph, functions=[fn], opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    model.ir_version = 10
    path = tmp_path / "fn.onnx"
    onnx.save(model, str(path))
    x = np.ones((2, 32), np.float32)
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    loaded = load_model(path)
    assert not loaded.functions
    assert [n.op_type for n in loaded.graph] == ["MatMul", "Relu", "MatMul", "Add"]
    flat = tmp_path / "flat.onnx"
    import onnx_ir as ir

    ir.save(loaded, str(flat))
    got = ort.InferenceSession(str(flat), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    (ffn,) = find_ffns(linears(loaded.graph))
    assert (ffn.width, ffn.down.out_dim, ffn.activation) == (96, 32, "relu")
    # An MLP is no transformer: inspect refuses it, naming what it did find.
    with pytest.raises(BadInput, match="1 feed-forward blocks but no attention"):
        inspect_path(path)
