"""inspect finds the KV cache of a decoder export from structure: which inputs are past keys
and values, which outputs are present, paired by layer, with the cache's dims, layout, dtype
and axis names; names only break ties, so renamed (and misleadingly named) inputs are read
the same. The other dims stay right on cache exports, and models without a cache say so."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.build import EXPORTERS, KV_FAMILIES, cached, spec
from models.kv import io_names
from tuner.cli import main
from tuner.graph.inspect import inspect_model, inspect_path
from tuner.graph.kv_cache import CacheLayer, KvCache, find_kv_cache
from tuner.graph.load import load_model

CASES = [(f, e) for f in KV_FAMILIES for e in EXPORTERS]
DIMS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size",
        "ffn_gated", "vocab_size")


def _expected_layers(layers: int, rename=lambda name: name) -> list[tuple[str, ...]]:
    inputs, outputs = io_names(layers)
    return [(rename(inputs[3 + 2 * i]), rename(inputs[4 + 2 * i]),
             rename(outputs[1 + 2 * i]), rename(outputs[2 + 2 * i])) for i in range(layers)]


def _names(cache: KvCache) -> list[tuple[str, ...]]:
    return [(l.past_key, l.past_value, l.present_key, l.present_value) for l in cache.layers]


@pytest.mark.parametrize("family,exporter", CASES)
def test_cache_and_dims_found(family, exporter):
    expect = spec(f"{family}-kv", "awkward").expect
    model = load_model(cached(f"{family}-kv", "awkward", exporter))
    shape = inspect_model(model)
    assert {k: getattr(shape, k) for k in DIMS} == expect  # the Concats confuse nothing
    c = shape.cache
    assert c is not None and c.named_by == "structure"
    layers, kv, d = expect["num_layers"], expect["num_kv_heads"], expect["head_dim"]
    assert (c.num_layers, c.num_kv_heads, c.head_dim) == (layers, kv, d)
    assert (c.layout, c.dtype, c.itemsize) == ("bhsd", "float32", 4)
    assert c.bytes_per_token == 2 * layers * kv * d * 4
    assert (c.batch_dim, c.past_dim, c.present_dim) == (
        "batch", "past_sequence", "past_sequence + sequence")
    assert _names(c) == _expected_layers(layers)
    nodes = {n.name: n for n in model.graph}
    for layer in c.layers:  # the sites name real Concat nodes
        assert nodes[layer.join_key].op_type == nodes[layer.join_value].op_type == "Concat"


def _rename(model: ir.Model, mapping: dict[str, str]) -> None:
    for v in [*model.graph.inputs, *model.graph.outputs]:
        if v.name in mapping:
            v.name = mapping[v.name]


def _short(name: str) -> str:
    """past_key_values.3.key -> pkv_3_k, present.3.value -> out_3_v"""
    parts = name.split(".")
    return f"{'pkv' if parts[0] == 'past_key_values' else 'out'}_{parts[1]}_{parts[2][0]}"


@pytest.mark.parametrize("family,exporter", CASES)
def test_renamed_inputs_are_found_by_structure(family, exporter):
    layers = spec(f"{family}-kv", "awkward").expect["num_layers"]
    model = load_model(cached(f"{family}-kv", "awkward", exporter))
    inputs, outputs = io_names(layers)
    _rename(model, {n: _short(n) for n in inputs[3:] + outputs[1:]})
    c = inspect_model(model).cache
    assert c is not None and c.named_by == "structure"
    assert _names(c) == _expected_layers(layers, _short)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_names_that_lie_lose_to_structure(exporter):
    """Keys named like values and layers numbered backwards: the structure still wins."""
    layers = spec("llama-kv", "awkward").expect["num_layers"]
    model = load_model(cached("llama-kv", "awkward", exporter))
    inputs, _ = io_names(layers)

    def liar(name: str) -> str:
        _, i, kv = name.split(".")
        return f"cache_{layers - 1 - int(i)}_{'v' if kv == 'key' else 'k'}"

    _rename(model, {n: liar(n) for n in inputs[3:]})
    c = find_kv_cache(model.graph)
    assert c is not None and c.named_by == "structure"
    assert [(l.past_key, l.past_value) for l in c.layers] == [
        (liar(f"past_key_values.{i}.key"), liar(f"past_key_values.{i}.value"))
        for i in range(layers)]


def _no_attention_graph() -> ir.Model:
    """Two layers of cache Concats whose results only leave the graph (no Softmax to tell
    K from V): the names have to decide, and do."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 2, "s", 4])
    inputs, outputs, nodes = [x], [], [helper.make_node("MatMul", ["x", "w"], ["new"])]
    for i in (1, 0):  # names number the layers backwards: only names can pair them
        for kv in ("v", "k"):
            inputs.append(helper.make_tensor_value_info(f"past_{i}_{kv}", TensorProto.FLOAT,
                                                        ["b", 2, "p", 4]))
            outputs.append(helper.make_tensor_value_info(f"present_{i}_{kv}", TensorProto.FLOAT,
                                                         ["b", 2, "t", 4]))
            nodes.append(helper.make_node("Concat", [f"past_{i}_{kv}", "new"],
                                          [f"present_{i}_{kv}"], axis=-2, name=f"cat_{i}_{kv}"))
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=[w])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def test_names_break_ties_the_structure_leaves_open():
    c = find_kv_cache(_no_attention_graph().graph)
    assert c is not None and c.named_by == "names"
    assert [(l.past_key, l.past_value, l.present_key) for l in c.layers] == [  # graph order
        ("past_1_k", "past_1_v", "present_1_k"), ("past_0_k", "past_0_v", "present_0_k")]
    assert (c.num_kv_heads, c.head_dim, c.layout, c.bytes_per_token) == (2, 4, "bhsd", 2 * 2 * 2 * 4 * 4)
    assert (c.batch_dim, c.past_dim, c.present_dim) == ("b", "p", "t")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_models_without_a_cache_report_none(name):
    assert inspect_path(cached(name, "awkward", "dynamo")).cache is None


