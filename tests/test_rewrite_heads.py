"""Head-count padding (zero heads), and all four rewrites composed."""

from __future__ import annotations

import pytest
from rewrite_checks import pad_and_check, weight

from tuner.errors import RewriteRefused
from tuner.graph.inspect import inspect_model, inspect_path
from tuner.graph.load import load_model
from tuner.rewrite.compose import PadRequest, apply

CASES = [(fam, exp) for fam in ("gpt2", "bert") for exp in ("torchscript", "dynamo")]
CASES += [("gpt_neox", "dynamo"), ("llama", "torchscript"), ("llama", "dynamo"),
          ("phi3", "torchscript")]  # phi3: fused QKV with grouped-query attention


@pytest.mark.parametrize("family,exporter", CASES)
def test_head_count_padding_is_exact(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "awkward", exporter)
    before = inspect_path(src)
    dst = tmp_path / "heads.onnx"
    result, after = pad_and_check(src, dst, PadRequest(num_heads=4))
    assert result.transforms == ("heads 2->4",)
    assert (after.num_heads, after.num_kv_heads, after.head_dim, after.hidden_size) == \
        (4, 4 if before.num_kv_heads == before.num_heads else before.num_kv_heads,
         before.head_dim, before.hidden_size)
    o = weight(dst, after.sites.layers[0].attention.o)
    rows = o if o.shape[0] == 4 * 80 else o.T
    assert not rows[160:].any() and rows[:160].any()  # the two new heads add nothing


def test_gqa_keeps_each_query_head_in_its_kv_group(reference_model, tmp_path):
    """Llama-awkward: 2 query heads share 1 kv head; padding to 4 repeats it 4 times."""
    src = reference_model("llama", "awkward", "dynamo")
    _, after = pad_and_check(src, tmp_path / "gqa.onnx", PadRequest(num_heads=4))
    assert (after.num_heads, after.num_kv_heads) == (4, 1)
    k = weight(tmp_path / "gqa.onnx", after.sites.layers[0].attention.k)
    assert k.shape == (160, 80)  # the kv projections are untouched


def test_refusals(reference_model):
    model = load_model(reference_model("llama", "small", "dynamo"))  # 4 heads, 2 kv heads
    with pytest.raises(RewriteRefused, match="must stay a multiple of 2"):
        apply(model, inspect_model(model), PadRequest(num_heads=5))
    model = load_model(reference_model("gpt2", "awkward", "dynamo"))
    with pytest.raises(RewriteRefused, match="cannot pad to the smaller 1"):
        apply(model, inspect_model(model), PadRequest(num_heads=1))


@pytest.mark.parametrize("family,exporter,req,expect", [
    ("gpt2", "torchscript", PadRequest(ffn_size=640, vocab_size=50304, head_dim=96, num_heads=4),
     (640, 50304, 96, 4)),
    ("llama", "dynamo", PadRequest(ffn_size=448, vocab_size=1024, head_dim=128), (448, 1024, 128, 2)),
])
def test_composed(reference_model, tmp_path, family, exporter, req, expect):
    src = reference_model(family, "awkward", exporter)
    result, after = pad_and_check(src, tmp_path / "all.onnx", req)
    assert (after.ffn_size, after.vocab_size, after.head_dim, after.num_heads) == expect
    assert len(result.transforms) == sum(v is not None for v in
                                         (req.ffn_size, req.vocab_size, req.head_dim, req.num_heads))
