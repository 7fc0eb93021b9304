"""Our reference exports quantized by ONNX Runtime's own quantizer (models/quantize.py):
quantize_dynamic (DynamicQuantizeLinear + MatMulInteger; int8, uint8 and per-channel weights),
quantize_static (QDQ, a small calibration reader), MatMulNBitsQuantizer (4 bits with and
without zero points, 8 bits, HQQ's float zero points, and as QDQ: int4 behind DequantizeLinear
with block-wise scales) and MatMulBnb4Quantizer (NF4: transformers.js' model_bnb4.onnx), on
Llama (GQA) with and without its KV cache and GPT-2.

- inspect reads the dims through the quantized weights;
- the gate passes each quantized model against itself and FAILS a corrupted copy;
- vocab and FFN padding are exact: every new weight entry holds its zero point, so it
  dequantizes to exactly 0 (checked on the stored tensors, not only by running);
- per-channel dynamic weights pad their zero points and scales; head dim / heads through any
  quantized weight are refused with the node named;
- served, a dynamic graph's requests are never padded or joined (one activation range per
  run couples them); a static one's are;
- a static graph whose value cache leaves through a Quantize/DequantizeLinear round trip
  (GPT-2, Phi) has its cache found and generates as a plain loop over it does.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from serving_support import perturbed_copy

from models.build import spec
from models.quantize import cached
from tuner.cli import main
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model
from tuner.rewrite import bnb4, dq_weight, nbits
from tuner.rewrite.common import const_array

EXACT = ["dynamic", "dynamic-u8", "static", "nbits", "nbits-asym", "nbits8", "qdq4", "qdq4-asym"]
CELLS = [(k, n) for k in EXACT for n in ("llama", "llama-kv")] + [("dynamic", "gpt2"),
                                                                   ("static", "gpt2")]


def _ids(cells):
    return [f"{k}-{n}" for k, n in cells]


@pytest.mark.parametrize("kind, name", CELLS + [("dynamic-pc", "llama")],
                         ids=_ids(CELLS + [("dynamic-pc", "llama")]))
def test_inspect_reads_the_dims_through_the_quantized_weights(kind, name):
    shape = inspect_model(load_model(cached(kind, name)))
    expect = spec(name, "awkward").expect
    assert {k: getattr(shape, k) for k in expect} == expect
    assert (shape.cache is not None) == name.endswith("-kv")
    assert any(f in shape.fused_ops for f in ("MatMulInteger", "DequantizeLinear",
                                              "com.microsoft.MatMulNBits"))


# the gate on every kind with its cache (rollouts), and on two plain graphs
GATE = [(k, "llama-kv") for k in EXACT] + [("dynamic", "gpt2"), ("nbits-asym", "llama")]


@pytest.mark.parametrize("kind, name", GATE, ids=_ids(GATE))
def test_gate_passes_the_model_on_itself_and_fails_a_corrupted_copy(kind, name, tmp_path,
                                                                     capsys):
    model = cached(kind, name)
    assert main(["verify", str(model), str(model)]) == 0
    assert main(["verify", str(model), str(perturbed_copy(model, tmp_path / "bad.onnx"))]) == 1
    assert "FAIL" in capsys.readouterr().out


def _weight_and_zero(model: ir.Model, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(dequantizable integer weight as (N, K) or (K, N) as stored, its zero points)."""
    node = next(n for n in model.graph if n.name == name)
    if nbits.is_nbits(node):
        w = nbits.read(node)
        return w.q.reshape(w.n, -1)[:, :w.k], np.repeat(w.zero, w.block, axis=1)[:, :w.k]
    if node.op_type == "MatMulInteger":  # a zero point per tensor or per column
        w, zp = const_array(node.inputs[1]), const_array(node.inputs[3])
        return w, np.broadcast_to(zp.reshape(-1), w.shape) if zp.size > 1 else zp
    w = dq_weight.read(node.inputs[1].producer())  # QDQ: per tensor, or block-wise int4
    zero = w.grid(w.zero, *w.q.shape) if w.zero is not None else np.zeros((), w.q.dtype)
    return w.q.astype(np.int32), np.asarray(zero).astype(np.int32)


@pytest.mark.parametrize("kind, name", [(k, "llama") for k in EXACT],
                         ids=_ids([(k, "llama") for k in EXACT]))
