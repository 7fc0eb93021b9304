"""Every rewrite on the aligned "small" shapes (the other rewrite tests use "awkward" ones).

Here sizes coincide: GPT-2 and BERT small have FFN width 256 = the 256 positions (and = 4 x the
hidden 64), so a constant that only looks like the FFN width sits in every graph; dynamo
shares one shape constant between layers. Each variant passes the gate and the structural
checks of tests/rewrite_checks.py."""

from __future__ import annotations

import pytest
from rewrite_checks import pad_and_check, weight

from tuner.graph.inspect import inspect_path
from tuner.graph.load import load_model
from tuner.rewrite.common import find_node
from tuner.rewrite.compose import PadRequest

CASES = [(fam, exp) for fam in ("gpt2", "bert", "llama") for exp in ("torchscript", "dynamo")]


def _others_unchanged(before, after, *skip: str) -> None:
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size",
                 "vocab_size"):
        if name not in skip:
            assert getattr(after, name) == getattr(before, name), name


def test_gpt2_small_dynamo_ffn_to_320(reference_model, tmp_path):
    """The serving engineer's case: FFN 256 -> 320 on dynamo's GPT-2 small, where one shape
    constant is read by both layers' reshapes and 256 is also the position count."""
    src = reference_model("gpt2", "small", "dynamo")
    before = inspect_path(src)
    assert (before.ffn_size, before.hidden_size) == (256, 64)
    result, after = pad_and_check(src, tmp_path / "ffn.onnx", PadRequest(ffn_size=320))
    assert result.transforms == ("ffn 256->320",)
    assert after.ffn_size == 320
    _others_unchanged(before, after, "ffn_size")
    for layer in after.sites.layers:  # every layer padded, each with its own zero rows
        down = weight(tmp_path / "ffn.onnx", layer.ffn.down)
        rows = down[256:] if down.shape[0] == 320 else down[:, 256:]
        assert rows.size and not rows.any()


@pytest.mark.parametrize("family,exporter", CASES)
def test_ffn_small(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "small", exporter)
    before = inspect_path(src)
    dst = tmp_path / "ffn.onnx"
    result, after = pad_and_check(src, dst, PadRequest(ffn_size=320))
    assert result.transforms == (f"ffn {before.ffn_size}->320",)
    assert after.ffn_size == 320 and after.ffn_gated == before.ffn_gated
    _others_unchanged(before, after, "ffn_size")
    down = weight(dst, after.sites.layers[-1].ffn.down)
    rows = down[before.ffn_size:] if down.shape[0] == 320 else down[:, before.ffn_size:]
    assert rows.size and not rows.any()


@pytest.mark.parametrize("family,exporter", [c for c in CASES if c[0] != "bert"])
def test_vocab_small(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "small", exporter)
    before = inspect_path(src)
    new = 50304 if family == "gpt2" else 1088
    dst = tmp_path / "vocab.onnx"
    result, after = pad_and_check(src, dst, PadRequest(vocab_size=new))
    assert result.transforms == (f"vocab {before.vocab_size}->{new}",)
    assert after.vocab_size == new and after.sites.tied == before.sites.tied
    _others_unchanged(before, after, "vocab_size")
    head = find_node(load_model(dst).graph, after.sites.lm_head)
    assert [u.node.op_type for u in head.outputs[0].uses()] == ["Slice"]


@pytest.mark.parametrize("family,exporter", CASES)
def test_head_dim_small(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "small", exporter)
    before = inspect_path(src)
    assert before.head_dim == 16
    dst = tmp_path / "hd.onnx"
    result, after = pad_and_check(src, dst, PadRequest(head_dim=32))
    assert result.transforms == ("head_dim 16->32",)
    assert after.head_dim == 32
    _others_unchanged(before, after, "head_dim")
    o = weight(dst, after.sites.layers[0].attention.o)
    rows = o if o.shape[0] == before.num_heads * 32 else o.T
    per_head = rows.reshape(before.num_heads, 32, -1)
    assert not per_head[:, 16:].any() and per_head[:, :16].any()
    assert after.sites.layers[0].attention.scale.value == pytest.approx(0.25, rel=1e-5)


@pytest.mark.parametrize("family,exporter", CASES)
def test_heads_small(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "small", exporter)
    before = inspect_path(src)
    assert before.num_heads == 4
    dst = tmp_path / "heads.onnx"
    result, after = pad_and_check(src, dst, PadRequest(num_heads=6))  # llama: 2 kv groups of 3
    assert result.transforms == ("heads 4->6",)
    assert (after.num_heads, after.num_kv_heads) == \
        (6, before.num_kv_heads if before.num_kv_heads != 4 else 6)
    _others_unchanged(before, after, "num_heads", "num_kv_heads")
    o = weight(dst, after.sites.layers[-1].attention.o)
    rows = o if o.shape[0] == 6 * 16 else o.T
    zero_heads = [not h.any() for h in rows.reshape(6, 16, -1)]
    assert sum(zero_heads) == 2  # two new heads add nothing, the four old ones are all there
