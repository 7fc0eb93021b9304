"""ONNX Runtime's fused com.microsoft.RotaryEmbedding, as its transformer optimizer writes it
on Optimum's Llama (ORT's optimizer run by hand, Olive's transformer-optimization pass, and
shapetuner's own fused candidate): the op takes position_ids and constant cos/sin caches of
half a head each.

- head-dim padding widens the caches and pads each head per half, exactly, in float32 and in
  float16 (refused before 2026-12-07: "no inverse-frequency table ... upstream of Cos/Sin");
- where the graph has no position_ids input, the positions are expanded to a row per batch
  row (the fused op failed at batch 2);
- on a half-precision copy the fused graph loads: the optimizer computes the caches in
  float32 beside float16 activations, and they are made the activations' type
  (tuner/runtime/ort_fusion.py; the fused model did not load before).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models import optimum
from models.quantize import _half
from tuner.gate.feeds import make_feeds
from tuner.graph.inspect import inspect_path
from tuner.jobs.pad import pad_file
from tuner.rewrite.compose import PadRequest
from tuner.runtime.ort_fusion import fuse_file

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)


def _fused(tmp_path, half: bool):
    src = optimum.cached("llama", optimum.TASKS[0])
    if half:
        src = tmp_path / "model_fp16.onnx"
        _half(onnx.load(optimum.cached("llama", optimum.TASKS[0])), src)
    fused = tmp_path / "fused.onnx"
    assert fuse_file(src, fused, num_heads=4, hidden_size=96)["RotaryEmbedding"] == 4
    return src, fused


@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_head_dim_padding_widens_a_fused_rotary_exactly(tmp_path, half):
    _, fused = _fused(tmp_path, half)
    dst = tmp_path / "padded.onnx"
    result = pad_file(fused, dst, PadRequest(head_dim=32))  # gated: rollouts with the cache
    assert result.accuracy.passed and max(o.max_abs for o in result.accuracy.outputs) == 0
    assert inspect_path(dst).head_dim == 32
    caches = [t for t in onnx.load(dst).graph.initializer if t.name.startswith("cos_cache")]
    assert caches and all(t.dims[-1] == 16 for t in caches)  # half of the new head


def test_a_half_precision_fused_rotary_loads_and_runs(tmp_path):
    half, fused = _fused(tmp_path, half=True)
    caches = {t.name: t.data_type for t in onnx.load(fused).graph.initializer
              if t.name in ("cos_cache", "sin_cache")}
    assert caches == {"cos_cache": onnx.TensorProto.FLOAT16, "sin_cache": onnx.TensorProto.FLOAT16}
    (feeds,) = make_feeds(half, 1003, [(2, 9)], seed=3)
    runs = [ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
            for p in (half, fused)]  # (2, 9, 1003) each
    a, b = (r.reshape(-1).astype(np.float64) for r in runs)
    assert a @ b / np.linalg.norm(a) / np.linalg.norm(b) > 0.999


def test_optimums_fp16_export_fused_passes_the_gate(tmp_path):
    """Optimum's own half-precision export (`--dtype fp16`): the fused graph is the variant
    optimize could never offer; it passes the gate's rollouts at fp16 tolerances."""
    from tuner.cli import main

    src, fused = optimum.cached("llama", optimum.FP16_TASK), tmp_path / "fused.onnx"
    assert fuse_file(src, fused, num_heads=4, hidden_size=96)["RotaryEmbedding"] == 4
    assert main(["verify", str(src), str(fused)]) == 0


def test_a_fused_rotary_without_position_ids_runs_every_row(tmp_path):
    """Optimum's Gemma has no position_ids input: its positions, arange(past, past + seq), are
    one row for every batch row, and the optimizer handed that (1, seq) to each fused
    RotaryEmbedding, which wants a row per batch row: the fused variant failed the gate at
    batch 2 on Gemma, Gemma 2 and Nemotron. The positions are expanded to the batch first."""
    from tuner.cli import main

    src, fused = optimum.cached("gemma", optimum.TASKS[0]), tmp_path / "fused.onnx"
    assert "position_ids" not in {i.name for i in onnx.load(src).graph.input}
    assert fuse_file(src, fused, num_heads=4, hidden_size=64)["RotaryEmbedding"] == 4
    assert main(["verify", str(src), str(fused)]) == 0  # rollouts at batch 2 and more
