"""Head-dim padding: exact on every family and exporter (fused QKV, GQA, full and partial
rotary), the softmax scale kept at 1/sqrt(d), and the gate catches a wrong scale."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from rewrite_checks import pad_and_check, weight

from tuner.errors import RewriteRefused
from tuner.gate.feeds import make_feeds
from tuner.gate.verify import verify
from tuner.graph.inspect import inspect_model, inspect_path
from tuner.graph.load import load_model, save_model
from tuner.jobs.pad import pad_file
from tuner.rewrite.common import const_array, find_node, new_initializer
from tuner.rewrite.compose import PadRequest, apply
from tuner.runtime.registry import get_backend

CASES = [(fam, exp) for fam in ("gpt2", "bert", "llama") for exp in ("torchscript", "dynamo")]
CASES += [("gpt_neox", "torchscript"), ("gpt_neox", "dynamo"), ("qwen2", "torchscript")]


@pytest.mark.parametrize("family,exporter", CASES)
def test_head_dim_padding_is_exact(reference_model, tmp_path, family, exporter):
    src = reference_model(family, "awkward", exporter)
    before = inspect_path(src)
    assert before.head_dim == 80
    dst = tmp_path / "hd.onnx"
    result, after = pad_and_check(src, dst, PadRequest(head_dim=96))
    assert result.transforms == ("head_dim 80->96",)
    assert after.head_dim == 96
    assert (after.num_heads, after.num_kv_heads, after.hidden_size, after.ffn_size) == \
        (before.num_heads, before.num_kv_heads, before.hidden_size, before.ffn_size)
    # Output projection: per head, rows 80..95 are zero, and the old rows are all there.
    site = after.sites.layers[0].attention
    o = weight(dst, site.o)
    rows = o if o.shape[0] == before.num_heads * 96 else o.T
    per_head = rows.reshape(before.num_heads, 96, -1)
    assert not per_head[:, 80:].any() and per_head[:, :80].any()
    after_scale = after.sites.layers[0].attention.scale
    assert after_scale.value == pytest.approx(1 / np.sqrt(80), rel=1e-5)


def test_full_rotary_pads_each_half(reference_model, tmp_path):
    """Llama's q columns: dims 0..39 stay, 40..47 are zero, 48..87 hold the old 40..79."""
    src = reference_model("llama", "awkward", "dynamo")
    dst = tmp_path / "hd.onnx"
    _, after = pad_and_check(src, dst, PadRequest(head_dim=96))
    before = inspect_path(src)
    q_old = weight(src, before.sites.layers[0].attention.q)  # (h, heads * 80)
    q_new = weight(dst, after.sites.layers[0].attention.q)  # (h, heads * 96)
    old = q_old.reshape(-1, 2, 80)
    new = q_new.reshape(-1, 2, 96)
    np.testing.assert_array_equal(new[..., :40], old[..., :40])
    np.testing.assert_array_equal(new[..., 48:88], old[..., 40:])
    assert not new[..., 40:48].any() and not new[..., 88:].any()


def _const_slot(node: ir.Node) -> int:
    return next(i for i, v in enumerate(node.inputs) if const_array(v) is not None)


def _shape_scale_chain(query: ir.Value, idx: ir.Value, ops: tuple[str, ...], name: str):
    """Nodes computing f(q.shape[-1]) as TorchScript did: Shape -> Gather -> Cast -> ops."""
    chain = [ir.node("Shape", [query])]
    chain.append(ir.node("Gather", [chain[-1].outputs[0], idx], attributes={"axis": 0}))
    chain.append(ir.node("Cast", [chain[-1].outputs[0]], attributes={"to": ir.DataType.FLOAT}))
    for op in ops:
        chain.append(ir.node(op, [chain[-1].outputs[0]]))
    for i, n in enumerate(chain):
        n.name = f"{name}/computed_scale_{i}"
    return chain


