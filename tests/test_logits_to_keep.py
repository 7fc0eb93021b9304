"""The LM head on the positions a step reads (tuner/rewrite/logits_to_keep.py): exact on the
kept positions and, by default, the graph it was; the gate runs the cut as the server runs
its prompts and fails corrupted copies; the engine asks for each row's last logits alone
unless a stream wants its prompt's log-probs; optimize serves a decoder's winner cut."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from llm_support import cut_copy
from serving_support import collect

from models import genai_builder, quantize
from models.build import EXPORTERS, cached
from serving.generation import GenerateOptions, Generator
from serving.sampling import GenerationRequest
from tuner.cli import main
from tuner.errors import RewriteRefused
from tuner.gate.entry import prepare
from tuner.gate.kv_feeds import prefill_feeds
from tuner.graph.cache_record import cache_record
from tuner.graph.inspect import inspect_model
from tuner.graph.lm_head import KEEP
from tuner.graph.load import load_model, save_model
from tuner.jobs.pad import load_reference
from tuner.plan.findings import audited, head_share
from tuner.rewrite.logits_to_keep import add_logits_to_keep
from tuner.runtime.ort import OrtRunner, load_cpu

VOCAB = 1003


def _session(path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_cut_keeps_the_last_positions_exactly_and_all_by_default(family, exporter, tmp_path):
    src = cached(f"{family}-kv", "awkward", exporter)
    cut = cut_copy(src, tmp_path / "model.onnx")
    record = cache_record(load_model(cut))
    assert record.keep_logits == KEEP
    ids = np.random.default_rng(0).integers(0, VOCAB, (2, 9))  # inside every vocabulary
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    feeds = dict(prefill_feeds(record, ids, mask).arrays)
    a, b = _session(src), _session(cut)
    assert KEEP not in {i.name for i in b.get_inputs()}  # a default: callers need not feed it
    names = [o.name for o in a.get_outputs()]
    want = dict(zip(names, a.run(None, feeds)))
    got = dict(zip(names, b.run(None, feeds)))  # not fed: every position, bit for bit
    assert all(np.array_equal(want[n], got[n]) for n in names)
    for k in (1, 3, 9, 20):  # k > S keeps all
        kept = dict(zip(names, b.run(None, {**feeds, KEEP: np.array(k, np.int64)})))
        assert kept[record.logits].shape == (2, min(k, 9), want[record.logits].shape[-1])
        assert np.array_equal(kept[record.logits], want[record.logits][:, -min(k, 9):])
        assert all(np.array_equal(kept[n], want[n]) for n in names if n != record.logits)


def _corrupted(cut, dst, how: str):
    """The cut with its kept path wrong and its default path right: `shape` keeps k + 1
    positions when k > 0; `values` scales the kept positions by 1.01 when k > 0."""
    model = load_model(cut)
    graph = model.graph
    where = next(n for n in graph if n.op_type == "Where" and "keep" in n.name)
    equal = where.inputs[0]
    if how == "shape":
        one = ir.Value(name="bad_one", const_value=ir.tensor(np.array([1], np.int64)),
                       shape=ir.Shape([1]), type=ir.TensorType(ir.DataType.INT64))
        graph.register_initializer(one)
        plus = ir.node("Add", [where.inputs[2], one], name="bad_plus")
        graph.insert_before(where, plus)
        where.replace_input_with(2, plus.outputs[0])
    else:
        cut_node = next(n for n in graph if n.op_type == "Slice" and "keep" in n.name)
        out = cut_node.outputs[0]
        consts = {}
        for name, value in (("bad_a", -0.01), ("bad_b", 1.01)):
            consts[name] = ir.Value(name=name, const_value=ir.tensor(np.array(value, np.float32)),
                                    shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT))
            graph.register_initializer(consts[name])
        flag = ir.node("Cast", [equal], attributes={"to": ir.DataType.FLOAT}, name="bad_cast")
        scale = ir.node("Mul", [flag.outputs[0], consts["bad_a"]], name="bad_scale")
        factor = ir.node("Add", [scale.outputs[0], consts["bad_b"]], name="bad_factor")
        scaled = ir.node("Mul", [out, factor.outputs[0]], name="bad_mul")
        head = next(u for u, _ in out.uses())
        graph.insert_after(cut_node, [flag, scale, factor, scaled])
        head.replace_input_with(0, scaled.outputs[0])
    return save_model(model, dst)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_the_gate_runs_the_kept_logits_and_fails_corrupted_copies(exporter, tmp_path):
    src = cached("llama-kv", "awkward", exporter)
    cut = cut_copy(src, tmp_path / "cut" / "model.onnx")
    gate = prepare(src, lambda: load_reference(src), cut)
    assert gate.kept
    result = gate.check(OrtRunner(load_cpu(cut)), cut)
    assert result.passed, result.table()
    row = next(o for o in result.outputs if KEEP in o.name)
    assert row.compared > 0 and row.max_abs == 0.0
    for how in ("shape", "values"):
        bad = _corrupted(cut, tmp_path / how / "model.onnx", how)
        failed = gate.check(OrtRunner(load_cpu(bad)), bad)
        assert not failed.passed
        # the default path is untouched: only the kept logits fail
        assert [o.name for o in failed.outputs if not o.passed] == [row.name], failed.table()
    gate.close()


@pytest.mark.parametrize("kind", ["dynamic", "dynamic-u8", "static", "nbits-asym"])
def test_onnx_runtimes_quantized_graphs_are_cut_exactly(kind, tmp_path):
    """ONNX Runtime's quantizer puts a run-time scale (quantize_dynamic: x_scale * w_scale,
    a scalar), a QuantizeLinear/DequantizeLinear pair (quantize_static) or MatMulNBits
    between the head's input and the logits: each acts position by position, so the cut
    passes the gate, its kept logits equal to the quantized original's (MatMulNBits: to
    float rounding)."""
    src = quantize.cached(kind, "llama-kv")
    cut = cut_copy(src, tmp_path / "model.onnx")
    gate = prepare(src, lambda: load_reference(src), cut)
    result = gate.check(OrtRunner(load_cpu(cut)), cut)
    gate.close()
    assert result.passed, result.table()
    row = next(o for o in result.outputs if KEEP in o.name)
    # MatMulNBits sums one row in another order than many (its M = 1 kernel): float rounding
    assert row.compared > 0 and row.max_abs <= (1e-5 if kind.startswith("nbits") else 0.0)


def test_a_graph_cut_already_or_mixing_positions_after_the_head_is_refused(tmp_path):
    model = load_model(cached("llama-kv", "awkward", "torchscript"))
    head = inspect_model(model).sites.lm_head
    add_logits_to_keep(model, head)
    with pytest.raises(RewriteRefused, match="already has an input 'logits_to_keep'"):
        add_logits_to_keep(model, head)
    model = load_model(cached("llama-kv", "awkward", "torchscript"))
    node = next(n for n in model.graph if n.name == head)
    out = node.outputs[0]  # (B, S, vocab) -> swapped to (S, B, vocab) and back: mixes rows
    placeholder = ir.Value(name="placeholder")
    out.replace_all_uses_with(placeholder, replace_graph_outputs=True)
    flipped = ir.node("Transpose", [out], attributes={"perm": [1, 0, 2]}, name="mixer")
    unflipped = ir.node("Transpose", [flipped.outputs[0]], attributes={"perm": [1, 0, 2]},
                        name="unmixer")
    placeholder.replace_all_uses_with(unflipped.outputs[0], replace_graph_outputs=True)
    model.graph.insert_after(node, [flipped, unflipped])
    with pytest.raises(RewriteRefused, match="Transpose 'mixer' between the LM head"):
        add_logits_to_keep(model, head)


class Recording:
    """A runner that records (ids shape, logits shape) of every run of more than one new
    token."""

    def __init__(self, path, logits: str) -> None:
        self.runner, self.logits, self.prefill_shapes = OrtRunner(load_cpu(path)), logits, []

    def infer(self, feeds):
        out = self.runner.infer(feeds)
        ids = next(iter(feeds.values())).shape  # input_ids come first
        if ids[1] > 1:
            self.prefill_shapes.append((ids, out[self.logits].shape))
        return out


def _run(gen: Generator, requests) -> list[list[int]]:
    return [[t for c in chunks for t in c.ids] for chunks in collect(gen, requests)]


def test_the_engine_asks_for_the_last_logits_unless_a_prompt_wants_its_log_probs(tmp_path):
    """Prompts of different lengths in chunks beside decoding rows, a shared prefix (cache
    hits): the cut graph generates the tokens the original does, its prompt runs return one
    position per row; a stream that asks for its prompt's log-probs gets every position."""
    src = cached("llama-kv", "awkward", "torchscript")
    cut = cut_copy(src, tmp_path / "model.onnx")
    record = cache_record(load_model(cut))
    rng = np.random.default_rng(3)
    shared = tuple(int(t) for t in rng.integers(0, VOCAB, 40))
    prompts = [shared + tuple(int(t) for t in rng.integers(0, VOCAB, n)) for n in (5, 23, 61)]
    requests = [GenerationRequest(p, 12) for p in prompts]
    # speculate=0: a speculative run reads every position it feeds (tests/test_speculation.py)
    options = GenerateOptions(prefill_tokens=32, max_streams=2, prefix_block=8, speculate=0)
    want = _run(Generator(OrtRunner(load_cpu(src)), cache_record(load_model(src)), VOCAB,
                          options, max_positions=256), requests)
    recording = Recording(cut, record.logits)
    got = _run(Generator(recording, record, VOCAB, options, max_positions=256), requests)
    assert got == want
    assert recording.prefill_shapes and all(got[1] == 1 for _, got in recording.prefill_shapes)
    asking = GenerationRequest(prompts[0], 4, prompt_logprobs=0)
    gen = Generator(recording, record, VOCAB, options, max_positions=256)
    recording.prefill_shapes.clear()  # not the engine's own checks as it starts (last only)
    _run(gen, [asking])
    assert all(got[1] == ids[1] for ids, got in recording.prefill_shapes)  # every position


