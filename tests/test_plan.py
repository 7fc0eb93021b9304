"""Candidates from shapes and device facts; prediction with the GEMM probe; pruning."""

from __future__ import annotations

import pytest

from tuner.graph.paddable import Transform
from tuner.graph.shape import ModelShape
from tuner.hardware.facts import DEVICES
from tuner.plan.propose import Candidate, dim_options, predict, propose, prune, with_fusion

GPU, CPU = DEVICES["a100"], DEVICES["cpu"]


def shape(**kw) -> ModelShape:
    base = dict(num_layers=2, hidden_size=160, num_heads=2, num_kv_heads=2, head_dim=80,
                ffn_size=600, ffn_gated=False, vocab_size=50257)
    base.update(kw)
    return ModelShape(**base)


def test_dim_options():
    assert dim_options("vocab", 50257, GPU) == [50264, 50272, 50304]
    assert dim_options("vocab", 50304, GPU) == []  # already a multiple of 64
    assert dim_options("head_dim", 80, GPU) == [96, 128]
    assert dim_options("head_dim", 64, GPU) == []
    # SwiGLU at h=4096: the widths the measurements favour are proposed
    swiglu = dim_options("ffn", 10922, GPU, gated=True, hidden=4096)
    assert {10944, 11008} <= set(swiglu) and max(swiglu) <= 10922 * 1.1
    assert all(o > 600 for o in dim_options("ffn", 600, GPU))


def test_propose_names_and_combination():
    cands = propose(shape(), GPU, fuse=True)
    names = [c.name for c in cands]
    assert names[0] == "original" and cands[0].transforms == ()
    assert len(set(names)) == len(names)
    assert "vocab-50304" in names and "head_dim-128" in names and "fuse" in names
    combo = next(c for c in cands if len(c.transforms) == 3)
    assert combo.name == "ffn-640+vocab-50304+head_dim-128"
    assert combo.pads == {"ffn": 640, "vocab": 50304, "head_dim": 128}
    assert with_fusion(combo).name == combo.name + "+fuse" and with_fusion(combo).fused
    # nothing to pad: only the original
    aligned = shape(head_dim=64, hidden_size=128, ffn_size=512, vocab_size=1024)
    assert [c.name for c in propose(aligned, GPU)] == ["original"]
    # an encoder has no vocab candidates
    assert not any(c.name.startswith("vocab") for c in propose(shape(vocab_size=None), GPU))


def flops_cost(gemms) -> list[float]:
    """A cost model in which time is FLOPs: padding can only cost."""
    return [g.flops * 1e-9 for g in gemms]


def test_predict_with_a_cost_model():
    s = shape()
    cands = propose(s, GPU)
    pred = {c.name: c.predicted for c in predict(s, cands, 1, 64, flops_cost)}
    assert pred["original"] == pytest.approx(1.0)
    assert all(v < 1.0 for k, v in pred.items() if k != "original")
    # a wider vocab costs in proportion to the LM head's share
    assert pred["vocab-50264"] > pred["vocab-50304"]


def test_predict_with_the_real_probe():
    from tuner.plan.probe import probe

    s = shape(num_layers=1, hidden_size=64, num_heads=2, head_dim=32, ffn_size=200, vocab_size=1000)
    cands = [Candidate("original", ()), Candidate("vocab-1024", (Transform("vocab", 1000, 1024),))]
    out = predict(s, cands, 1, 16,
                  lambda g: [r.samples_ms for r in probe(g, "ort-cpu", rounds=5, warmup=1, min_sample_ms=1)])
    assert out[0].predicted == pytest.approx(1.0)
    assert 0.2 < out[1].predicted < 5  # a measured ratio, not a constant
    assert out[1].predicted_high >= out[1].predicted  # with its interval from paired rounds


def test_prune_keeps_a_candidate_whose_slowdown_is_inside_the_noise():
    noisy = Candidate("vocab-1024", (Transform("vocab", 1000, 1024),), predicted=0.90,
                      predicted_high=1.04)
    sure = Candidate("ffn-256", (Transform("ffn", 200, 256),), predicted=0.90, predicted_high=0.95)
    kept, notes = prune([Candidate("original", (), predicted=1.0), noisy, sure], max_variants=4)
    assert [c.name for c in kept] == ["original", "vocab-1024"]
    assert notes == ["pruned ffn-256: the GEMM probe predicts 0.900x (95% interval up to 0.950x)"]


def _c(name: str, kind: str, new: int, pred: float | None) -> Candidate:
    return Candidate(name, (Transform(kind, 1, new),), predicted=pred)


def test_prune():
    cands = [Candidate("original", (), predicted=1.0), _c("vocab-50264", "vocab", 50264, 1.01),
             _c("vocab-50304", "vocab", 50304, 1.02), _c("ffn-608", "ffn", 608, 0.90),
             _c("head_dim-96", "head_dim", 96, 1.00),
             Candidate("a+b", (Transform("vocab", 1, 50304), Transform("ffn", 1, 640)), predicted=1.05)]
    kept, notes = prune(cands, max_variants=3)
    assert [c.name for c in kept] == ["original", "a+b", "vocab-50304"]
    assert any("pruned ffn-608" in n for n in notes)
    assert any("dropped vocab-50264 (predicted 1.010x): vocab-50304 ranks higher (predicted 1.020x)" in n
               for n in notes)
    assert any("dropped head_dim-96: over the limit" in n for n in notes)
    # without predictions the multiple of 64 is preferred
    kept, _ = prune([cands[0], _c("v8", "vocab", 50264, None), _c("v64", "vocab", 50304, None)], 4)
    assert [c.name for c in kept] == ["original", "v64"]
    assert [c.name for c in prune(cands, max_variants=1)[0]] == ["original"]


def test_advice_reshapes_and_measurement():
    from tuner.plan.advise import measure_advice, reshapes
    from tuner.plan.probe import probe

    # GPT-3 2.7B / Pythia-2.8B: h=2560, a=32, d=80 -> fewer, wider heads
    names = [r.name for r in reshapes(shape(hidden_size=2560, num_heads=32, num_kv_heads=32, head_dim=80))]
    assert names == ["heads-40x64", "heads-20x128"]
    assert [r.name for r in reshapes(shape())] == ["hidden-192"]  # h=160 -> 192, heads of 64
    assert reshapes(shape(hidden_size=128, num_heads=2, head_dim=64)) == []
    small = shape(num_layers=1, hidden_size=96, num_heads=2, num_kv_heads=2, head_dim=48,
                  ffn_size=384, vocab_size=500)
    adv = measure_advice(small, 1, 16, lambda g, rounds: probe(g, "ort-cpu", rounds=rounds,
                                                               warmup=1, min_sample_ms=1), rounds=5)
    assert [a.name for a in adv] == ["hidden-128"]
    sp = adv[0].speedup
    assert 0 < sp.low <= sp.ratio <= sp.high and "retraining" in adv[0].note