def test_vocab_and_ffn_padding_store_zero_points_and_stay_exact(kind, name, tmp_path):
    src = cached(kind, name)
    out = tmp_path / "pad.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                 "--ffn-multiple", "64"]) == 0  # the gate ran, at the default tolerance
    before, after = load_model(src), load_model(out)
    shape = inspect_model(before)
    padded = inspect_model(after)
    assert (padded.vocab_size, padded.ffn_size) == (1024, 448)
    quantized_n = kind.startswith("nbits")  # stored (N, K), else (K, N)
    head, zero = _weight_and_zero(after, shape.sites.lm_head)
    new_rows = head[1003:] if quantized_n else head[:, 1003:]
    zeros = (zero[1003:] if quantized_n else zero[:, 1003:]) if zero.ndim == 2 else zero
    assert new_rows.size and np.array_equal(new_rows, np.broadcast_to(zeros, new_rows.shape))
    down, zero = _weight_and_zero(after, shape.sites.layers[0].ffn.down)
    new = down[:, 426:] if quantized_n else down[426:]
    zeros = (zero[:, 426:] if quantized_n else zero[426:]) if zero.ndim == 2 else zero
    assert new.size and np.array_equal(new, np.broadcast_to(zeros, new.shape))
    old_down, _ = _weight_and_zero(before, shape.sites.layers[0].ffn.down)
    assert np.array_equal(down[:, :426] if quantized_n else down[:426], old_down)


@pytest.mark.parametrize("kind", ["dynamic", "static", "nbits-asym"])
def test_padding_a_cache_model_keeps_its_rollouts_exact(kind, tmp_path):
    src = cached(kind, "llama-kv")
    out = tmp_path / "pad.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                 "--ffn-multiple", "64"]) == 0
    assert main(["verify", str(src), str(out)]) == 0  # greedy rollouts, each fed its present


def test_per_channel_dynamic_weights_pad_their_zero_points_and_scales(tmp_path):
    """A zero point and a weight scale per column (refused before 2026-12-05): new columns
    get zero point 0 and weight 0, and the scale vector the dequantizing Mul multiplies in
    grows with them (0 there); gated, so exact."""
    src = cached("dynamic-pc", "llama")
    out = tmp_path / "x.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                 "--ffn-multiple", "64"]) == 0
    model = load_model(out)
    head = next(n for n in model.graph if n.name == "/model/lm_head/MatMul_quant")
    w, zp = const_array(head.inputs[1]), const_array(head.inputs[3])
    assert w.shape[1] == zp.shape[0] == 1024 and not w[:, 1003:].any() and not zp[1003:].any()


@pytest.mark.parametrize("kind", ["dynamic", "static", "nbits"])
def test_head_dim_through_quantized_weights_is_refused_naming_the_node(kind, tmp_path, capsys):
    src = cached(kind, "llama")
    assert main(["pad", str(src), "-o", str(tmp_path / "x.onnx"), "--head-dim", "128"]) == 2
    err = capsys.readouterr().err
    assert "q_proj" in err and "quantized" in err


def test_an_ungated_ffn_whose_padded_units_are_not_zero_is_refused():
    """DynamicQuantizeLinear reads the padded units' range: act(0) must be exactly 0."""
    from tuner.errors import RewriteRefused
    from tuner.rewrite.ffn import pad_ffns

    model = load_model(cached("dynamic", "gpt2"))
    site = inspect_model(model).sites.layers[0].ffn
    odd = type(site)(up=site.up, down=site.down, gate=None, activation="sigmoid")
    with pytest.raises(RewriteRefused, match="sigmoid FFN: its padded units would not be "
                                             "exactly 0"):
        pad_ffns(model, [(0, odd)], 640)


def test_nbits_padding_writes_zero_point_blocks_with_scale_zero():
    """Unit check of tuner.rewrite.nbits on an asymmetric 4-bit head: new rows and blocks are
    q == zero point (scale 0 on new blocks), old ones untouched, packing round-trips."""
    model = load_model(cached("nbits-asym", "llama"))
    head = inspect_model(model).sites.lm_head
    node = next(n for n in model.graph if n.name == head)
    before = nbits.read(node)
    assert before.zero_given and before.zero_packed
    nbits.widen_out(model.graph, node, 1024, "t")
    after = nbits.read(node)
    assert np.array_equal(after.q[:1003], before.q) and np.array_equal(after.zero[:1003],
                                                                       before.zero)
    assert np.array_equal(after.q[1003:], np.broadcast_to(after.zero[1003:, :, None],
                                                          after.q[1003:].shape))
    assert not after.scales[1003:].any()
    nbits.widen_in(model.graph, node, 200, "k")  # K 160 -> 200: one new, partly used block
    grown = nbits.read(node)
    assert grown.blocks == 7 and not grown.scales[:, 5:].any()
    deq = (grown.q.astype(np.int32) - grown.zero[:, :, None]).reshape(1024, -1)
    assert not deq[:, 160:].any()


