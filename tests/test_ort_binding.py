"""tuner.runtime.ort.OrtRunner.infer_into keeps its IO binding between calls and binds an
array again only where its address, shape or dtype changed: every call must still read the
caller's current values and write into the caller's current buffers."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from tuner.runtime.ort import OrtRunner, load_cpu


def _graph() -> bytes:
    """y = x + 1, z = 2x, both [n, 3]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 3]) for n in ("y", "z")]
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph([helper.make_node("Add", ["x", "one"], ["y"]),
                               helper.make_node("Mul", ["x", "two"], ["z"])],
                              "g", [x], outs, [one, two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    return model.SerializeToString()


def test_a_kept_binding_reads_current_inputs_and_writes_current_buffers():
    runner = OrtRunner(load_cpu(_graph()))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = np.zeros((2, 3), np.float32)
    z = runner.infer_into({"x": x}, {"y": y})["z"]
    np.testing.assert_array_equal(y, x + 1)
    np.testing.assert_array_equal(z, 2 * x)
    x[:] = 10  # the same array, new values: not bound again, and read anew
    z = runner.infer_into({"x": x}, {"y": y})["z"]
    np.testing.assert_array_equal(y, 11)
    np.testing.assert_array_equal(z, 20)
    other, y2 = np.full((2, 3), -1, np.float32), np.zeros((2, 3), np.float32)
    runner.infer_into({"x": other}, {"y": y2})  # other arrays: bound again
    np.testing.assert_array_equal(y2, 0)
    np.testing.assert_array_equal(y, 11)  # the earlier buffer is left alone
    wide, y3 = np.ones((4, 3), np.float32), np.zeros((4, 3), np.float32)
    z = runner.infer_into({"x": wide}, {"y": y3})["z"]  # a new shape
    np.testing.assert_array_equal(y3, 2)
    assert z.shape == (4, 3)
    assert runner.infer_into({"x": wide}, {})["y"].tolist() == [[2.0] * 3] * 4  # other names


def test_returned_outputs_outlive_the_next_call():
    runner = OrtRunner(load_cpu(_graph()))
    x, y = np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)
    first = runner.infer_into({"x": x}, {"y": y})["z"]
    x[:] = 5
    runner.infer_into({"x": x}, {"y": y})
    np.testing.assert_array_equal(first, 2)  # its own memory, not the next run's