@pytest.mark.venv(*genai_builder.VENV)
def test_rows_at_the_start_with_bucket_padding_keep_every_real_rows_last_token(tmp_path):
    """onnxruntime-genai's graph (rows at the start: each row's last token at its own slot)
    with batches padded to buckets (padding rows end at slot 0): a prompt run keeps the
    fewest last positions that hold every real row's last token, and the streams generate
    what the uncut graph generates."""
    src = genai_builder.cached("llama", "fp32")
    cut = cut_copy(src, tmp_path / "model.onnx")
    record = cache_record(load_model(cut))
    rng = np.random.default_rng(5)
    requests = [GenerationRequest(tuple(int(t) for t in rng.integers(3, 1003, n)), 6)
                for n in (12, 13, 14)]
    options = GenerateOptions(batch_buckets=(4,), prefill_tokens=64)
    want = _run(Generator(OrtRunner(load_cpu(src)), cache_record(load_model(src)), 1003,
                          options, max_positions=128, pad_to="bucket"), requests)
    recording = Recording(cut, record.logits)
    got = _run(Generator(recording, record, 1003, options, max_positions=128, pad_to="bucket"),
               requests)
    assert got == want
    # every run padded to 4 rows, each keeping fewer positions than it fed: the padding rows
    # end at slot 0, and their logits are never read (all three prompts share a run when
    # they reach the engine together: then the shortest ends at slot 11 of 14, 3 kept)
    shapes = recording.prefill_shapes
    assert shapes and all(ids[0] == 4 and got[1] < ids[1] for ids, got in shapes), shapes