def test_hqq_float_zero_points_pad_exactly_through_zero_scales_and_zero_units(tmp_path):
    """HQQ's zero points are floats, not integers: no stored value dequantizes to exactly 0
    (`widen_in` alone still refuses the old block's tail). Padding goes through all the same:
    new LM-head rows and new blocks have scale 0, and the down projection's tail entries,
    nearly 0, multiply padded units that are exactly 0 (a gated FFN). The gate runs it."""
    from tuner.errors import RewriteRefused

    src = cached("nbits-hqq", "llama")
    model = load_model(src)
    shape = inspect_model(model)
    down = next(n for n in model.graph if n.name == shape.sites.layers[0].ffn.down)
    w = nbits.read(down)
    assert not w.zero_packed and not np.all(w.zero == np.round(w.zero))
    with pytest.raises(RewriteRefused, match="float zero points that are not integers"):
        nbits.widen_in(model.graph, down, 448, "t")
    out = tmp_path / "pad.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                 "--ffn-multiple", "64"]) == 0  # gated, at the default tolerance
    after = load_model(out)
    head = nbits.read(next(n for n in after.graph if n.name == shape.sites.lm_head))
    assert head.n == 1024 and not head.scales[1003:].any()
    grown = nbits.read(next(n for n in after.graph if n.name == shape.sites.layers[0].ffn.down))
    assert grown.k == 448 and not grown.scales[:, w.blocks:].any()  # 426 -> 448: 14 blocks


def test_optimize_a_quantized_cache_model_writes_an_artifact(tmp_path):
    import json

    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text(json.dumps({"prompt_tokens": 5, "output_tokens": 8}) + "\n")
    out = tmp_path / "out"
    assert main(["optimize", str(cached("nbits-asym", "llama-kv")), "-o", str(out),
                 "--requests", str(traffic), "--rounds", "2", "--warmup", "0",
                 "--bucket-rounds", "1", "--no-probe", "--no-fuse", "--max-variants", "2",
                 "--no-cache", "--max-buckets", "2", "-q", "--no-plots"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    padded = [v for v in manifest["variants"] if v["name"] != "original"]
    assert padded and all(v["accuracy"]["passed"] and v["exact"] for v in padded)


@pytest.mark.parametrize("kind, apart", [("dynamic", False), ("static", True)])
def test_a_request_is_never_joined_where_padding_changes_its_outputs(kind, apart, tmp_path):
    """quantize_dynamic takes one activation range over the whole run: a request padded and
    joined with a longer one changes (0.07 on BERT's hidden states), so the server, which
    runs it both ways before it serves (serving.model._rows_apart), never joins or pads such
    requests, whatever --max-batch and --pad-to say, unless --allow-batch-variance; static
    QDQ's constant scales do not."""
    from serving_support import make_artifact

    from serving.engine import Engine, EngineOptions
    from serving.model import load_artifact
    from serving.metrics import Stats

    path = cached(kind, "bert")
    model = load_artifact(make_artifact(tmp_path / "art", path))
    assert model.layout.rows_apart is apart
    for variance in (False, True):  # --allow-batch-variance: as asked, all the same
        engine = Engine(model, EngineOptions(max_batch=4, pad_to="bucket",
                                             batch_variance=variance), Stats())
        try:
            asked = apart or variance
            assert (engine.join_rows, engine.pad_to) == ((4, "bucket") if asked
                                                         else (1, "longest"))
            assert ("never joined" in engine.batch_note) is not asked
        finally:
            engine.close()


def test_bnb4_weights_inspect_gate_and_pad_exactly(tmp_path, capsys):
    """transformers.js repositories' model_bnb4.onnx (com.microsoft.MatMulBnb4, NF4): every
    command stopped at "no attention" before (its GEMMs were not projections). inspect reads
    the dims and the cache, the gate passes it on itself and FAILS a corrupted copy, the
    vocabulary pads exactly (new rows: NF4's zero code with absmax 0), and a down projection
    whose rows straddle the blocks (K 426, blocks of 32) is refused, naming the node."""
    src = cached("bnb4", "llama-kv")
    shape = inspect_model(load_model(src))
    expect = spec("llama-kv", "awkward").expect
    assert {k: getattr(shape, k) for k in expect} == expect and shape.cache is not None
    assert "com.microsoft.MatMulBnb4" in shape.fused_ops
    assert main(["verify", str(src), str(src)]) == 0
    assert main(["verify", str(src), str(perturbed_copy(src, tmp_path / "bad.onnx"))]) == 1
    out = tmp_path / "pad.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64"]) == 0  # gated
    after, before = (bnb4.read(next(n for n in load_model(p).graph
                                    if n.name == shape.sites.lm_head)) for p in (out, src))
    assert after.n == 1024 and np.array_equal(after.rows[:1003], before.rows)
    assert (after.rows[1003:] == 0x77).all() and not after.absmax[1003:].any()
    assert main(["pad", str(src), "-o", str(tmp_path / "ffn.onnx"), "--ffn-multiple", "64"]) == 2
    assert "down_proj" in (err := capsys.readouterr().err) and "straddle its blocks" in err


