"""inspect finds every reference model's dims from graph structure, for both exporters, and
reports sites that name real nodes; ORT-optimized graphs are recognised; the CLI prints the
contract and refuses bad input with exit 2 and one line.

Over 400 lines because it is one table of cases (every reference model x both exporters, the
fused graphs, the CLI's refusals) read top to bottom; splitting it would split that table."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from models.build import spec
from tuner.cli import main
from tuner.graph.inspect import inspect_model, inspect_path
from tuner.graph.load import load_model
from tuner.plan.findings import audited

CASES = [(name, shape, exporter)
         for name in ("gpt2", "bert", "llama", "gpt_neox", "qwen2")
         for shape in ("small", "awkward")
         for exporter in ("torchscript", "dynamo")]
CASES += [(name, shape, exporter)
          for name, shape in (("minilm", "real"), ("phi3", "awkward"))
          for exporter in ("torchscript", "dynamo")]

TIED = {"gpt2": True, "qwen2": True, "llama": False, "gpt_neox": False, "phi3": False}
ROTARY = {"gpt2": "none", "bert": "none", "minilm": "none", "llama": "full", "qwen2": "full",
          "gpt_neox": "partial", "phi3": "full"}
FUSED_QKV = {"gpt2", "gpt_neox", "phi3"}
FUSED_GATE_UP = {"phi3"}


@pytest.mark.parametrize("name,shape,exporter", CASES,
                         ids=[f"{n}-{s}-{e}" for n, s, e in CASES])
def test_dims_match_the_config(reference_model, name, shape, exporter):
    path = reference_model(name, shape, exporter)
    model = load_model(path)
    found = inspect_model(model)
    expect = spec(name, shape).expect
    assert {k: getattr(found, k) for k in expect} == expect
    assert found.kind == ("encoder" if expect["vocab_size"] is None else "decoder")
    assert found.sites.tied is TIED.get(name, False)
    assert not found.optimized and found.fused_ops == ()
    _check_sites(model, found, name, expect)


def _reaches_graph_output(node: ir.Node, hops: int) -> bool:
    frontier = list(node.outputs)
    for _ in range(hops + 1):
        if any(v.is_graph_output() for v in frontier):
            return True
        frontier = [o for v in frontier for user, _ in v.uses() for o in user.outputs]
    return False


def _check_sites(model: ir.Model, found, name: str, expect: dict) -> None:
    """Every site names a node (or initializer) of the right kind in the loaded graph."""
    nodes = {n.name: n for n in model.graph}
    assert len(nodes) == len(list(model.graph)), "node names must be unique"
    inits = model.graph.initializers
    assert len(found.sites.layers) == expect["num_layers"]
    d = expect["head_dim"]
    for layer in found.sites.layers:
        a, f = layer.attention, layer.ffn
        assert a is not None and f is not None
        projections = [a.qkv] if name in FUSED_QKV else [a.q, a.k, a.v]
        assert all(p is not None for p in projections)
        assert (a.qkv is not None) == (name in FUSED_QKV)
        for p in projections + [a.o, f.up, f.down] + ([f.gate] if f.gate else []):
            assert nodes[p].op_type in ("MatMul", "Gemm"), p
        assert (f.gate is not None) == expect["ffn_gated"]
        if name in FUSED_GATE_UP:
            assert f.gate == f.up and f.fused_gate_up == "gate,up"
            weight = nodes[f.up].inputs[1].const_value  # one GEMM of width 2f: both halves
            assert 2 * expect["ffn_size"] in tuple(weight.shape)
        else:
            assert f.fused_gate_up is None and f.gate != f.up
        assert nodes[a.softmax].op_type == "Softmax"
        assert a.reshapes and all(nodes[r].op_type in ("Reshape", "Split", "Slice")
                                  for r in a.reshapes)
        assert a.rotary == ROTARY[name]
        if a.rotary == "partial":
            assert a.rotary_dim is not None and 0 < a.rotary_dim < d
        elif a.rotary == "full":
            assert a.rotary_dim in (None, d)
        assert a.scale.kind in ("constant", "computed")
        if a.scale.kind == "constant":
            assert math.isclose(a.scale.value, 1 / math.sqrt(d), rel_tol=1e-5)
        assert all(nodes[s].op_type in ("Mul", "Div") for s in a.scale.nodes)
    # Distinct layers point at distinct projections.
    downs = [layer.ffn.down for layer in found.sites.layers]
    assert len(set(downs)) == len(downs)
    assert found.sites.embedding in inits
    if expect["vocab_size"] is None:
        assert found.sites.lm_head is None and found.sites.lm_head_weight is None
    else:
        head = nodes[found.sites.lm_head]
        assert head.op_type in ("MatMul", "Gemm")
        assert found.sites.lm_head_weight in inits
        # its weight spans the vocabulary, and its output is the logits (or flows into them
        # within a few nodes: a Reshape, a Cast, the soft-capping of Gemma 2)
        assert expect["vocab_size"] in tuple(inits[found.sites.lm_head_weight].const_value.shape)
        assert _reaches_graph_output(head, hops=6), f"{found.sites.lm_head}: not the LM head"


def test_gqa_and_head_dim_80_found_without_symbolic_inference(reference_model, monkeypatch):
    """When shape inference gives nothing, the Reshape constants and the scale still tell
    heads and head dim (the fallback path, exercised on purpose)."""
    import tuner.graph.dims as dims

    monkeypatch.setattr(dims, "infer_symbolic", lambda model: {})
    for name in ("llama", "gpt_neox"):
        found = inspect_path(reference_model(name, "awkward", "torchscript"))
        expect = spec(name, "awkward").expect
        assert (found.num_heads, found.num_kv_heads, found.head_dim) == (
            expect["num_heads"], expect["num_kv_heads"], expect["head_dim"])


# ---------------------------------------------------------------------------------------------
# Graphs run through ONNX Runtime's transformer optimizer


@pytest.fixture(scope="module")
def ort_optimized(reference_model, tmp_path_factory):
    from onnxruntime.transformers.optimizer import optimize_model

    out = {}
    folder = tmp_path_factory.mktemp("ort_optimized")
    # Llama as Optimum's ORTOptimizer -O2 makes it: the gpt2 fusions, ONNX Runtime's own graph
    # optimizations at level 2 (its SiLU becomes QuickGelu with alpha 1)
    for name, model_type, level in (("bert", "bert", None), ("gpt2", "gpt2", None),
                                    ("llama", "gpt2", 2)):
        e = spec(name).expect
        m = optimize_model(str(reference_model(name, "small", "torchscript")),
                           model_type=model_type, num_heads=e["num_heads"],
                           hidden_size=e["hidden_size"], opt_level=level)
        path = folder / f"{name}.onnx"
        m.save_model_to_file(str(path))
        out[name] = path
    return out


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_ort_optimized_graph_is_recognised(ort_optimized, name):
    found = audited(inspect_path(ort_optimized[name]))
    assert found.optimized
    fused = "QuickGelu" if name == "llama" else "SkipLayerNormalization"
    assert f"com.microsoft.{fused}" in found.fused_ops
    expect = spec(name).expect
    assert {k: getattr(found, k) for k in expect} == expect
    assert any(f.rule == "already-fused" for f in found.findings)
    # QuickGelu with alpha 1 is SiLU (it was reported as "quick_gelu" for Llama)
    assert found.activation == {"bert": "gelu", "gpt2": "gelu_tanh", "llama": "silu"}[name]


def _fused_attention_model(path: Path) -> None:
    """A 2-layer BERT-like graph in the form ORT's optimizer leaves it: EmbedLayerNormalization,
    com.microsoft.Attention (packed QKV weight, num_heads), SkipLayerNormalization, BiasGelu."""
    rng = np.random.default_rng(0)
    h, heads, f, vocab = 64, 4, 160, 500
    inits, nodes = [], []

    def w(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.05).astype(np.float32), name))
        return name

    nodes.append(helper.make_node("Cast", ["input_ids"], ["ids32"], to=TensorProto.INT32))
    nodes.append(helper.make_node("Cast", ["attention_mask"], ["mask32"], to=TensorProto.INT32))
    nodes.append(helper.make_node(
        "EmbedLayerNormalization",
        ["ids32", "", w("word", vocab, h), w("pos", 128, h), "", w("eg", h), w("eb", h), "mask32"],
        ["x0", "mask_index"], domain="com.microsoft", epsilon=1e-12))
    x = "x0"
    for i in range(2):
        nodes.append(helper.make_node("Attention", [x, w(f"qkv{i}", h, 3 * h), w(f"qkvb{i}", 3 * h), "mask_index"],
                                      [f"ctx{i}"], domain="com.microsoft", num_heads=heads))
        nodes.append(helper.make_node("MatMul", [f"ctx{i}", w(f"o{i}", h, h)], [f"ao{i}"]))
        nodes.append(helper.make_node("SkipLayerNormalization", [f"ao{i}", x, w(f"g1{i}", h), w(f"b1{i}", h), w(f"ob{i}", h)],
                                      [f"y{i}"], domain="com.microsoft", epsilon=1e-12))
        nodes.append(helper.make_node("MatMul", [f"y{i}", w(f"up{i}", h, f)], [f"u{i}"]))
        nodes.append(helper.make_node("BiasGelu", [f"u{i}", w(f"ub{i}", f)], [f"g{i}"], domain="com.microsoft"))
        nodes.append(helper.make_node("MatMul", [f"g{i}", w(f"down{i}", f, h)], [f"dn{i}"]))
        out = "last_hidden_state" if i == 1 else f"x{i + 1}"
        nodes.append(helper.make_node("SkipLayerNormalization", [f"dn{i}", f"y{i}", w(f"g2{i}", h), w(f"b2{i}", h), w(f"db{i}", h)],
                                      [out], domain="com.microsoft", epsilon=1e-12))
        x = out
    graph = helper.make_graph(
        nodes, "fused_bert",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "sequence", h])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_fused_attention_op_read_from_attributes(tmp_path):
    path = tmp_path / "fused.onnx"
    _fused_attention_model(path)
    # It is a real, runnable graph (ORT's CPU kernels), not just a shape.
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    (out,) = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert out.shape == (2, 6, 64)

    found = inspect_path(path)
    assert found.optimized and "com.microsoft.Attention" in found.fused_ops
    assert (found.num_layers, found.hidden_size, found.num_heads, found.num_kv_heads,
            found.head_dim, found.ffn_size, found.vocab_size) == (2, 64, 4, 4, 16, 160, None)
    attn = found.sites.layers[0].attention
    assert attn.fused_op == "com.microsoft.Attention" and attn.scale.kind == "attribute"
    assert found.sites.embedding == "word"
    assert found.activation == "gelu"


# ---------------------------------------------------------------------------------------------
# The CLI


def test_cli_json_is_the_contract(reference_model, capsys):
    path = reference_model("gpt2", "awkward", "dynamo")
    assert main(["inspect", str(path), "--json", "--device", "h100", "--tokens", "4096"]) == 0
    doc = json.loads(capsys.readouterr().out)
    expect = spec("gpt2", "awkward").expect
    assert {k: doc[k] for k in expect} == expect
    rules = {f["rule"] for f in doc["findings"]}
    assert {"vocab-multiple-64", "ffn-multiple-64", "head-dim-multiple-64"} <= rules
    assert all(set(f) == {"rule", "severity", "message"} for f in doc["findings"])
    assert doc["sites"]["tied"] is True


def test_cli_table_is_readable(reference_model):
    path = reference_model("llama", "small", "torchscript")
    run = subprocess.run([sys.executable, "-m", "tuner", "inspect", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    for word in ("head dim", "kv heads", "FFN width", "176 gated silu", "findings",
                 "ffn-multiple-64"):
        assert word in run.stdout


def _refused(args: list[str], capsys) -> str:
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_not_onnx(tmp_path, capsys):
    p = tmp_path / "notes.onnx"
    p.write_text("this is a text file, not a protobuf\n" * 20)
    assert "not" in _refused(["inspect", str(p)], capsys)


def test_truncated_protobuf(reference_model, tmp_path, capsys):
    data = Path(reference_model("gpt2", "small", "torchscript")).read_bytes()
    p = tmp_path / "truncated.onnx"
    p.write_bytes(data[: len(data) // 3])
    assert str(p) in _refused(["inspect", str(p)], capsys)


def test_missing_file(tmp_path, capsys):
    assert "no such file" in _refused(["inspect", str(tmp_path / "nope.onnx")], capsys)


def test_cnn_is_not_a_transformer(tmp_path, capsys):
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((8, 10)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Relu", ["c"], ["r"]),
         helper.make_node("GlobalAveragePool", ["r"], ["p"]),
         helper.make_node("Flatten", ["p"], ["f"]),
         helper.make_node("MatMul", ["f", "w2"], ["y"]),
         helper.make_node("Softmax", ["y"], ["probs"])],
        "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 10])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    p = tmp_path / "cnn.onnx"
    onnx.save(model, str(p))
    assert "no transformer" in _refused(["inspect", str(p)], capsys)


def _external_model(folder: Path, location: str) -> Path:
    tensor = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", "64")):
        tensor.external_data.add(key=k, value=v)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])],
                              [tensor])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    return path


def test_external_data_outside_the_folder_is_refused(tmp_path, capsys):
    inner = tmp_path / "m"
    inner.mkdir()
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    path = _external_model(inner, "../secret.bin")
    assert "outside the model's folder" in _refused(["inspect", str(path)], capsys)


def test_missing_external_data_is_refused(tmp_path, capsys):
    path = _external_model(tmp_path, "weights.bin")
    assert "missing" in _refused(["inspect", str(path)], capsys)


def test_unknown_device_is_refused(reference_model, capsys):
    path = reference_model("gpt2", "small", "torchscript")
    assert "unknown device" in _refused(["inspect", str(path), "--device", "tpu"], capsys)


def _computed_scale_model(path: Path, h: int = 96, heads: int = 4) -> None:
    """One attention + FFN layer whose softmax scale is computed from q's shape at run time, as
    TorchScript exports write it: Shape -> Slice -> Cast -> Sqrt -> Div(1, .) -> Sqrt, applied
    to both q and k."""
    rng = np.random.default_rng(1)
    d = h // heads
    inits = []

    def w(name, *shape, dtype=np.float32, value=None):
        arr = np.asarray(value, dtype) if value is not None else (rng.standard_normal(shape) * 0.1).astype(dtype)
        inits.append(numpy_helper.from_array(arr, name))
        return name

    heads_shape = w("heads_shape", dtype=np.int64, value=[0, 0, heads, d])
    merge_shape = w("merge_shape", dtype=np.int64, value=[0, 0, h])
    n = helper.make_node
    nodes = [n("MatMul", ["x", w("wq", h, h)], ["q"]), n("MatMul", ["x", w("wk", h, h)], ["k"]),
             n("MatMul", ["x", w("wv", h, h)], ["v"])]
    for t, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [n("Reshape", [t, heads_shape], [f"{t}4"]),
                  n("Transpose", [f"{t}4"], [f"{t}h"], perm=perm)]
    nodes += [n("Shape", ["qh"], ["qshape"]),
              n("Slice", ["qshape", w("m1", dtype=np.int64, value=[-1]),
                          w("big", dtype=np.int64, value=[2**62])], ["dlen"]),
              n("Cast", ["dlen"], ["dlenf"], to=TensorProto.FLOAT),
              n("Sqrt", ["dlenf"], ["sqrt_d"]),
              n("Div", [w("one", dtype=np.float32, value=[1.0]), "sqrt_d"], ["inv"]),
              n("Sqrt", ["inv"], ["s"]),
              n("Mul", ["qh", "s"], ["qs"]), n("Mul", ["kh", "s"], ["ks"]),
              n("MatMul", ["qs", "ks"], ["scores"]),
              # BERT's additive mask, (1 - mask) * -10000: a Mul by a constant that is no scale.
              n("Sub", ["one", "attention_mask"], ["inverted"]),
              n("Mul", ["inverted", w("neg", dtype=np.float32, value=-10000.0)], ["bias"]),
              n("Add", ["scores", "bias"], ["masked"]),
              n("Softmax", ["masked"], ["probs"], axis=-1),
              n("MatMul", ["probs", "vh"], ["ctx"]),
              n("Transpose", ["ctx"], ["ctx_t"], perm=[0, 2, 1, 3]),
              n("Reshape", ["ctx_t", merge_shape], ["ctx_m"]),
              n("MatMul", ["ctx_m", w("wo", h, h)], ["attn"]),
              n("Add", ["x", "attn"], ["r1"]),
              n("MatMul", ["r1", w("wup", h, 200)], ["up"]),
              n("Relu", ["up"], ["act"]),
              n("MatMul", ["act", w("wdown", 200, h)], ["down"]),
              n("Add", ["r1", "down"], ["y"])]
    graph = helper.make_graph(
        nodes, "computed_scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", h]),
         helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["batch", 1, 1, "sequence"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence", h])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def test_scale_computed_from_the_shape_is_reported_as_computed(tmp_path):
    path = tmp_path / "computed.onnx"
    _computed_scale_model(path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": np.ones((1, 5, 96), np.float32),
                           "attention_mask": np.ones((1, 1, 1, 5), np.float32)})
    assert y.shape == (1, 5, 96)

    found = inspect_path(path)
    assert (found.num_layers, found.hidden_size, found.num_heads, found.head_dim,
            found.ffn_size, found.activation, found.vocab_size) == (1, 96, 4, 24, 200, "relu", None)
    scale = found.sites.layers[0].attention.scale
    assert scale.kind == "computed" and scale.value is None
    nodes = {node.name: node for node in load_model(path).graph}
    assert sorted(nodes[s].op_type for s in scale.nodes) == ["Mul", "Mul"]


def test_onnx_attention_op_from_opset_23(llama_opset23):
    found = inspect_path(llama_opset23)
    expect = spec("llama", "small").expect
    assert {k: getattr(found, k) for k in expect} == expect
    assert not found.optimized and "Attention" in found.fused_ops
    attn = found.sites.layers[0].attention
    assert attn.fused_op == "Attention" and attn.rotary == "full"
    assert attn.scale.kind == "attribute" and math.isclose(attn.scale.value, 0.25)
    assert attn.q and attn.k and attn.v and attn.o


def test_external_data_model_inspects_the_same(reference_model, tmp_path):
    """Weights in a side file (as big models ship) give the same dims and sites."""
    src = reference_model("qwen2", "awkward", "torchscript")
    proto = onnx.load(str(src))
    onnx.save_model(proto, str(tmp_path / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=256)
    assert (tmp_path / "model.onnx.data").stat().st_size > (tmp_path / "model.onnx").stat().st_size
    inside, outside = inspect_path(src), inspect_path(tmp_path / "model.onnx")
    assert outside.to_json() == inside.to_json()
    assert outside.sites.tied  # equal bytes read from the side file


def test_int4_quantized_graph_is_read_from_matmulnbits_attributes(reference_model, tmp_path):
    """ORT's block quantizer turns every projection into com.microsoft.MatMulNBits (K, N as
    attributes, packed uint8 weights): dims come out the same, and the graph still runs."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(reference_model("llama", "small", "torchscript"))),
                                     block_size=32, is_symmetric=True)
    quantizer.process()
    path = tmp_path / "llama-int4.onnx"
    quantizer.model.save_model_to_file(str(path), use_external_data_format=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.arange(8, dtype=np.int64).reshape(1, 8)
    (logits,) = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
    assert logits.shape == (1, 8, 1024)

    found = inspect_path(path)
    expect = spec("llama", "small").expect
    assert {k: getattr(found, k) for k in expect} == expect
    assert "com.microsoft.MatMulNBits" in found.fused_ops and not found.optimized
    assert any(f.rule == "quantized-weights" for f in audited(found).findings)
    nodes = {n.name: n for n in load_model(path).graph}
    assert nodes[found.sites.layers[0].ffn.down].op_type == "MatMulNBits"


def test_inspect_imports_neither_torch_nor_the_design_search(reference_model):
    """`tuner inspect` (and pad, verify: every command) starts in about a second: ORT's
    symbolic shape inference is loaded from its own file, since `onnxruntime.tools` imports
    torch wherever torch is installed (as here), and the design search is imported by
    `tuner design` alone."""
    path = reference_model("gpt2", "awkward", "torchscript")
    probe = ("import sys; from tuner.cli import main; "
             f"code = main(['inspect', {str(path)!r}, '--json']); "
             "print(sorted(m for m in ('torch', 'tuner.design.search') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "[]", r.stdout[-500:]
    assert '"hidden"' in r.stdout or '"hidden_size"' in r.stdout  # it did inspect
