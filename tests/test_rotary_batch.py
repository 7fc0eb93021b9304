"""torch's dynamo export at opset 23 of a decoder that computes its own positions: its
RotaryEmbedding nodes take cos/sin caches of one row, which ONNX Runtime does not broadcast
(the graph runs at batch 1 only). Found (tuner.graph.rotary_caches), expanded to the batch
(tuner.rewrite.rotary_batch), checked row by row (tuner.gate.rows_alone), and done first by
`tuner optimize`, `tuner pad`, `tuner verify` and `tuner rebatch`; the artifact serves
batches that equal torch's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from serving_support import infer_inputs, scaled_weight

from models.build import _Wrapper, build_torch_model, cached, spec
from tuner.cli import main
from tuner.gate.feeds import make_feeds
from tuner.gate.rows_alone import RowsAlone, check_rows_alone
from tuner.graph.inspect import inspect_path
from tuner.graph.load import load_model, save_model
from tuner.graph.roles import input_specs
from tuner.graph.rotary_caches import batch_one_rotaries
from tuner.plan.findings import audited
from tuner.rewrite.rotary_batch import expand_rotary_caches
from tuner.runtime.registry import get_backend

ORT = get_backend("ort-cpu")


def _feeds(rows: int = 3, seq: int = 11, seed: int = 1) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    mask = np.ones((rows, seq), np.int64)
    mask[1:2, 7:] = 0  # right padding
    mask[2:3, :4] = 0  # left padding
    return {"input_ids": g.integers(0, 1024, (rows, seq)), "attention_mask": mask}


def _run(path: Path, feeds) -> np.ndarray:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return s.run(["logits"], feeds)[0]


@pytest.fixture(scope="module")
def rebatched(llama_opset23, tmp_path_factory) -> Path:
    model = load_model(llama_opset23)
    assert expand_rotary_caches(model) == 4
    return save_model(model, tmp_path_factory.mktemp("rebatched") / "model.onnx")


def test_found_where_the_caches_hold_one_row_only(llama_opset23, llama_kv_opset23):
    found = batch_one_rotaries(load_model(llama_opset23))
    assert len(found) == 4  # q and k of 2 layers
    assert all(n.op_type == "RotaryEmbedding" for n in found)
    # the cache graph computes its caches from position_ids (B, S): one row per row
    assert batch_one_rotaries(load_model(llama_kv_opset23)) == ()
    # no RotaryEmbedding at opset 18
    assert batch_one_rotaries(load_model(cached("llama", "small", "dynamo"))) == ()
    # and the premise: ONNX Runtime runs the original at batch 1, not at batch 2
    _run(llama_opset23, {k: v[:1] for k, v in _feeds().items()})
    with pytest.raises(Exception, match="cos_cache"):
        _run(llama_opset23, _feeds())


def test_the_rewrite_runs_batches_as_torch_computes_them(llama_opset23, rebatched):
    import torch

    model = _Wrapper(build_torch_model(spec("llama", "small")), True)
    feeds = _feeds()
    got = _run(rebatched, feeds)
    with torch.no_grad():
        want = model(*(torch.tensor(feeds[k]) for k in ("input_ids", "attention_mask"))).numpy()
    keep = feeds["attention_mask"].astype(bool)
    np.testing.assert_allclose(got[keep], want[keep], atol=1e-4, rtol=1e-3)
    # and each row is what the original gives that row alone
    for r in range(3):
        alone = _run(llama_opset23, {k: v[r:r + 1] for k, v in feeds.items()})
        np.testing.assert_array_equal(got[r:r + 1], alone)
    assert batch_one_rotaries(load_model(rebatched)) == ()


def test_the_row_by_row_check_passes_it_and_fails_a_corrupted_copy(llama_opset23, rebatched,
                                                                  tmp_path):
    model = load_model(llama_opset23)
    specs, feeds = input_specs(model), make_feeds(model, 1024)
    assert max(f["input_ids"].shape[0] for f in feeds) == 3
    passed = check_rows_alone(lambda: ORT.load(llama_opset23), lambda: ORT.load(rebatched),
                              feeds, specs)
    assert passed and passed.outputs[0].compared > 0, passed.table()
    broken = scaled_weight(rebatched, tmp_path / "broken.onnx", ("linear",))
    failed = check_rows_alone(lambda: ORT.load(llama_opset23), lambda: ORT.load(broken),
                              feeds, specs)
    assert not failed, failed.table()
    nothing = check_rows_alone(lambda: ORT.load(llama_opset23), lambda: ORT.load(rebatched),
                               [], specs)
    assert not nothing and "nothing compared" in nothing.table()


def test_rows_alone_refuses_outputs_without_a_batch_axis_first():
    class Transposed:
        name = "t"

        def infer(self, feeds):
            return {"y": feeds["x"].T}

        def close(self):
            pass

    from tuner.graph.roles import InputSpec

    rows = RowsAlone(Transposed(), [InputSpec("x", "float32", ("b", 4), batch_axis=0)])
    with pytest.raises(ValueError, match="no batch axis first"):
        rows.infer({"x": np.ones((2, 4), np.float32)})


def test_commands_repair_it_first(llama_opset23, llama_kv_opset23, tmp_path, capsys):
    shape = audited(inspect_path(llama_opset23))
    assert "rotary-caches-one-row" in {f.rule for f in shape.findings}
    # tuner rebatch: written and checked; a graph that needs nothing: exit 2, nothing written
    out = tmp_path / "rebatched.onnx"
    assert main(["rebatch", str(llama_opset23), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["written"] and report["accuracy"]["passed"]
    assert _run(out, _feeds()).shape[0] == 3
    assert main(["rebatch", str(llama_kv_opset23), "-o", str(tmp_path / "kv.onnx")]) == 2
    assert "runs at any batch as it is" in capsys.readouterr().err
    assert not (tmp_path / "kv.onnx").exists()
    # tuner pad: padded and rebatched, gated against the original row by row
    padded = tmp_path / "padded.onnx"
    assert main(["pad", str(llama_opset23), "--ffn-multiple", "64", "-o", str(padded),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["transforms"] == ["ffn 176->192"] and report["rebatched_rotary_nodes"] == 4
    # tuner verify runs the original row by row: the padded copy passes, a corrupted one fails
    assert main(["verify", str(llama_opset23), str(padded)]) == 0
    assert "run on each row of a batch alone" in capsys.readouterr().err
    broken = scaled_weight(padded, tmp_path / "broken.onnx", ("linear",))
    assert main(["verify", str(llama_opset23), str(broken)]) == 1


def test_optimize_serves_batches_of_it(llama_opset23, tmp_path):
    import tritonclient.grpc as tg
    from llm_support import start

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "tuner", "optimize", str(llama_opset23), "-o",
                        str(out), "--max-seq", "64", "--max-batch", "4", "--rounds", "2",
                        "--bucket-rounds", "1", "--max-variants", "1", "--no-probe",
                        "--no-fuse", "--no-cache"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RotaryEmbedding node(s) took one-row cos/sin caches" in r.stdout + r.stderr
    feeds = _feeds(rows=3, seq=11, seed=2)
    server = start(out)
    try:
        client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        got = client.infer(server.slot.name, infer_inputs(feeds)).as_numpy("logits")
    finally:
        server.stop()
    for row in range(3):
        alone = _run(llama_opset23, {k: v[row:row + 1] for k, v in feeds.items()})
        keep = feeds["attention_mask"][row].astype(bool)
        np.testing.assert_allclose(got[row][keep], alone[0][keep], atol=1e-4, rtol=1e-3)


def test_an_original_that_fails_on_the_gates_feeds_is_bad_input(llama_opset23, tmp_path,
                                                                 monkeypatch, capsys):
    """As before the repair (its detection switched off): the original fails at batch 2, so
    no variant can be checked: exit 2 naming the failure, not an internal error in the
    timing stage, and nothing written."""
    import tuner.jobs.optimize as job

    monkeypatch.setattr(job, "batch_one_rotaries", lambda model: ())
    out = tmp_path / "out"
    assert main(["optimize", str(llama_opset23), "-o", str(out), "--no-probe", "--rounds",
                 "2", "--no-cache", "--no-fuse"]) == 2
    err = capsys.readouterr().err
    assert "cannot run the original on the gate's feeds" in err and "cos_cache" in err
    assert list(tmp_path.iterdir()) == []


def test_a_dynamically_quantized_copy_is_checked_with_its_activations_in_float(
        llama_opset23, tmp_path, capsys):
    """ONNX Runtime's quantize_dynamic (MatMuls only: left to quantize the Attention op, it
    writes a QAttention that ONNX Runtime cannot load) quantizes activations over the whole
    run, so a row alone is rounded otherwise than in a batch: rebatch checks the two graphs
    with their activations in float; pad and verify, which would compare rows with a batch,
    say to rebatch first."""
    import onnx
    from onnxruntime.quantization import quantize_dynamic

    from tuner.gate.float_activations import float_copy
    from tuner.jobs.rotary_batch import rebatch_file

    quantized = tmp_path / "q.onnx"
    quantize_dynamic(str(llama_opset23), str(quantized), op_types_to_quantize=["MatMul"])
    result, nodes = rebatch_file(quantized, tmp_path / "rb.onnx")
    assert result and nodes == 4 and result.outputs[0].compared > 0
    # the float check still sees a changed weight: one projection's scale doubled
    proto = onnx.load(str(tmp_path / "rb.onnx"))
    scale = next(i for i in proto.graph.initializer if i.name.endswith("_scale"))
    scale.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(scale) * 2,
                                                scale.name))
    onnx.save(proto, str(tmp_path / "broken.onnx"))
    model = load_model(quantized)
    broken = check_rows_alone(lambda: float_copy(quantized),
                              lambda: float_copy(tmp_path / "broken.onnx"),
                              make_feeds(model, 1024), input_specs(model))
    assert not broken, broken.table()
    assert main(["pad", str(quantized), "--ffn-multiple", "64", "-o",
                 str(tmp_path / "p.onnx")]) == 2
    assert "run `tuner rebatch` on it first" in capsys.readouterr().err
    assert main(["pad", str(tmp_path / "rb.onnx"), "--ffn-multiple", "64", "-o",
                 str(tmp_path / "p.onnx")]) == 0
