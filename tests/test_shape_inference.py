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


def test_a_graph_is_inferred_once_a_process_and_an_edited_one_afresh(reference_model) -> None:
    """optimize and pad ask for the same graph's shapes from model objects of their own: the
    answer is kept by the light graph's bytes. Another load of the file is answered from it;
    a graph edited after (its batch fixed at 3) is inferred again, and its logits say 3."""
    import onnx_ir as ir

    src = reference_model("llama", "awkward", "torchscript")
    dims._inferred_from.cache_clear()
    first = dims.infer_symbolic(load_model(src))
    assert dims.infer_symbolic(load_model(src)) is first  # the same graph: not inferred again
    assert dims._inferred_from.cache_info().misses == 1
    edited = load_model(src)
    ids = next(v for v in edited.graph.inputs if v.name == "input_ids")
    ids.shape = ir.Shape([3, ids.shape[1]])
    logits = edited.graph.outputs[0].name
    assert dims.infer_symbolic(edited)[logits][0] == 3 != first[logits][0]
    assert dims._inferred_from.cache_info().misses == 2
    with pytest.raises(TypeError):  # one answer shared by every caller: read-only
        first[logits] = (1,)  # type: ignore[index]
