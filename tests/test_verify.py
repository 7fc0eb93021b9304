"""The accuracy gate and the input maker: real ONNX Runtime sessions on real graphs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tuner.errors import BadInput
from tuner.gate.feeds import check_feed, load_npz, make_feeds, padded_mask
from tuner.gate.verify import Tolerance, verify
from tuner.graph.roles import InputSpec
from tuner.runtime.registry import get_backend


def _tiny(path, masked_bias: float, real_bias: float, extra_output: bool = True):
    """out = x + masked_bias * (1 - mask) + real_bias * mask, shaped (B, S, 4)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 4])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["B", "S"])
    out = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", "S", 4])
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["m"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["m", "axis"], ["m3"]),
        helper.make_node("Sub", ["one", "m3"], ["pad"]),
        helper.make_node("Mul", ["pad", "mb"], ["pad_term"]),
        helper.make_node("Mul", ["m3", "rb"], ["real_term"]),
        helper.make_node("Add", ["x", "pad_term"], ["t"]),
        helper.make_node("Add", ["t", "real_term"], ["logits"]),
    ]
    inits = [helper.make_tensor("axis", TensorProto.INT64, [1], [2]),
             helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("mb", TensorProto.FLOAT, [], [masked_bias]),
             helper.make_tensor("rb", TensorProto.FLOAT, [], [real_bias])]
    outputs = [out]
    if extra_output:
        nodes.append(helper.make_node("Identity", ["m"], ["mask_float"]))
        outputs.append(helper.make_tensor_value_info("mask_float", TensorProto.FLOAT, ["B", "S"]))
    graph = helper.make_graph(nodes, "tiny", [x, mask], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    onnx.save(model, str(path))
    return get_backend("ort-cpu").load(path)


def _feeds():
    rng = np.random.default_rng(1)
    feeds = []
    for b, s in ((2, 5), (3, 9)):
        feeds.append({"x": rng.standard_normal((b, s, 4)).astype(np.float32),
                      "attention_mask": padded_mask(b, s, rng)})
    return feeds


def test_padding_positions_are_not_compared(tmp_path):
    ref = _tiny(tmp_path / "a.onnx", 0.0, 0.0)
    differs_on_padding = _tiny(tmp_path / "b.onnx", 100.0, 0.0)
    result = verify(ref, differs_on_padding, _feeds(), Tolerance())
    assert result, result.table()
    assert result.outputs[0].max_abs == 0.0
    assert "PASS" in result.table()


def test_a_difference_on_real_tokens_fails(tmp_path):
    ref = _tiny(tmp_path / "a.onnx", 0.0, 0.0)
    off = _tiny(tmp_path / "b.onnx", 0.0, 1e-3)
    result = verify(ref, off, _feeds(), Tolerance())
    assert not result
    logits = {o.name: o for o in result.outputs}["logits"]
    assert not logits.passed and logits.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert logits.top1 is not None
    assert "FAIL" in result.table()
    # The same difference passes a looser tolerance, and a callable policy decides alone.
    assert verify(ref, off, _feeds(), Tolerance(atol=2e-3))
    assert not verify(ref, ref, _feeds(), lambda name, a, b: name != "logits")


def test_missing_output_and_broken_candidate_fail(tmp_path):
    ref = _tiny(tmp_path / "a.onnx", 0.0, 0.0)
    fewer = _tiny(tmp_path / "b.onnx", 0.0, 0.0, extra_output=False)
    result = verify(ref, fewer, _feeds())
    assert not result
    assert {o.name: o.reason for o in result.outputs}["mask_float"] == \
        "nothing compared: 0 element(s), the floor is 1; missing in the candidate"

    class Broken:
        name = "broken"

        def infer(self, feeds):
            raise RuntimeError("no kernel for you")

    result = verify(ref, Broken(), _feeds())
    assert not result and "candidate failed to run" in result.errors[0]
    assert result.to_json()["passed"] is False
    assert not result.reference_failed  # the candidate's fault: a FAIL (exit 1)
    result = verify(Broken(), ref, _feeds())
    assert not result and "the reference failed to run" in result.errors[0]
    assert result.reference_failed  # the original's: bad input (exit 2) for verify and pad
    assert "(2, 5)" in result.errors[0]  # says which input shape broke


def test_tolerance_validation_messages():
    with pytest.raises(ValueError, match="finite and >= 0"):
        Tolerance(atol=-1.0)
    with pytest.raises(ValueError, match="for output 'logits'"):
        Tolerance(per_output=(("logits", float("nan"), 0.1),))
    assert Tolerance.fp16().atol > Tolerance().atol
    assert Tolerance(per_output=(("a", 1.0, 2.0),)).limits("a") == (1.0, 2.0)


def test_make_feeds_on_a_real_model(reference_model):
    path = reference_model("llama", "small", "torchscript")
    feeds = make_feeds(path, vocab_size=1024, shapes=[(1, 7), (3, 33)], seed=3)
    assert [f["input_ids"].shape for f in feeds] == [(1, 7), (3, 33)]
    for f in feeds:
        assert f["input_ids"].dtype == np.int64 and f["input_ids"].max() < 1024
        assert f["input_ids"].min() >= 0
    mask = feeds[1]["attention_mask"]
    assert mask[0].all()  # row 0 full
    right, left = int(mask[1].sum()), int(mask[2].sum())
    assert 1 <= right < 33 and 1 <= left < 33  # seed 3 pads both rows
    assert mask[1].tolist() == [1] * right + [0] * (33 - right)  # right padding
    assert mask[2].tolist() == [0] * (33 - left) + [1] * left  # left padding
    again = make_feeds(path, vocab_size=1024, shapes=[(1, 7), (3, 33)], seed=3)
    assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(feeds, again))
    with pytest.raises(BadInput, match="vocab_size must be >= 1"):
        make_feeds(path, vocab_size=0)
    with pytest.raises(BadInput, match="batch and sequence must be >= 1"):
        make_feeds(path, vocab_size=10, shapes=[(0, 3)])


