"""The families users bring beyond the reference ones: inspect reads each one's config back
from its graph, and the exact rewrites pass the gate on it, or refuse with a reason naming a
node. Every family is exported by both torch exporters (models/build.py, cached).

What each family adds to the patterns the reference models show:
- mistral: sliding-window mask; gemma: head dim != h/a, scaled tied embedding, GeGLU;
  gemma2: attention and final logit soft-capping; gemma3: q/k RMSNorm over the head dim;
- opt: embeddings projected in and out (h != embedding width), post-LayerNorm, ReLU;
- falcon: k and v picked out of a grouped fused qkv by constant index (Gather / GatherND);
- gptj: interleaved partial rotary from a precomputed sin/cos table;
- bloom: ALiBi, probabilities reshaped to (B*a, S, S) before the value MatMul;
- roberta, distilbert: encoders; stablelm: partial rotary, parallel residual, qkv bias;
- phi: partial rotary with q/k LayerNorm over the head dim.
"""

from __future__ import annotations

import pytest
from rewrite_checks import pad_and_check

from models.build import spec
from tuner.errors import BadInput, RewriteRefused
from tuner.graph.inspect import inspect_path
from tuner.jobs.pad import pad_file
from tuner.rewrite.compose import PadRequest, round_up

FAMILIES = ("mistral", "gemma", "gemma2", "gemma3", "opt", "falcon", "gptj", "bloom", "roberta",
            "distilbert", "stablelm", "phi")
CASES = [(f, e) for f in FAMILIES for e in ("torchscript", "dynamo")]
IDS = [f"{f}-{e}" for f, e in CASES]

ROTARY = {"mistral": "full", "gemma": "full", "gemma2": "full", "gemma3": "full", "falcon": "full",
          "gptj": "partial", "stablelm": "partial", "phi": "partial"}
TIED = {"gemma", "gemma2", "gemma3", "opt", "falcon", "bloom"}
# Adding heads: refused (the refusal names the node) where the fused qkv stores heads in a
# layout the heads rewrite does not follow (Falcon's kv groups, BLOOM's per-head [q k v] read
# by Gather); BLOOM's ALiBi slopes would also need new heads.
HEADS_REFUSED = {"falcon", "bloom"}


@pytest.mark.parametrize("family,exporter", CASES, ids=IDS)
def test_inspect_reads_the_config_back(reference_model, family, exporter):
    found = inspect_path(reference_model(family, "awkward", exporter))
    expect = spec(family, "awkward").expect
    assert {k: getattr(found, k) for k in expect} == expect
    assert found.kind == ("decoder" if expect["vocab_size"] else "encoder")
    assert found.sites.tied is (family in TIED)
    attention = [layer.attention for layer in found.sites.layers]
    assert [a.rotary for a in attention] == [ROTARY.get(family, "none")] * 2
    assert all(a.scale.kind in ("constant", "computed") for a in attention)


@pytest.mark.parametrize("family,exporter", CASES, ids=IDS)
def test_ffn_vocab_and_head_dim_padded_together_are_exact(reference_model, tmp_path, family,
                                                          exporter):
    src = reference_model(family, "awkward", exporter)
    shape = inspect_path(src)
    target = round_up(shape.head_dim + 1, 16)  # 24->32, 36->48, 40->48, 20->32
    req = PadRequest.from_multiples(shape, ffn_multiple=64, head_dim=target,
                                    vocab_multiple=64 if shape.vocab_size else None)
    _, padded = pad_and_check(src, tmp_path / "padded.onnx", req)
    assert (padded.ffn_size, padded.head_dim) == (round_up(shape.ffn_size, 64), target)
    assert padded.vocab_size == (1024 if shape.vocab_size else None)
    assert (padded.num_heads, padded.hidden_size) == (shape.num_heads, shape.hidden_size)


@pytest.mark.parametrize("family,exporter", CASES, ids=IDS)
def test_heads_padded_exactly_or_refused_naming_the_node(reference_model, tmp_path, family,
                                                         exporter):
    src = reference_model(family, "awkward", exporter)
    shape = inspect_path(src)
    target = shape.num_heads + shape.num_kv_heads  # a multiple of the kv heads (GQA)
    req = PadRequest(num_heads=target)
    if family in HEADS_REFUSED:
        with pytest.raises(RewriteRefused, match="node '"):
            pad_file(src, tmp_path / "padded.onnx", req)
        assert not (tmp_path / "padded.onnx").exists()
        return
    _, padded = pad_and_check(src, tmp_path / "padded.onnx", req)
    kv = target if shape.num_kv_heads == shape.num_heads else shape.num_kv_heads  # GQA keeps kv
    assert (padded.num_heads, padded.num_kv_heads, padded.head_dim) == (target, kv, shape.head_dim)


def test_a_model_onnx_runtime_cannot_load_is_refused_as_bad_input(reference_model, tmp_path):
    """Seen with Falcon + ALiBi: torch exports a complex128 Mul that ONNX Runtime rejects. The
    pad must say the original is at fault, not blame the rewrite."""
    import onnx

    proto = onnx.load(str(reference_model("gpt2", "small", "torchscript")))
    norm = next(n for n in proto.graph.node if n.op_type == "LayerNormalization")
    norm.domain = "com.example.nowhere"  # ORT has no kernel for it; inspect does not care
    proto.opset_import.append(onnx.helper.make_opsetid("com.example.nowhere", 1))
    src = tmp_path / "unloadable.onnx"
    onnx.save(proto, str(src))
    shape = inspect_path(src)
    with pytest.raises(BadInput, match="ONNX Runtime cannot load the original model"):
        pad_file(src, tmp_path / "out.onnx", PadRequest.from_multiples(shape, vocab_multiple=64))
    assert not (tmp_path / "out.onnx").exists()