def test_optimize_serves_a_decoders_winnercut_copy(tmp_path):
    src = cached("llama-kv", "awkward", "torchscript")
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), "--rounds", "2", "--warmup", "0",
                 "--bucket-rounds", "1", "--no-probe", "--no-fuse", "--max-variants", "1",
                 "--no-cache", "--max-buckets", "2", "--quiet", "--no-plots"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    chosen = next(v for v in manifest["variants"] if v["name"] == manifest["selected"])
    assert chosen["name"].endswith("last-logits")
    assert chosen["transforms"][-1]["kind"] == "last-logits" and chosen["accuracy"]["passed"]
    assert "logits_to_keep" in manifest["selection"]
    assert cache_record(load_model(out / chosen["path"])).keep_logits == KEEP
    # the original stays the user's graph: the reference the server gates against
    assert cache_record(load_model(out / "variants/original/model.onnx")).keep_logits is None


def test_inspect_says_what_share_of_a_prompt_the_head_takes_until_it_iscut_copy(tmp_path):
    src = cached("llama-kv", "awkward", "torchscript")
    found = audited(inspect_model(load_model(src)))
    note = next(f for f in found.findings if f.rule == "logits-every-position")
    assert f"({head_share(found):.0%} of a prompt token's GEMM work)" in note.message
    cut = audited(inspect_model(load_model(cut_copy(src, tmp_path / "model.onnx"))))
    assert cut.sites.logits_to_keep == KEEP
    assert not any(f.rule == "logits-every-position" for f in cut.findings)
    plain = audited(inspect_model(load_model(cached("llama", "awkward", "torchscript"))))
    assert plain.cache is None and not any(f.rule == "logits-every-position"
                                           for f in plain.findings)  # no server generates
    # GPT-2 small: 12 layers of 4 h^2 (attention) + 8 h^2 (FFN), h = 768; head h x 50257
    gpt2 = replace(found, num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=12,
                   head_dim=64, ffn_size=3072, ffn_gated=False, vocab_size=50257)
    assert head_share(gpt2) == pytest.approx(768 * 50257 / (12 * 12 * 768**2 + 768 * 50257))
