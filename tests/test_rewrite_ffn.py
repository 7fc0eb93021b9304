"""FFN width padding: exact on every reference family and both exporters."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper
from rewrite_checks import pad_and_check, weight

from tuner.errors import RewriteRefused
from tuner.gate.feeds import make_feeds
from tuner.gate.verify import verify
from tuner.graph.inspect import inspect_path
from tuner.graph.load import load_model, save_model
from tuner.graph.shape import FfnSite
from tuner.rewrite.common import remove_unused
from tuner.rewrite.compose import PadRequest
from tuner.rewrite.ffn import pad_ffn
from tuner.runtime.registry import get_backend

CASES = [(fam, exp) for fam in ("gpt2", "bert", "llama") for exp in ("torchscript", "dynamo")]
CASES += [("gpt_neox", "torchscript"), ("qwen2", "dynamo")]


@pytest.mark.parametrize("family,exporter", CASES)
def test_ffn_padding_is_exact(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "awkward", exporter)
    before = inspect_path(src)
    assert before.ffn_size in (600, 426)
    result, after = pad_and_check(src, tmp_path / "ffn.onnx", PadRequest(ffn_size=640))
    assert result.transforms == (f"ffn {before.ffn_size}->640",)
    assert after.ffn_size == 640 and after.ffn_gated == before.ffn_gated
    assert (after.hidden_size, after.head_dim, after.vocab_size) == \
        (before.hidden_size, before.head_dim, before.vocab_size)
    # Structure: the new units are zero columns on up (and gate), zero rows on down.
    site = after.sites.layers[0].ffn
    down = weight(tmp_path / "ffn.onnx", site.down)
    rows = down[before.ffn_size:] if down.shape[0] == 640 else down[:, before.ffn_size:]
    assert rows.size and not rows.any()


def test_shared_bias_is_copied_not_edited(reference_model, tmp_path):
    """TorchScript GPT-2 feeds one deduplicated c_fc bias to both layers (through Identity):
    padding layer 0 alone must leave layer 1 reading the original 600 entries."""
    src = reference_model("gpt2", "awkward", "torchscript")
    shape = inspect_path(src)
    model = load_model(src)
    assert pad_ffn(model, shape.sites.layers[0].ffn, 640, 0) == 600
    remove_unused(model)
    out = save_model(model, tmp_path / "one_layer.onnx")
    onnx.checker.check_model(str(out))
    backend = get_backend("ort-cpu")
    result = verify(backend.load(src), backend.load(out), make_feeds(src, 50257, [(2, 6)]))
    assert result, result.table()
    assert weight(out, shape.sites.layers[1].ffn.up, 2).shape == (600,)
    assert weight(out, shape.sites.layers[0].ffn.up, 2).shape == (640,)


def _toy(path, inner_op: str):
    """x (B, 4) -> MatMul W1 (4, 6) -> inner_op -> MatMul W2 (6, 4)."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 4])
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [4, 6], rng.standard_normal(24).tolist())
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [6, 4], rng.standard_normal(24).tolist())
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="up"),
             helper.make_node(inner_op, ["h"], ["a"], name="inner"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="down")]
    model = helper.make_model(helper.make_graph(nodes, "toy", [x], [y], [w1, w2]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return load_model(path)


def test_unknown_op_on_the_inner_path_refuses_naming_it(tmp_path):
    model = _toy(tmp_path / "toy.onnx", "Softmax")  # softmax over the FFN axis: not exact
    with pytest.raises(RewriteRefused, match="node 'inner' \\(Softmax\\)"):
        pad_ffn(model, FfnSite(up="up", down="down"), 8, 0)
    relu = _toy(tmp_path / "relu.onnx", "Relu")
    assert pad_ffn(relu, FfnSite(up="up", down="down"), 8, 0) == 6
    with pytest.raises(RewriteRefused, match="cannot pad to the smaller 4"):
        pad_ffn(_toy(tmp_path / "r2.onnx", "Relu"), FfnSite(up="up", down="down"), 4, 0)
    with pytest.raises(RewriteRefused, match="'nope' named by inspect is not in the graph"):
        pad_ffn(relu, FfnSite(up="nope", down="down"), 8, 0)


def test_save_is_atomic(tmp_path):
    """Ctrl-C in the middle of writing (here: while a lazily loaded weight is read) leaves
    the old file in place and no temporary files behind."""
    model = _toy(tmp_path / "toy.onnx", "Relu")
    dst = tmp_path / "out.onnx"
    dst.write_bytes(b"old")

    def interrupted():
        raise KeyboardInterrupt("Ctrl-C while writing")

    model.graph.initializers["w1"].const_value = ir.LazyTensor(
        interrupted, dtype=ir.DataType.FLOAT, shape=ir.Shape([4, 6]), name="w1")
    with pytest.raises(KeyboardInterrupt, match="Ctrl-C while writing"):
        save_model(model, dst)
    assert dst.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.onnx", "toy.onnx"]


@pytest.mark.parametrize("family,exporter,fused_op", [("bert", "torchscript", "BiasGelu"),
                                                      ("gpt2", "dynamo", "FastGelu")])
def test_ffn_padding_after_ort_fusion(reference_model, tmp_path, family, exporter, fused_op):
    """ONNX Runtime's optimizer folds bias + GELU into one com.microsoft op: its bias is
    padded like any elementwise constant."""
    from tuner.runtime.ort_fusion import fuse_file

    fused = tmp_path / "fused.onnx"
    assert fuse_file(reference_model(family, "awkward", exporter), fused, 2, 160).get(fused_op)
    _, after = pad_and_check(fused, tmp_path / "ffn.onnx", PadRequest(ffn_size=640))
    assert after.ffn_size == 640 and f"com.microsoft.{fused_op}" in after.fused_ops
