"""Vocabulary padding: the LM head GEMM runs padded, the logits keep their name and shape."""

from __future__ import annotations

import pytest
from rewrite_checks import pad_and_check

from tuner.errors import RewriteRefused
from tuner.graph.inspect import inspect_path
from tuner.graph.load import load_model
from tuner.rewrite.common import find_node
from tuner.rewrite.compose import PadRequest

CASES = [(fam, exp) for fam in ("gpt2", "llama") for exp in ("torchscript", "dynamo")]
CASES += [("gpt_neox", "torchscript"), ("qwen2", "dynamo")]


@pytest.mark.parametrize("family,exporter", CASES)
def test_vocab_padding_is_exact(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "awkward", exporter)
    before = inspect_path(src)
    req = PadRequest.from_multiples(before, vocab_multiple=64)
    new = 50304 if family == "gpt2" else 1024
    assert req == PadRequest(vocab_size=new)
    dst = tmp_path / "vocab.onnx"
    result, after = pad_and_check(src, dst, req)
    assert result.transforms == (f"vocab {before.vocab_size}->{new}",)
    assert after.vocab_size == new
    assert after.sites.tied == before.sites.tied  # a tied embedding is padded with the head
    assert (after.ffn_size, after.head_dim) == (before.ffn_size, before.head_dim)
    # The head's GEMM itself is padded; a Slice right after it cuts the logits back.
    model = load_model(dst)
    head = find_node(model.graph, after.sites.lm_head)
    users = [u.node.op_type for u in head.outputs[0].uses()]
    assert users == ["Slice"]


def test_tied_embedding_stays_shared(reference_model, tmp_path):
    """Dynamo GPT-2 reads one initializer for the embedding Gather and (transposed) the head."""
    src = reference_model("gpt2", "awkward", "dynamo")
    before = inspect_path(src)
    assert before.sites.tied
    _, after = pad_and_check(src, tmp_path / "v.onnx", PadRequest(vocab_size=50304))
    model = load_model(tmp_path / "v.onnx")
    table = model.graph.initializers[after.sites.embedding]
    assert tuple(table.const_value.shape) == (50304, 160)
    readers = {u.node.op_type for u in table.uses()}
    assert readers == {"Gather", "Transpose"}  # still one tensor for both


def test_encoder_has_no_vocab_to_pad(reference_model):
    shape = inspect_path(reference_model("bert", "awkward", "torchscript"))
    with pytest.raises(RewriteRefused, match="no LM head"):
        PadRequest.from_multiples(shape, vocab_multiple=64)


def test_hidden_size_is_refused_with_the_reason(reference_model):
    shape = inspect_path(reference_model("llama", "awkward", "dynamo"))
    with pytest.raises(RewriteRefused, match="LayerNorm/RMSNorm statistics"):
        PadRequest.from_multiples(shape, hidden_multiple=64)
    with pytest.raises(Exception, match="vocab_size must be a positive integer"):
        PadRequest(vocab_size=0)
