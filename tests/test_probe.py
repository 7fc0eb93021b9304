"""The GEMM probe: shapes from model dims, the one-MatMul graphs it times, interleaved ORT CPU
timing, and the torch-cuda backend (skipped with its reason where there is no GPU)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tuner.design.params import FAMILIES, DesignShape, layer_params
from tuner.errors import BadInput
from tuner.hardware.facts import DEVICES
from tuner.plan.probe import (IR_VERSION, GemmShape, backend_unavailable, batched_waves, gemm_model,
                              model_gemms, pool_elements, pool_views, probe, steps)
from tuner.util.progress import Progress

GPU_REASON = backend_unavailable("torch-cuda")


class Recorder(Progress):
    def __init__(self) -> None:
        self.total, self.messages = None, []

    def start(self, total: int) -> None:
        self.total = total

    def advance(self, what: str) -> None:
        self.messages.append(what)


@pytest.mark.parametrize("kwargs,message", [
    (dict(m=0, k=1, n=1), "GemmShape.m must be a positive integer, not 0"),
    (dict(m=1, k=2.0, n=1), "GemmShape.k must be a positive integer, not 2.0"),
    (dict(m=1, k=1, n=1, batch=2), "a linear \\(weight\\) GEMM has batch 1"),
])
def test_gemm_shape_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GemmShape(**kwargs)


@pytest.mark.parametrize("family", ["gpt_neox", "llama"])
def test_model_gemms_match_the_parameter_count(family):
    """The linear GEMMs of a layer hold exactly its weight matrices: 2*M FLOPs per weight."""
    fam = FAMILIES[family]
    s = DesignShape(4, 512, 8, 2 if fam.ffn_gated else 8, 64, 1408, 1000, fam)
    b, seq = 2, 96
    gemms = model_gemms(s, b, seq)
    labels = [g.label for g in gemms]
    assert labels[-1] == "lm_head" and gemms[-1].n == 1000
    assert ("gate" in labels) == fam.ffn_gated
    per_layer = [g for g in gemms if g.label != "lm_head"]
    weights = sum(g.k * g.n for g in per_layer if g.linear)
    no_bias_norm = layer_params(s.with_(family=fam.__class__(
        "x", fam.ffn_gated, False, "rmsnorm", fam.tied))) - 2 * s.hidden_size
    assert weights == no_bias_norm
    assert all(g.m == b * seq for g in per_layer if g.linear)
    attention = [g for g in per_layer if not g.linear]
    assert sum(g.flops for g in attention) == 2 * 2 * b * s.num_heads * seq * seq * s.head_dim
    assert model_gemms(s, b, seq, lm_head=False)[-1].label == "down"


@pytest.mark.parametrize("shape", [GemmShape(5, 7, 3, label="lin"),
                                   GemmShape(4, 6, 5, batch=3, label="bmm", linear=False)])
def test_gemm_model_computes_the_matmul(shape):
    rng = np.random.default_rng(1)
    lead = (shape.batch,) if shape.batch > 1 else ()
    a = rng.standard_normal((*lead, shape.m, shape.k), dtype=np.float32)
    b = rng.standard_normal((*lead, shape.k, shape.n), dtype=np.float32)
    model = gemm_model(shape, b if shape.linear else None)
    assert model.ir_version == IR_VERSION
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"A": a} if shape.linear else {"A": a, "B": b}
    np.testing.assert_allclose(sess.run(None, feeds)[0], a @ b, rtol=1e-5, atol=1e-5)


def test_gemm_model_refuses_a_wrong_weight():
    with pytest.raises(ValueError, match=r"needs a \(7, 3\) weight"):
        gemm_model(GemmShape(5, 7, 3), np.zeros((3, 7), np.float32))


def test_probe_ort_cpu_interleaved_results_in_order():
    shapes = [GemmShape(64, 128, 256, label="a"), GemmShape(16, 32, 16, batch=4, label="att",
                                                           linear=False),
              GemmShape(64, 128, 256, label="a-again"), GemmShape(64, 128, 512, label="wide")]
    rec = Recorder()
    results = probe(shapes, "ort-cpu", rounds=4, warmup=1, threads=1, progress=rec)
    assert [r.shape.label for r in results] == ["a", "att", "a-again", "wide"]
    assert all(len(r.samples_ms) == 4 and r.median_ms > 0 and r.tflops > 0 for r in results)
    assert results[0].samples_ms == results[2].samples_ms  # same kernel call: measured once
    assert rec.total == steps(shapes, 4) == 3 * 5 == len(rec.messages)
    assert all(r.waves is None and r.device == "CPU" for r in results)
    js = results[3].to_json()
    assert js["n"] == 512 and js["backend"] == "ort-cpu" and len(js["samples_ms"]) == 4


def test_probe_bad_input():
    with pytest.raises(BadInput, match="rounds must be >= 1"):
        probe([GemmShape(2, 2, 2)], rounds=0)
    with pytest.raises(BadInput, match="no GEMM shapes"):
        probe([])
    with pytest.raises(BadInput, match="unknown probe backend 'tpu'"):
        probe([GemmShape(2, 2, 2)], backend="tpu")


def test_waves_count_tiles_of_every_batch():
    h100 = DEVICES["h100"]
    w = batched_waves(GemmShape(16384, 2560, 7680), h100)  # 128 x 30 tiles of 128x256
    assert w.tiles == 3840 and w.waves == pytest.approx(3840 / 132)
    assert w.efficiency == pytest.approx(3840 / (30 * 132))
    att = batched_waves(GemmShape(2048, 80, 2048, batch=256, linear=False), h100)
    assert att.tiles == 256 * 16 * 8
    assert batched_waves(GemmShape(4, 4, 4), DEVICES["cpu"]) is None


@pytest.mark.skipif(GPU_REASON is None, reason="a GPU is present: the no-GPU path cannot run")
def test_torch_cuda_without_gpu_is_bad_input_with_the_reason():
    with pytest.raises(BadInput, match="probe backend torch-cuda cannot run here: .*(GPU|torch)"):
        probe([GemmShape(8, 8, 8)], backend="torch-cuda")


@pytest.mark.gpu
@pytest.mark.skipif(GPU_REASON is not None, reason=f"torch-cuda probe: {GPU_REASON}")
def test_torch_cuda_probe_on_a_gpu():
    shapes = [GemmShape(4096, 2560, 7680, label="qkv"),
              GemmShape(2048, 80, 2048, batch=64, label="scores", linear=False)]
    results = probe(shapes, "torch-cuda", rounds=3, warmup=2)
    assert all(r.waves is not None and r.waves.tiles > 0 for r in results)
    assert results[0].tflops > 1  # any tensor-core GPU does over 1 TFLOP/s at this size


@pytest.mark.parametrize("shape", [GemmShape(6, 5, 7, label="lin"),
                                   GemmShape(4, 3, 5, batch=3, label="bmm", linear=False)])
def test_gpu_pool_views_are_disjoint_operands_that_multiply(shape):
    """The GPU probe's shared buffers, exercised with CPU tensors: A and B never overlap, and
    torch.matmul(A, B, out=Y) is the GEMM of the shape (the same call the timer makes)."""
    torch = pytest.importorskip("torch")
    others = [GemmShape(2, 2, 2), GemmShape(8, 8, 8, batch=2, linear=False)]
    n_in, n_out = pool_elements([shape] + others)
    src = torch.randn(n_in, dtype=torch.float64)
    dst = torch.full((n_out,), float("nan"), dtype=torch.float64)
    a, b, y = pool_views(shape, src, dst)
    lead = (shape.batch,) if not shape.linear else ()
    assert a.shape == (*lead, shape.m, shape.k) and b.shape == (*lead, shape.k, shape.n)
    end_a = a.storage_offset() + a.numel()
    assert b.storage_offset() >= end_a  # B starts after A ends (a transposed view keeps its offset)
    torch.matmul(a, b, out=y)
    assert torch.allclose(y, a.clone() @ b.clone())
    assert y.data_ptr() == dst.data_ptr()  # written in place into the shared output buffer
