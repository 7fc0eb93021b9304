"""A decoder that counts its positions from its cache's length takes them as an input
(tuner/rewrite/position_ids.py), on Optimum's Gemma exports (Gemma and Gemma 3: no
position_ids input): unfed it is the graph it was, bit for bit; fed the slots it is too; fed
each row's own count its rows may move (tuner.gate.row_moves); the gate fails a copy whose
fed positions are off by one; optimize makes it beside the LM head cut (or alone where the cut
is refused), and the server then batches the streams it ran one at a time, each equal to
itself alone."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from serving_support import collect

from models import optimum
from serving.generation import GenerateOptions, Generator
from serving.sampling import GenerationRequest
from serving.server import Server, ServerOptions
from tuner.cli import main
from tuner.errors import RewriteRefused
from tuner.gate.entry import prepare
from tuner.gate.row_moves import rows_move
from tuner.graph.cache_record import cache_record
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model, save_model
from tuner.graph.positions import POSITIONS
from tuner.jobs.pad import load_reference
from tuner.jobs.variants import Built, build_kept
from tuner.plan.findings import audited
from tuner.rewrite.logits_to_keep import add_logits_to_keep
from tuner.rewrite.position_ids import add_position_ids
from tuner.runtime.base import SessionSettings
from tuner.runtime.ort import OrtRunner, load_cpu
from tuner.runtime.registry import get_backend

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

VOCAB = optimum.VOCAB


@pytest.fixture(scope="module")
def exports():
    names = ("gemma", "gemma3_text", "llama", "bloom", "gpt_oss")
    return dict(zip(names, optimum.export_all([(n, optimum.TASKS[0]) for n in names])))


def _rewritten(src, dst) -> object:
    model = load_model(src)
    assert add_position_ids(model) == POSITIONS
    return save_model(model, dst)


def _session(path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3  # the defaulted input's "initializer in graph inputs" warning
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _prompt_feeds(session, ids: np.ndarray) -> dict:
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past"):
            feeds[i.name] = np.zeros((len(ids), i.shape[1], 0, i.shape[3]), np.float32)
    return feeds


@pytest.mark.parametrize("name", ["gemma", "gemma3_text"])
def test_unfed_or_fed_its_slots_it_is_the_graph_it_was(exports, name, tmp_path):
    src = exports[name]
    dst = _rewritten(src, tmp_path / "model.onnx")
    a, b = _session(src), _session(dst)
    assert POSITIONS not in {i.name for i in a.get_inputs()}
    ids = np.random.default_rng(0).integers(4, VOCAB, (2, 7))
    feeds = _prompt_feeds(a, ids)
    want = a.run(None, feeds)
    for got in (b.run(None, feeds),
                b.run(None, {**feeds, POSITIONS: np.tile(np.arange(7), (2, 1))})):
        assert all(np.array_equal(w, g) for w, g in zip(want, got))
    moved = b.run(None, {**feeds, POSITIONS: np.tile(np.arange(7) + 3, (2, 1))})
    assert not np.array_equal(want[0], moved[0])  # the fed positions are the ones used


@pytest.mark.parametrize("name", ["gemma", "gemma3_text"])
def test_fed_their_own_positions_rows_may_move(exports, name, tmp_path):
    before = cache_record(load_model(exports[name]))
    assert before.position_ids is None
    assert not rows_move(OrtRunner(load_cpu(exports[name])), before)
    dst = _rewritten(exports[name], tmp_path / "model.onnx")
    after = cache_record(load_model(dst))
    assert after.position_ids == POSITIONS  # the engine feeds it like any position input
    assert rows_move(OrtRunner(load_cpu(dst)), after)


def test_inspect_says_so_until_the_graph_takes_them(exports, tmp_path):
    shape = audited(inspect_model(load_model(exports["gemma3_text"])))
    assert shape.sites.slot_positions is not None
    assert "positions-from-cache-length" in {f.rule for f in shape.findings}
    given = audited(inspect_model(load_model(_rewritten(exports["gemma3_text"],
                                                        tmp_path / "model.onnx"))))
    assert given.sites.slot_positions is None
    assert "positions-from-cache-length" not in {f.rule for f in given.findings}
    for name in ("llama", "bloom"):  # fed positions; ALiBi from the mask
        assert audited(inspect_model(load_model(exports[name]))).sites.slot_positions is None


def test_refused_where_positions_are_not_counted_from_the_cache(exports):
    with pytest.raises(RewriteRefused, match="takes position ids already"):
        add_position_ids(load_model(exports["llama"]))
    with pytest.raises(RewriteRefused, match="no rotary positions"):
        add_position_ids(load_model(exports["bloom"]))  # ALiBi from the mask: nothing to give
    plain = optimum.cached("gemma", optimum.TASKS[1])  # no cache: positions are the sequence
    with pytest.raises(RewriteRefused, match="no KV cache"):
        add_position_ids(load_model(plain))


def _off_by_one(path, dst):
    """The rewrite with its fed positions one too many (its default path still right)."""
    model = load_model(path)
    graph = model.graph
    where = next(n for n in graph if n.op_type == "Where" and "fed_" in (n.name or ""))
    one = ir.Value(name="bad_one", const_value=ir.tensor(np.array(1, np.int64)),
                   shape=ir.Shape([]), type=ir.TensorType(ir.DataType.INT64))
    graph.register_initializer(one)
    plus = ir.node("Add", [where.inputs[2], one], name="bad_plus")
    graph.insert_before(where, plus)
    where.replace_input_with(2, plus.outputs[0])
    return save_model(model, dst)


def test_the_gate_feeds_the_slots_and_fails_a_copy_off_by_one(exports, tmp_path):
    src = exports["gemma3_text"]
    good = _rewritten(src, tmp_path / "good" / "model.onnx")
    bad = _off_by_one(good, tmp_path / "bad" / "model.onnx")
    gate = prepare(src, lambda: load_reference(src), good, vocab=VOCAB)
    try:
        assert gate.positions == POSITIONS
        result = gate.check(OrtRunner(load_cpu(good)), good)
        assert result.passed, result.table()
        assert "fed position_ids as its slots" in result.tolerance
        assert not gate.check(OrtRunner(load_cpu(bad)), bad).passed
    finally:
        gate.close()


def _ids(chunks) -> list[int]:
    return [t for c in chunks for t in c.ids]


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])  # GPT-OSS: sinks, window, experts
def test_optimize_gives_the_positions_and_the_server_batches_exactly(exports, name, tmp_path):
    src, art = exports[name], tmp_path / "art"
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt_tokens": p, "output_tokens": 8}) + "\n"
                               for p in (6, 18, 30)))
    assert main(["optimize", str(src), "-o", str(art), "--requests", str(traffic),
                 "--rounds", "2", "--warmup", "0", "--bucket-rounds", "1", "--no-probe",
                 "--no-fuse", "--max-variants", "1", "--no-cache", "--max-buckets", "2",
                 "--no-plots"]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    chosen = next(v for v in manifest["variants"] if v["name"] == manifest["selected"])
    assert [t["kind"] for t in chosen["transforms"]][-2:] == ["last-logits", "positions"]
    assert (art / "tokenizer.json").is_file()  # Optimum's folder carries it: text endpoints
    server = Server(art, ServerOptions(port=0, http_port=0, metrics_port=0),
                    say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        gen = server.slot.engine.generator
        assert not gen.rows_stay and gen.options.max_streams > 1  # batched again
        prompts = [(6, 17, 301, 9, 42, 7), (5, 9) * 9, (11, 11, 11), tuple(range(20, 50))]
        requests = [GenerationRequest(p, 24) for p in prompts]
        alone = [_ids(collect(gen, [r])[0]) for r in requests]
        assert [_ids(c) for c in collect(gen, requests)] == alone
        _openai_together_as_alone(server.http_port)
    finally:
        server.stop(5)
    record = cache_record(load_model(src))
    plain = Generator(OrtRunner(load_cpu(src)), record, VOCAB, GenerateOptions(),
                      max_positions=256)
    try:  # the graph as exported: the same greedy tokens, one stream at a time
        assert plain.rows_stay
        assert [_ids(collect(plain, [r])[0]) for r in requests] == alone
    finally:
        plain.close()


def _openai_together_as_alone(port: int) -> None:
    """The openai client's completions, greedy, of texts of different lengths: sent at once
    (batched), each as sent alone."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    model = client.models.list().data[0].id
    texts = [" ".join(f"w{i}" for i in range(5, 5 + n)) for n in (3, 19, 1, 33)]

    def complete(text: str) -> str:
        return client.completions.create(model=model, prompt=text, max_tokens=12,
                                         temperature=0).choices[0].text

    alone = [complete(t) for t in texts]
    with ThreadPoolExecutor(len(texts)) as pool:
        assert list(pool.map(complete, texts)) == alone
    assert any(alone)


def test_where_the_cut_is_refused_the_positions_are_still_given(exports, tmp_path):
    """A graph cut already (the cut refuses: the input is there) still gets its positions:
    the variant `positions`, gated, the cut's refusal in its note."""
    base_path = tmp_path / "original" / "model.onnx"
    model = load_model(exports["gemma"])
    add_logits_to_keep(model)
    save_model(model, base_path)
    gate = prepare(base_path, lambda: load_reference(base_path), vocab=VOCAB)
    try:
        base = Built("original", base_path, "original/model.onnx", True, (), None)
        made = build_kept(base, gate, get_backend("ort-cpu"), SessionSettings())
    finally:
        gate.close()
    assert made.name == "positions" and made.path == base_path.parent / "positions.onnx"
    assert [t.kind for t in made.transforms] == ["positions"]
    assert made.accuracy.passed and "already has an input 'logits_to_keep'" in made.note
    assert cache_record(load_model(made.path)).position_ids == POSITIONS
