"""torch's dynamo export without its optimizer (`torch.onnx.export(..., optimize=False)`, what
a user turns to when the optimizer is slow or fails on a big model; models.build's
"dynamo-unoptimized"): constant shape math left as Constant -> Cast -> Reshape chains, each
weight stored (out, in) behind a Transpose, torch.split as SplitToSequence -> SequenceAt.

Before: GPT-2's inspect found "no attention" (the qkv split is a sequence), every head-dim
padding of a rotary model was refused (its rotate_half slices at computed bounds), every
padding at all was refused ("MatMul whose weight is not a constant 2-D tensor"), Phi-3
read as 1 head of 80, and OPT's head dim was refused where its attention scale is
CastLike(1.0, k). Now the graph is folded as it loads (tuner.graph.unfolded), the weights
are stored transposed before a rewrite (tuner.rewrite.transposed_weights), a fused qkv's q
Slice gives the heads (tuner.graph.head_counts), and CastLike takes only a dtype from its
second input (tuner.rewrite.axis.elementwise)."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from test_generate_informative import _transformers_greedy, served_greedy

from models.build import DYNAMO_UNOPTIMIZED, build_torch_model, cached, spec
from models.prompts import random_prompts, text_prompts
from tuner.cli import main
from tuner.graph.inspect import inspect_path
from tuner.graph.load import read_proto
from tuner.graph.unfolded import fold_unfolded
from tuner.rewrite.transposed_weights import fold_transposed_weights

NAMES = ("llama", "phi3", "opt", "gpt2-kv")


@pytest.mark.parametrize("name", NAMES)
def test_inspect_reads_the_config_back(name):
    found = inspect_path(cached(name, "awkward", DYNAMO_UNOPTIMIZED))
    expect = spec(name, "awkward").expect
    assert {k: getattr(found, k) for k in expect} == expect
    assert (found.cache is not None) == name.endswith("-kv")


def test_only_an_unoptimized_export_is_folded():
    raw = ir.serde.deserialize_model(read_proto(cached("llama", "awkward", DYNAMO_UNOPTIMIZED)))
    assert fold_unfolded(raw)
    for exporter in ("torchscript", "dynamo"):
        model = ir.serde.deserialize_model(read_proto(cached("llama-kv", "awkward", exporter)))
        assert not fold_unfolded(model), exporter


@pytest.mark.parametrize("name", NAMES)
def test_ffn_vocab_and_head_dim_padded_exactly(name, tmp_path, capsys):
    src = cached(name, "awkward", DYNAMO_UNOPTIMIZED)
    head_dim = inspect_path(src).head_dim
    assert main(["pad", str(src), "-o", str(tmp_path / "m.onnx"), "--json", "--ffn-multiple",
                 "64", "--vocab-multiple", "64", "--head-dim", str(head_dim + 16)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [t.split()[0] for t in report["transforms"]] == ["ffn", "vocab", "head_dim"]
    assert report["accuracy"]["passed"]


def test_transposed_weights_stored_transposed_and_a_shared_one_left():
    # as written (load_model's folder already stores the small ones transposed; a big
    # model's weights are past its size limits, and reach the rewrite behind Transposes)
    model = ir.serde.deserialize_model(read_proto(cached("llama", "awkward",
                                                         DYNAMO_UNOPTIMIZED)))
    # each layer's q, k, v, o, gate, up, down and the LM head: 2 x 7 + 1
    assert fold_transposed_weights(model) == 15
    assert fold_transposed_weights(model) == 0  # nothing left to fold
    # a weight read by a Gather too (a tied embedding) keeps its one copy
    w = ir.Value(name="w", shape=ir.Shape([4, 3]), type=ir.TensorType(ir.DataType.FLOAT),
                 const_value=ir.tensor(np.arange(12, dtype=np.float32).reshape(4, 3), name="w"))
    ids = ir.Value(name="ids", shape=ir.Shape([2]), type=ir.TensorType(ir.DataType.INT64))
    gather = ir.node("Gather", [w, ids])
    t = ir.node("Transpose", [w], attributes={"perm": [1, 0]})
    mm = ir.node("MatMul", [gather.outputs[0], t.outputs[0]])
    graph = ir.Graph([ids], [mm.outputs[0]], nodes=[gather, t, mm], initializers=[w],
                     opset_imports={"": 18})
    assert fold_transposed_weights(ir.Model(graph, ir_version=10)) == 0


def test_a_cache_export_serves_transformers_greedy_output(tmp_path):
    src = cached("gpt2-kv", "awkward", DYNAMO_UNOPTIMIZED)
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), "--rounds", "2", "--bucket-rounds", "1",
                 "--max-variants", "1", "--no-probe", "--no-fuse", "--no-cache", "-q",
                 "--no-plots", "--max-seq", "64"]) == 0
    model = build_torch_model(spec("gpt2-kv", "awkward"))
    vocab = model.config.vocab_size
    prompts = text_prompts(vocab, 1) + random_prompts(vocab, (5,))
    assert served_greedy(out, prompts) == [_transformers_greedy(model, p) for p in prompts]
