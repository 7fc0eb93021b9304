"""tuner/rewrite/grouped_attention.py: repeat_kv regrouped on real exports of a GQA Llama
(TorchScript and dynamo, with a KV cache): the repeats go, ONNX Runtime gives the same
logits and presents on prefill and decode feeds, the gate passes it, a regrouping against
the wrong kv heads FAILS the gate, and a graph without grouped attention is left alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from models.build import cached
from tuner.cli import main
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model, save_model
from tuner.rewrite.grouped_attention import regroup_attention
from tuner.runtime.ort import OrtRunner, load_cpu


def _expands(model: ir.Model) -> int:
    return sum(1 for n in model.graph if n.op_type == "Expand")


def _feeds(record_like: OrtRunner, batch: int, past: int, seq: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in record_like.session.get_inputs():
        if i.name.startswith("past_key_values"):
            heads, dim = i.shape[1], i.shape[3]
            feeds[i.name] = rng.standard_normal((batch, heads, past, dim)).astype(np.float32)
    feeds["input_ids"] = rng.integers(0, 1000, (batch, seq))
    mask = np.ones((batch, past + seq), np.int64)
    mask[-1, :2] = 0  # a left-padded row
    feeds["attention_mask"] = mask
    if "position_ids" in {i.name for i in record_like.session.get_inputs()}:
        feeds["position_ids"] = np.maximum(mask.cumsum(-1) - 1, 0)[:, past:]
    return feeds


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_every_repeat_goes_and_the_outputs_stay(exporter, tmp_path):
    src = cached("llama-kv", "awkward", exporter)
    shape = inspect_model(load_model(src))
    assert shape.num_heads > shape.num_kv_heads  # grouped: a repeat per K and V per layer
    model = load_model(src)
    before = _expands(model)
    count = regroup_attention(model, shape.num_heads, shape.num_kv_heads)
    # TorchScript: K and V of every layer. dynamo's SDPA decomposition flattens the repeated K
    # to 3-D before its Transpose (left as it is); its V is regrouped.
    assert count == (2 if exporter == "torchscript" else 1) * shape.num_layers
    assert _expands(model) == before - count
    dst = save_model(model, tmp_path / "regrouped.onnx")
    a, b = OrtRunner(load_cpu(src)), OrtRunner(load_cpu(dst))
    for batch, past, seq in ((2, 0, 7), (3, 9, 1), (2, 5, 3)):
        feeds = _feeds(a, batch, past, seq, seed=past)
        want, got = a.infer(feeds), b.infer(feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], atol=2e-5, rtol=1e-4)
    assert main(["verify", str(src), str(dst)]) == 0


def test_a_regrouping_that_scrambles_the_query_heads_fails_the_gate(tmp_path, capsys):
    """The folded rows (B, kvH, n_rep*S, .) read back as (S, heads) instead of (heads, S):
    the graph runs, decode steps (S = 1) agree, prompts do not, and the gate must FAIL it."""
    src = cached("llama-kv", "awkward", "torchscript")
    shape = inspect_model(load_model(src))
    model = load_model(src)
    assert regroup_attention(model, shape.num_heads, shape.num_kv_heads)
    to_heads = model.graph.initializers["regroup.to_heads"]
    scrambled = _const(model, "scrambled", [0, -1, shape.num_heads, 0])
    for node in list(to_heads.consumers()):
        node.replace_input_with(1, scrambled)  # (B, S, H, Y)
        swap = ir.node("Transpose", [node.outputs[0]], attributes={"perm": [0, 2, 1, 3]})
        ir.convenience.replace_all_uses_with(node.outputs[0], swap.outputs[0])
        swap.replace_input_with(0, node.outputs[0])  # (the line above rewired it too)
        model.graph.insert_after(node, swap)
    bad = save_model(model, tmp_path / "scrambled.onnx")
    assert main(["verify", str(src), str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out


def _const(model: ir.Model, tag: str, values: list[int]) -> ir.Value:
    from tuner.rewrite.common import new_initializer

    return new_initializer(model.graph, f"test.{tag}", np.array(values, np.int64))


def test_a_graph_without_grouped_attention_is_left_alone():
    src = cached("gpt2", "small", "torchscript")  # as many kv heads as heads
    shape = inspect_model(load_model(src))
    model = load_model(src)
    nodes = len(model.graph)
    assert regroup_attention(model, shape.num_heads, shape.num_heads) == 0
    assert regroup_attention(model, shape.num_heads * 2, shape.num_heads) == 0  # no repeat
    assert len(model.graph) == nodes
