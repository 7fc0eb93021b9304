"""Optimum's own quantization of its own export: `ORTQuantizer` with
`AutoQuantizationConfig.avx512_vnni(is_static=False, per_channel=...)`, what `optimum-cli
onnxruntime quantize --avx512_vnni [--per_channel]` runs (models/optimum.py `quantized`). It
quantizes more than ONNX Runtime's `quantize_dynamic` does by default: attention's activation
MatMuls too (q @ k^T and probs @ v become MatMulInteger of two DynamicQuantizeLinear outputs,
then Cast -> Mul), and the embedding's Gather.

Before 2026-12-05 every command stopped at "no attention" on both, and per-channel weights
were refused. Now, on Llama (both ways), Phi-3 (per channel: its fused gate+up) and GPT-2:
- inspect finds the same dims and cache as in the float export, the softmax scale the
  constant it is (the dequantizing Mul is not taken for a scale);
- the gate passes each on itself and FAILS a corrupted copy;
- vocab and FFN padding are exact, per tensor and per column (new columns: zero point 0,
  weight 0, and the weight-scale vector the dequantizing Mul multiplies in grown by 0s);
- optimize writes an artifact, and the engine generates from it what a plain greedy loop on
  the quantized export gives (the engine's start check finds its rows coupled, so it runs
  each stream alone).
"""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
from greedy_loops import greedy_cache
from serving_support import collect, perturbed_copy

from models import optimum
from serving.generation import GenerateOptions, Generator
from serving.sampling import GenerationRequest
from tuner.cli import main
from tuner.graph.cache_record import cache_record
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model
from tuner.rewrite.common import const_array
from tuner.runtime.ort import OrtRunner, load_cpu

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size",
        "vocab_size")


# (family, per channel): Llama both ways, Phi-3's fused gate+up per channel (its two halves'
# scales move apart), GPT-2 (Conv1D weights, a Div for the scale)
CELLS = [("llama", False), ("llama", True), ("phi3", True), ("gpt2", False)]


@pytest.fixture(scope="module", params=CELLS,
                ids=[f"{f}-{'per-channel' if pc else 'per-tensor'}" for f, pc in CELLS])
def quantized(request):
    family, per_channel = request.param
    return optimum.quantized(family, per_channel=per_channel), per_channel, family


def test_inspect_reads_attention_through_quantized_activation_matmuls(quantized):
    path, _, family = quantized
    model = load_model(path)
    activations = [n for n in model.graph if n.op_type == "MatMulInteger" and all(
        i.producer() is not None and i.producer().op_type == "DynamicQuantizeLinear"
        for i in n.inputs[:2])]
    # q @ k^T and probs @ v in each of the 2 layers (and Llama's inv_freq @ positions, whose
    # product the rotary cos/sin are made of: quantized too)
    assert len([n for n in activations if "attn" in n.name]) == 4
    shape, float_shape = inspect_model(model), inspect_model(load_model(optimum.cached(family)))
    assert [getattr(shape, k) for k in DIMS] == [getattr(float_shape, k) for k in DIMS]
    assert shape.cache.num_layers == float_shape.cache.num_layers
    scale, float_scale = (s.sites.layers[0].attention.scale for s in (shape, float_shape))
    assert (scale.kind, scale.value) == (float_scale.kind, pytest.approx(float_scale.value))


def test_gate_passes_it_on_itself_and_fails_a_corrupted_copy(quantized, tmp_path, capsys):
    path, _, _ = quantized
    assert main(["verify", str(path), str(path)]) == 0
    assert main(["verify", str(path), str(perturbed_copy(path, tmp_path / "bad.onnx"))]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_vocab_and_ffn_padding_are_exact_per_tensor_and_per_column(quantized, tmp_path):
    path, per_channel, family = quantized
    out = tmp_path / "pad.onnx"
    assert main(["pad", str(path), "-o", str(out), "--vocab-multiple", "64",
                 "--ffn-multiple", "64"]) == 0  # gated: greedy rollouts against the original
    padded = load_model(out)
    shape = inspect_model(padded)
    assert (shape.vocab_size, shape.ffn_size) == (1024, 256)
    up = next(n for n in padded.graph if n.name == shape.sites.layers[0].ffn.up)
    w, zp = const_array(up.inputs[1]), const_array(up.inputs[3])
    halves = 2 if family == "phi3" else 1  # gate and up in one weight: each half padded
    new = np.r_[200:256, 456:512] if halves == 2 else np.r_[200:256]
    assert w.shape[1] == 256 * halves and not w[:, new].any()  # new columns: weight 0 ...
    if per_channel:  # ... each column its own zero point and weight scale, 0 there
        assert zp.shape == (256 * halves,) and not zp[new].any()
        tail = [u.node for u in up.outputs[0].uses()][0]  # Cast -> Mul(x_scale * w_scale)
        mul = [u.node for u in tail.outputs[0].uses()][0]
        scales = next(c for c in (const_array(v) for v in mul.inputs[1].producer().inputs)
                      if c is not None).reshape(-1)
        old = np.setdiff1d(np.arange(256 * halves), new)
        assert scales.shape == (256 * halves,) and not scales[new].any() and scales[old].all()


def _plain(path, prompt: list[int], steps: int) -> list[int]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return greedy_cache(sess, np.array([prompt]), steps).tokens[0].tolist()


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-tensor", "per-channel"])
def test_optimize_then_the_engine_equals_a_plain_greedy_loop(per_channel, tmp_path):
    path = optimum.quantized("llama", per_channel=per_channel)
    out = tmp_path / "out"
    assert main(["optimize", str(path), "-o", str(out), "--rounds", "2", "--warmup", "0",
                 "--bucket-rounds", "1", "--no-probe", "--no-fuse", "--max-variants", "2",
                 "--no-cache", "--max-buckets", "2", "-q", "--no-plots"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    served = out / next(v["path"] for v in manifest["variants"]
                        if v["name"] == manifest["selected"])
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 1000, int(k)).tolist() for k in (4, 11, 19)]
    gen = Generator(OrtRunner(load_cpu(served)), cache_record(load_model(served)), 1003,
                    GenerateOptions(max_streams=4), max_positions=128)
    try:
        streams = collect(gen, [GenerationRequest(tuple(p), 10) for p in prompts])  # at once
        got = [[t for c in chunks for t in c.ids] for chunks in streams]
        assert gen.options.max_streams == 1  # its rows are coupled: one stream at a time
    finally:
        gen.close()
    assert got == [_plain(path, p, 10) for p in prompts]
