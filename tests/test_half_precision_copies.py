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
