"""Shapes where ONNX Runtime's symbolic shape inference stops (tuner.graph.dims): it asserts
on an Expand in Optimum's Cohere export and gives no shapes at all; onnx's own inference
then gives every value its rank, so `pad` widens the FFN (it stopped with "rank of its
output unknown") and is exact."""

from __future__ import annotations

import pytest
from test_conformance import _run  # the CLI in-process: (exit code, stdout, stderr)

from models import optimum
from tuner.graph import dims
from tuner.graph.load import load_model

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)


def test_onnx_inference_gives_the_ranks_where_ort_stops(tmp_path) -> None:
    src = optimum.cached("cohere")
    model = load_model(src)
    with pytest.raises(AssertionError):  # ORT's, on the light copy inspect gives it
        dims._symbolic_shape_inference().infer_shapes(dims._light_proto(model), auto_merge=True,
                                                      guess_output_rank=True)
    assert len(dims.infer_symbolic(model)["/model/layers.0/mlp/up_proj/MatMul_output_0"]) == 3
    code, out, err = _run(["pad", str(src), "-o", str(tmp_path / "p.onnx"), "--vocab-multiple",
                           "64", "--ffn-multiple", "64"])
    assert code == 0 and "ffn 200->256" in out, err + out[-2000:]
    code, out, err = _run(["verify", str(src), str(tmp_path / "p.onnx")])
    assert code == 0 and "PASS" in out, err + out[-2000:]