def _with_computed_scale(src, dst, on_scores: bool = False):
    """The reference export, its constant scale replaced by a run-time one computed from the
    query's shape: sqrt(1 / sqrt(d)) multiplied into q and k (TorchScript's SDPA), or, with
    `on_scores`, scores / sqrt(d) after the q.k MatMul (eager attention)."""
    model = load_model(src)
    graph = model.graph
    idx = new_initializer(graph, "scale_idx", np.array(-1, dtype=np.int64))
    one = new_initializer(graph, "one", np.array(1.0, dtype=np.float32))
    for layer in inspect_model(model).sites.layers:
        names = layer.attention.scale.nodes  # q's Mul first, then k's
        first = find_node(graph, names[0])
        query = first.inputs[1 - _const_slot(first)]  # (B, heads, S, d): its last dim is d
        scores = next(u.node for u in first.outputs[0].uses() if u.node.op_type == "MatMul")
        for name in names:
            node = find_node(graph, name)
            j = _const_slot(node)
            if on_scores:
                node.replace_input_with(j, one)
                continue
            chain = _shape_scale_chain(query, idx, ("Sqrt", "Reciprocal", "Sqrt"), name)
            graph.insert_before(node, chain)
            node.replace_input_with(j, chain[-1].outputs[0])
        if on_scores:
            chain = _shape_scale_chain(query, idx, ("Sqrt",), scores.name)
            div = ir.node("Div", [scores.outputs[0], chain[-1].outputs[0]], name=f"{scores.name}/div")
            scores.outputs[0].replace_all_uses_with(div.outputs[0])
            div.replace_input_with(0, scores.outputs[0])
            graph.insert_after(scores, [*chain, div])
    return save_model(model, dst)


@pytest.mark.parametrize("on_scores", [False, True])
def test_a_scale_computed_from_the_shape_is_pinned(reference_model, tmp_path, on_scores):
    src = reference_model("llama", "awkward", "torchscript")
    computed = _with_computed_scale(src, tmp_path / "computed.onnx", on_scores)
    backend = get_backend("ort-cpu")
    feeds = make_feeds(src, 1003, [(2, 9)])
    assert verify(backend.load(src), backend.load(computed), feeds)  # same model, other form
    assert inspect_path(computed).sites.layers[0].attention.scale.kind == "computed"
    _, after = pad_and_check(computed, tmp_path / "hd.onnx", PadRequest(head_dim=96))
    assert after.head_dim == 96


def test_the_gate_catches_a_scale_left_at_the_padded_dim(reference_model, tmp_path):
    """A head-dim rewrite that forgets the scale (1/sqrt(96) instead of 1/sqrt(80)) runs,
    keeps every shape, and must still be rejected by the gate."""
    src = reference_model("llama", "awkward", "dynamo")
    model = load_model(src)
    shape = inspect_model(model)
    model, _ = apply(model, shape, PadRequest(head_dim=96))
    graph = model.graph
    for layer in inspect_model(model).sites.layers:
        for name in layer.attention.scale.nodes:
            node = find_node(graph, name)
            for j, v in enumerate(node.inputs):
                c = const_array(v)
                if c is not None and c.size == 1:
                    wrong = np.array(96 ** -0.25, dtype=c.dtype).reshape(c.shape)
                    node.replace_input_with(j, new_initializer(graph, f"{name}.wrong", wrong))
    wrong = save_model(model, tmp_path / "wrong.onnx")
    backend = get_backend("ort-cpu")
    result = verify(backend.load(src), backend.load(wrong), make_feeds(src, 1003, [(2, 9)]))
    assert not result
    assert "FAIL" in result.table()


def test_refusals(reference_model):
    model = load_model(reference_model("llama", "awkward", "dynamo"))
    shape = inspect_model(model)
    with pytest.raises(RewriteRefused, match="cannot pad to the smaller 64"):
        apply(model, shape, PadRequest(head_dim=64))
    with pytest.raises(RewriteRefused, match="full rotary needs even head dims"):
        apply(model, shape, PadRequest(head_dim=97))


def test_onnx_attention_op_gets_its_scale_written(llama_opset23, tmp_path):
    """Opset 23: ONNX's Attention defaults its scale to 1/sqrt(head size). An export that
    leaves the attribute out must get 1/sqrt(16) written, or padding to 32 changes the
    softmax; RotaryEmbedding sees per-half heads and half-size caches."""
    model = load_model(llama_opset23)
    for node in model.graph:
        if node.op_type == "Attention":
            node.attributes.pop("scale")
    implicit = save_model(model, tmp_path / "implicit.onnx")
    shapes = [(1, 5), (1, 12)]  # ORT's RotaryEmbedding runs this export at batch 1 only
    backend = get_backend("ort-cpu")
    feeds = make_feeds(llama_opset23, 1024, shapes)
    assert verify(backend.load(llama_opset23), backend.load(implicit), feeds)
    result = pad_file(implicit, tmp_path / "hd.onnx", PadRequest(head_dim=32), shapes=shapes)
    assert result.accuracy and result.transforms == ("head_dim 16->32",)
    scales = [n.attributes["scale"].value for n in load_model(tmp_path / "hd.onnx").graph
              if n.op_type == "Attention"]
    assert scales == [pytest.approx(0.25)] * 2
    assert inspect_path(tmp_path / "hd.onnx").head_dim == 32
