"""Copy on write: exporters deduplicate tensors and shape computations across layers, and a
constant may equal a padded size by coincidence. A rewrite changes only what flows into the
padded axis, for the node that reads it, and never a tensor or node other readers share."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from tuner.graph.load import load_model, save_model
from tuner.graph.shape import FfnSite
from tuner.rewrite.common import const_array, find_node, remove_unused
from tuner.rewrite.ffn import pad_ffns
from tuner.runtime.registry import get_backend


def _shared_toy(path):
    """Two FFN layers x -> up_i (4, 6) -> +b6 -> Relu -> Reshape(shp) -> down_i (6, 4), plus
    an unrelated branch x -> side (4, 6) -> +b6 -> Reshape(shp) -> side_out (6, 4), where
    shp = Concat(batch, seq, [6]) and the bias b6 are one node and one tensor for all three
    (as exporters deduplicate them): the side branch's 6 is not the FFN width."""
    rng = np.random.default_rng(1)

    def init(name, shape):
        return helper.make_tensor(name, TensorProto.FLOAT, shape,
                                  rng.standard_normal(int(np.prod(shape))).tolist())

    inits = [init("b6", [6]), init("side_w", [4, 6]), init("side_out_w", [6, 4]),
             helper.make_tensor("zero", TensorProto.INT64, [1], [0]),
             helper.make_tensor("one", TensorProto.INT64, [1], [1]),
             helper.make_tensor("six", TensorProto.INT64, [1], [6])]
    nodes = [helper.make_node("Shape", ["x"], ["sh"], name="shape"),
             helper.make_node("Gather", ["sh", "zero"], ["bdim"], name="batch", axis=0),
             helper.make_node("Gather", ["sh", "one"], ["sdim"], name="seq", axis=0),
             helper.make_node("Concat", ["bdim", "sdim", "six"], ["shp"], name="shp", axis=0)]
    h = "x"
    for i in range(2):
        inits += [init(f"w_up{i}", [4, 6]), init(f"w_down{i}", [6, 4])]
        nodes += [helper.make_node("MatMul", [h, f"w_up{i}"], [f"u{i}"], name=f"up{i}"),
                  helper.make_node("Add", [f"u{i}", "b6"], [f"ub{i}"], name=f"bias{i}"),
                  helper.make_node("Relu", [f"ub{i}"], [f"a{i}"], name=f"act{i}"),
                  helper.make_node("Reshape", [f"a{i}", "shp"], [f"r{i}"], name=f"view{i}"),
                  helper.make_node("MatMul", [f"r{i}", f"w_down{i}"], [f"d{i}"], name=f"down{i}"),
                  helper.make_node("Add", [h, f"d{i}"], [f"h{i}"], name=f"res{i}")]
        h = f"h{i}"
    nodes += [helper.make_node("MatMul", ["x", "side_w"], ["g"], name="side"),
              helper.make_node("Add", ["g", "b6"], ["gb"], name="side_bias"),
              helper.make_node("Reshape", ["gb", "shp"], ["gr"], name="side_view"),
              helper.make_node("MatMul", ["gr", "side_out_w"], ["go"], name="side_out"),
              helper.make_node("Add", [h, "go"], ["y"], name="out")]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 4])
    model = helper.make_model(helper.make_graph(nodes, "shared", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return path


def _run(path, x):
    return get_backend("ort-cpu").load(path).session.run(None, {"x": x})[0]


def _shape_target(model, reshape: str) -> list[int]:
    """The constant tail of a Reshape's Concat target."""
    concat = find_node(model.graph, reshape).inputs[1].producer()
    assert concat.op_type == "Concat"
    return const_array(concat.inputs[2]).tolist()


def test_shared_shape_concat_and_bias_are_copied_per_node(tmp_path):
    src = _shared_toy(tmp_path / "toy.onnx")
    model = load_model(src)
    sites = [(i, FfnSite(up=f"up{i}", down=f"down{i}")) for i in range(2)]
    assert pad_ffns(model, sites, 8) == [6, 6]
    remove_unused(model)
    out = save_model(model, tmp_path / "padded.onnx")
    onnx.checker.check_model(str(out))
    rng = np.random.default_rng(2)
    for shape in ((2, 3, 4), (1, 7, 4)):
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(_run(out, x), _run(src, x), rtol=1e-6, atol=1e-6)
    padded = load_model(out)
    # Each FFN reshape reads its own Concat ending in 8; the side branch keeps the shared one.
    assert _shape_target(padded, "view0") == [8] and _shape_target(padded, "view1") == [8]
    assert _shape_target(padded, "side_view") == [6]
    side_concat = find_node(padded.graph, "side_view").inputs[1].producer()
    assert side_concat.name == "shp" and side_concat.inputs[2].name == "six"
    assert find_node(padded.graph, "view0").inputs[1].producer() is not side_concat
    # The deduplicated bias: the FFN Adds read padded copies, the side branch the original.
    assert find_node(padded.graph, "side_bias").inputs[1].name == "b6"
    for i in range(2):
        bias = const_array(find_node(padded.graph, f"bias{i}").inputs[1])
        assert bias.shape == (8,) and not bias[6:].any()
    assert const_array(padded.graph.initializers["b6"]).shape == (6,)