def test_cli_json_has_the_cache_and_null_without_one(capsys):
    assert main(["inspect", str(cached("gpt2-kv", "awkward", "torchscript")), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    cache = doc["cache"]
    assert (cache["num_layers"], cache["num_kv_heads"], cache["head_dim"]) == (2, 2, 80)
    assert cache["bytes_per_token"] == 2560 and cache["layout"] == "bhsd"
    assert cache["layers"][1]["past_value"] == "past_key_values.1.value"
    assert main(["inspect", str(cached("gpt2", "awkward", "torchscript")), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cache"] is None


def test_cli_table_shows_the_cache(capsys):
    assert main(["inspect", str(cached("mistral-kv", "awkward", "dynamo"))]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 2 layers x 1 kv heads x head dim 40, layout bhsd, float32" in out
    assert "640 bytes per token" in out and "present.1.value" in out


def test_cache_record_is_validated():
    layer = CacheLayer(0, "pk", "pv", None, None, "ck", "cv")
    args = dict(num_kv_heads=1, head_dim=8, dtype="float32", itemsize=4, bytes_per_token=64,
                batch_dim=None, past_dim=None, present_dim=None, layers=(layer,))
    with pytest.raises(ValueError, match="num_layers 2 != 1 layers listed"):
        KvCache(num_layers=2, layout="bhsd", **args)
    with pytest.raises(ValueError, match="layout must order the letters b, h, s, d, not 'bhs'"):
        KvCache(num_layers=1, layout="bhs", **args)
    with pytest.raises(ValueError, match="value_head_dim 8 is the keys' head dim: leave it None"):
        KvCache(num_layers=1, layout="bhsd", value_head_dim=8, **args)
    latent = KvCache(num_layers=1, layout="bhsd", value_head_dim=6, **args)  # keys 8, values 6
    assert (latent.dim_of("pk"), latent.dim_of("pv"), latent.values_dim) == (8, 6, 6)


def test_onnx_attention_op_from_opset_23_tells_k_from_v_by_its_slots(llama_kv_opset23):
    import onnxruntime as ort

    model = load_model(llama_kv_opset23)
    assert "Attention" in {n.op_type for n in model.graph}
    c = inspect_model(model).cache
    assert c is not None and c.named_by == "structure"
    assert _names(c) == _expected_layers(2)
    # and it runs the first step with past 0, like its opset-18 sibling
    feeds = {"input_ids": np.array([[5, 6, 7]]), "attention_mask": np.ones((1, 3), np.int64),
             "position_ids": np.arange(3)[None]}
    feeds |= {n: np.zeros((1, 1, 0, 80), np.float32) for n in io_names(2)[0][3:]}
    got, want = (ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
                 .run(["logits"], feeds)[0]
                 for p in (llama_kv_opset23, cached("llama-kv", "awkward", "dynamo")))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-3)


def _gqa_graph() -> ir.Model:
    """ORT's fused form: GroupQueryAttention takes past_key/past_value itself (slots 3, 4)
    and returns present (outputs 1, 2); no Concat. Inputs named so names would say nothing."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("wq", (8, 8)), ("wk", (8, 4)), ("wv", (8, 4)), ("wo", (8, 8)))]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8]),
              helper.make_tensor_value_info("lens", TensorProto.INT32, ["b"]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outputs, nodes, h = [], [], "x"
    for i in range(2):
        inputs += [helper.make_tensor_value_info(f"in{2 * i + j}", TensorProto.FLOAT,
                                                 ["b", 1, "p", 4]) for j in (0, 1)]
        outputs += [helper.make_tensor_value_info(f"out{2 * i + j}", TensorProto.FLOAT,
                                                  ["b", 1, "t", 4]) for j in (0, 1)]
        nodes += [helper.make_node("MatMul", [h, w], [f"{w}{i}"]) for w in ("wq", "wk", "wv")]
        nodes.append(helper.make_node(
            "GroupQueryAttention", [f"wq{i}", f"wk{i}", f"wv{i}", f"in{2 * i}", f"in{2 * i + 1}",
                                    "lens", "total"],
            [f"attn{i}", f"out{2 * i}", f"out{2 * i + 1}"], domain="com.microsoft",
            num_heads=2, kv_num_heads=1, name=f"gqa{i}"))
        nodes.append(helper.make_node("MatMul", [f"attn{i}", "wo"], [f"h{i}"]))
        h = f"h{i}"
    outputs.insert(0, helper.make_tensor_value_info(h, TensorProto.FLOAT, ["b", "s", 8]))
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return ir.from_proto(helper.make_model(graph, opset_imports=opsets))


def test_ort_fused_attention_takes_the_past_itself():
    c = find_kv_cache(_gqa_graph().graph)
    assert c is not None and c.named_by == "structure"
    assert [(l.past_key, l.past_value, l.present_key, l.present_value, l.join_key)
            for l in c.layers] == [("in0", "in1", "out0", "out1", "gqa0"),
                                   ("in2", "in3", "out2", "out3", "gqa1")]
    assert (c.num_kv_heads, c.head_dim, c.layout, c.past_dim, c.present_dim) == (1, 4, "bhsd", "p", "t")


def test_cache_survives_ort_transformer_fusions(tmp_path):
    """After ONNX Runtime's transformer optimizer (SkipLayerNorm, FastGelu fused; the cache
    Concats kept), the cache and every dim read the same."""
    from onnxruntime.transformers.optimizer import optimize_model

    expect = spec("gpt2-kv", "awkward").expect
    fused = optimize_model(str(cached("gpt2-kv", "awkward", "torchscript")), model_type="gpt2",
                           num_heads=expect["num_heads"], hidden_size=expect["hidden_size"])
    path = tmp_path / "gpt2-kv-fused.onnx"
    fused.save_model_to_file(str(path))
    shape = inspect_path(path)
    assert shape.optimized and {k: getattr(shape, k) for k in DIMS} == expect
    assert shape.cache is not None and _names(shape.cache) == _expected_layers(2)
