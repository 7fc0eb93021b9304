"""Half-precision copies as transformers.js repositories ship them (models/quantize.py kinds
`fp16` and `q4f16`: onnxruntime.transformers.float16's conversion with float32 inputs and
outputs, the second after 4-bit MatMulNBits quantization). ONNX Runtime runs them, yet
before 2026-12-07:

- every padded variant failed to build: the conversion appends its input Casts after the
  nodes that read them, and onnx_ir's clone (like every walk here) reads nodes in order.
  load_model sorts such a graph as it loads;
- head-dim padding was refused on every fp16 graph ("the output projection does not receive
  the widened heads"): the conversion runs onnx's shape inference and leaves its names for
  unknown dims (`unk__N`) on every value, which read as symbols with nothing to infer. They
  are unknown dims now (tuner/graph/dims.py), and inference finds the head's 80;
- the fused variant of an Optimum decoder did not load (tests/test_fused_rotary.py).
"""

from __future__ import annotations

import json

import onnx_ir as ir
import pytest
from serving_support import perturbed_copy

from models.quantize import cached
from tuner.cli import main
from tuner.graph.inspect import inspect_model
from tuner.graph.load import _in_order, load_model


@pytest.mark.parametrize("kind", ["fp16", "q4f16"])
def test_half_precision_copies_optimize_with_every_variant_built(kind, tmp_path):
    src = cached(kind, "llama-kv")
    assert not _in_order(ir.load(src).graph)  # the recipe's own doing, which this test needs
    assert _in_order(load_model(src).graph)
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), "--rounds", "2", "--warmup", "0",
                 "--bucket-rounds", "1", "--no-probe", "--max-variants", "2", "--no-cache",
                 "--max-buckets", "2", "-q", "--no-plots"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    padded = [v for v in manifest["variants"] if v["transforms"] and v["name"] != "last-logits"]
    assert padded and all(v["accuracy"]["passed"] for v in padded), manifest["notes"]


def test_head_dim_pads_a_half_precision_copy_exactly(tmp_path, capsys):
    src, dst = cached("fp16", "llama-kv"), tmp_path / "padded.onnx"
    assert main(["pad", str(src), "-o", str(dst), "--head-dim", "96"]) == 0  # gated: exact
    assert "head_dim 80->96" in capsys.readouterr().out
    assert inspect_model(load_model(dst)).head_dim == 96
    # the gate at fp16 tolerances still catches a wrong copy
    assert main(["verify", str(src), str(perturbed_copy(src, tmp_path / "bad.onnx"))]) == 1


def test_a_q4f16_decoder_batches_its_streams(tmp_path):
    """transformers.js' q4f16 GPT-2: MatMulNBits' fp16 path runs one row and a batch of rows
    apart (5e-4 on the logits, half precision's rounding), which the engine's probe held to
    float32's 1e-5 and took for rows coupled by their run: every stream was served alone. At
    the model's own precision its streams share runs, each the tokens it makes alone."""
    from llm_support import start
    from serving_support import collect, make_artifact

    from serving.sampling import GenerationRequest

    src = cached("q4f16", "gpt2-kv")
    server = start(make_artifact(tmp_path / "out", src))
    try:
        gen = server.slot.engine.generator
        assert gen.rows_stay is None and gen.options.max_streams > 1
        prompts = [(5, 17, 9, 200, 31), (7, 7, 400, 12), (900, 3, 55, 8, 8, 61)]
        requests = [GenerationRequest(p, 10) for p in prompts]
        alone = [collect(gen, [r])[0] for r in requests]
        together = collect(gen, requests)
    finally:
        server.stop(5)
    ids = [[[t for c in chunks for t in c.ids] for chunks in run] for run in (alone, together)]
    assert ids[0] == ids[1]
