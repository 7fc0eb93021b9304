"""Shape findings: each docs/design.md guideline fires on the shapes it is about, stays quiet on
aligned ones, and says what to change."""

from __future__ import annotations

import pytest

from tuner.errors import BadInput
from tuner.graph.shape import Finding, ModelShape
from tuner.hardware.facts import device_facts
from tuner.plan.findings import audit, gemm_shapes


def shape(**kw) -> ModelShape:
    base = dict(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=12, head_dim=64,
                ffn_size=3072, ffn_gated=False, vocab_size=50304)
    return ModelShape(**{**base, **kw})


def rules(found: tuple[Finding, ...]) -> dict[str, Finding]:
    return {f.rule: f for f in found}


def test_aligned_model_has_no_findings_on_cpu():
    assert audit(shape(), device_facts("cpu"), 4096) == ()


def test_gpt2_vocab_is_flagged_with_the_padded_size():
    f = rules(audit(shape(vocab_size=50257), device_facts("cpu"), 4096))["vocab-multiple-64"]
    assert f.severity == "warning" and "50304" in f.message and "50257" in f.message


def test_head_dim_80_is_a_multiple_of_16_and_has_a_fused_kernel():
    found = rules(audit(shape(hidden_size=2560, num_heads=32, num_kv_heads=32, head_dim=80,
                              ffn_size=10240), device_facts("a100"), 4096))
    assert "head-dim-multiple-64" in found and "128" in found["head-dim-multiple-64"].message
    assert "attention-kernel" not in found  # 80 is in ORT's fused list
    assert "head-dim-multiple-8" not in found


def test_head_dim_not_a_multiple_of_8_is_an_error():
    found = rules(audit(shape(hidden_size=600, num_heads=30, num_kv_heads=30, head_dim=20),
                        device_facts("h100"), 4096))
    assert found["head-dim-multiple-8"].severity == "error"
    assert "24" in found["head-dim-multiple-8"].message
    kernel = found["attention-kernel"]
    assert "32" in kernel.message  # next fused size, and FlashAttention's rounding


def test_heads_a_rewrite_keeps_are_audited_without_a_pad_remedy():
    """An encoder-decoder's decoder keeps its heads (its cross-attention cache crosses
    files): the head-dim findings still say what the hardware wants, and that this tool does
    not pad them, never "pad each head" (inspect's remedy would be refused)."""
    found = rules(audit(shape(hidden_size=600, num_heads=30, num_kv_heads=30, head_dim=20,
                              cross_attention=2), device_facts("h100"), 4096))
    for rule in ("head-dim-multiple-8", "attention-kernel"):
        assert "not padded here" in found[rule].message and "cross-attention" in found[rule].message
        assert "pad each head" not in found[rule].message and "pad to 32" not in found[rule].message


def test_swiglu_width_names_the_search_around_8_3_h():
    f = rules(audit(shape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                          ffn_size=10922, ffn_gated=True, vocab_size=32000),
                    device_facts("h100"), 4096))["ffn-multiple-64"]
    assert "10944" in f.message and "8/3*h" in f.message


def test_hidden_size_is_reported_but_never_padded():
    f = rules(audit(shape(hidden_size=1000, num_heads=8, num_kv_heads=8, head_dim=125),
                    device_facts("cpu"), 4096))["hidden-never-padded"]
    assert f.severity == "info" and "never padded" in f.message


def test_wave_quantization_counts_tiles_against_the_sms():
    # N=3072 at M=4096 on an A100: 32 x 12 = 384 tiles, 108 SMs -> 3.56 waves (89% busy): fine.
    # N=2176 on an H100: 32 x 9 = 288 tiles, 132 SMs -> 2.18 waves, 73% busy: flagged.
    found = audit(shape(ffn_size=2176), device_facts("h100"), 4096)
    waves = [f for f in found if f.rule == "wave-quantization"]
    assert any("N=2176" in f.message and "288 tiles" in f.message for f in waves)
    assert not [f for f in audit(shape(), device_facts("a100"), 4096)
                if f.rule == "wave-quantization"]
    # A CPU has no SMs: no wave findings at all.
    assert not [f for f in audit(shape(ffn_size=2176), device_facts("cpu"), 4096)
                if f.rule == "wave-quantization"]


def test_small_gemms_are_reported_once_as_under_one_wave():
    found = [f for f in audit(shape(hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16,
                                    ffn_size=256, vocab_size=1024), device_facts("h100"), 512)
             if f.rule == "wave-quantization"]
    assert len(found) == 1 and "less than one wave" in found[0].message


def test_gemm_shapes_follow_gqa():
    g = dict((n, (k, v)) for n, k, v in gemm_shapes(
        shape(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32000)))
    assert g["q"] == (4096, 4096) and g["k/v"] == (4096, 1024) and g["lm_head"] == (4096, 32000)


def test_unknown_device_is_bad_input():
    with pytest.raises(BadInput, match="unknown device 'tpu'"):
        device_facts("tpu")


def test_finding_severity_is_validated():
    with pytest.raises(ValueError, match="severity must be info|warning|error"):
        Finding("x", "fatal", "y")  # type: ignore[arg-type]