def test_load_npz_refuses_pickles_and_checks_inputs(tmp_path):
    ok = tmp_path / "ok.npz"
    np.savez(ok, input_ids=np.zeros((1, 3), np.int64), attention_mask=np.ones((1, 3), np.int64))
    feed = load_npz(ok)
    specs = [InputSpec("input_ids", "int64", ("b", "s")), InputSpec("attention_mask", "int64", ("b", "s"))]
    check_feed(feed, specs)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, input_ids=np.array([{"evil": 1}], dtype=object))
    with pytest.raises(BadInput, match="not a plain .npz"):
        load_npz(pickled)
    with pytest.raises(BadInput, match="no such file"):
        load_npz(tmp_path / "missing.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(BadInput, match="not a readable .npz"):
        load_npz(tmp_path / "junk.npz")
    with pytest.raises(BadInput, match="missing \\['attention_mask'\\]"):
        check_feed({"input_ids": feed["input_ids"]}, specs)
    with pytest.raises(BadInput, match="is int32; the model wants int64"):
        check_feed({**feed, "input_ids": feed["input_ids"].astype(np.int32)}, specs)


def test_nothing_compared_fails_closed_and_the_floor_is_stated(tmp_path):
    ref = _tiny(tmp_path / "a.onnx", 0.0, 0.0)
    x3 = _tiny(tmp_path / "b.onnx", 0.0, 5.0)  # differs on every real token
    zero = [{"x": np.ones((1, 3, 4), np.float32), "attention_mask": np.zeros((1, 3), np.int64)}]
    result = verify(ref, x3, zero)
    assert not result, result.table()  # all padding: nothing compared is a FAIL, not a PASS
    assert all("nothing compared" in o.reason for o in result.outputs if o.name == "logits")
    # a floor above what the feeds give fails too, and the table says what the floor was
    honest = verify(ref, ref, _feeds(), min_compared=10**6)
    assert not honest and "at least 1000000 compared element(s)" in honest.table()
    assert verify(ref, ref, _feeds())
    assert not verify(ref, ref, [])  # no feeds: nothing compared


def test_an_fp16_model_is_gated_at_fp16_tolerances():
    tol = Tolerance().at_precision("fp16")
    assert (tol.atol, tol.rtol) == (1e-2, 1e-2) and "fp16 model: fp16 tolerances" in tol.label()
    assert Tolerance().at_precision("fp32") == Tolerance()
    assert Tolerance(atol=0.5, rtol=0.5).at_precision("bf16").atol == 0.5  # never tighter


def test_hand_built_specs_get_roles_from_their_names():
    specs = [InputSpec("input_ids", "int64", ("b", "s")), InputSpec("attention_mask", "int64", ("b", "s"))]
    feed = make_feeds(specs, 50, [(3, 6)], seed=2)[0]
    assert feed["input_ids"].any() and feed["attention_mask"][0].all()
    with pytest.raises(BadInput, match="all zeros"):
        check_feed({"input_ids": np.ones((1, 2), np.int64),
                    "attention_mask": np.zeros((1, 2), np.int64)}, specs)