def test_bnb4_ffn_padding_appends_whole_zero_blocks(tmp_path):
    """MiniLM's real weights in NF4 blocks of 64 (K 384 and 1536: whole blocks per row): FFN
    1536 -> 2048 adds whole blocks to the down projection's rows and rows to the up
    projection, all zero codes with absmax 0; gated, max abs 0."""
    import onnx
    from onnxruntime.quantization.matmul_bnb4_quantizer import MatMulBnb4Quantizer

    from models.build import cached as reference

    q = MatMulBnb4Quantizer(onnx.load(str(reference("minilm", "real", "torchscript"))),
                            quant_type=MatMulBnb4Quantizer.NF4, block_size=64)
    q.process()
    src, out = tmp_path / "minilm-bnb4.onnx", tmp_path / "pad.onnx"
    onnx.save(q.model.model, str(src))
    assert main(["pad", str(src), "-o", str(out), "--ffn-multiple", "1024"]) == 0
    down = inspect_model(load_model(src)).sites.layers[0].ffn.down
    w = bnb4.read(next(n for n in load_model(out).graph if n.name == down))
    assert (w.k, w.n) == (2048, 384)
    assert (w.rows[:, 768:] == 0x77).all() and not w.absmax[:, 24:].any()


@pytest.mark.parametrize("name", ["gpt2-kv", "phi-kv"])
def test_a_static_qdq_value_cache_is_found_and_generates(name):
    """quantize_static puts a Quantize- and DequantizeLinear round trip between these
    models' value Concats and their `present.N.value` outputs: `optimize` stopped there ("a
    cache model should return logits and the cache; it returns 3 other outputs"). The round
    trip is followed now, and the engine's greedy streams equal a plain ONNX Runtime loop
    over the export, which feeds each round-tripped present back as its past."""
    import onnxruntime as ort
    from greedy_loops import greedy_cache
    from serving_support import collect

    from serving.generation import GenerateOptions, Generator
    from serving.sampling import GenerationRequest
    from tuner.graph.cache_record import cache_record
    from tuner.runtime.ort import OrtRunner, load_cpu

    src = cached("static", name)
    graph = load_model(src).graph
    assert any(o.producer().op_type == "DequantizeLinear" for o in graph.outputs
               if o.name.startswith("present"))  # the layout under test
    record = cache_record(load_model(src))
    assert sorted(record.past_to_present.values()) == sorted(
        o.name for o in graph.outputs if o.name.startswith("present"))
    prompts = [tuple(int(t) for t in np.random.default_rng(s).integers(0, 1000, 9))
               for s in (1, 2)]
    session = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    want = [greedy_cache(session, np.array([p]), 12).tokens[0].tolist() for p in prompts]
    vocab = inspect_model(load_model(src)).vocab_size
    gen = Generator(OrtRunner(load_cpu(str(src))), record, vocab, GenerateOptions(),
                    max_positions=256)
    try:
        got = collect(gen, [GenerationRequest(p, 12) for p in prompts])
    finally:
        gen.close()
    assert [[t for c in chunks for t in c.ids] for chunks in got] == want
