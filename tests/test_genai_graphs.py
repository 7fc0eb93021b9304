"""onnxruntime-genai's own graphs (its model builder, `-p fp32|int4 -e cpu` and the GPU builds
`-p fp16|int4 -e cuda`, in its own venv: models/genai_builder.py) through every command:
GroupQueryAttention reading seqlens_k / total_sequence_length from the mask, rotary inside it,
SkipSimplifiedLayerNormalization, MatMulNBits int4 weights, genai's own I/O names.

- inspect finds the dims, the cache (its head dim from the packed projection) and that the
  mask is read as lengths;
- the gate's left-padded rollouts, moved to right padding for such a graph, equal transformers
  on the same weights, `tuner verify m m` passes and a corrupted copy FAILS;
- vocab and FFN padding through MatMulNBits are exact (new rows and blocks dequantize to 0),
  head dim / heads are refused naming the GroupQueryAttention node;
- `tuner optimize` writes an artifact, and `tuner serve` generates from it with in-flight
  batching, token-identically to a plain ORT greedy loop on the original (every family);
- the engine feeds such a graph its rows from position 0: rows of different lengths, chunked
  prefill, prefix hits and preemption each give what a plain greedy loop gives;
- Gemma 2's and GPT-OSS's windowed caches are read (served: tests/test_unwindow.py); a GPU
  build the CPU provider cannot run is bad input, not a failed gate.

Over 400 lines because it walks one exporter's graphs through every command in order, the
builds shared by all of them; split, each part would build them again.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException
from serving_support import collect, perturbed_copy

from models import genai_builder
from serving.generation import GenerateOptions, Generator
from serving.generation.output import GenerationStats
from serving.sampling import GenerationRequest
from serving.server import Server, ServerOptions
from tuner.cli import main
from tuner.gate.decode_step import next_feeds as next_step
from tuner.gate.decode_step import pad_rows, row_cache, step_feeds
from tuner.gate.kv_feeds import next_feeds, prefill_feeds
from tuner.gate.right_pad import RightPadded
from tuner.graph.cache_record import cache_record
from tuner.graph.inspect import inspect_model
from tuner.graph.load import load_model
from tuner.rewrite import nbits
from tuner.runtime.ort import OrtRunner, load_cpu

pytestmark = pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)

CELLS = [("llama", "fp32"), ("llama", "int4"), ("llama", "fp16"), ("llama_tied", "int4"),
         ("qwen2", "int4"), ("mistral", "int4"), ("phi3", "int4"), ("qwen3", "int4"),
         ("gemma", "int4"), ("phi", "int4"), ("nemotron", "int4"), ("granite", "int4"),
         ("qwen2_tied", "int4-cuda")]
EXPECT = dict(num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32,
              ffn_size=200, ffn_gated=True, vocab_size=1003)
UNLIKE = {"phi": dict(num_kv_heads=4, ffn_gated=False), "nemotron": dict(ffn_gated=False)}
PARTIAL_ROTARY = {"phi", "nemotron"}  # their configs' partial_rotary_factor is 0.5
# every build this file runs: made together, in one builder process, before its first test
BUILDS = [*CELLS, ("gemma2", "fp32"), ("gpt_oss", "fp32"), ("qwen3", "int4-cuda")]


@pytest.fixture(scope="module", autouse=True)
def _builds() -> None:
    genai_builder.build_all(BUILDS)


@pytest.fixture(scope="module", params=CELLS, ids=[f"{f}-{p}" for f, p in CELLS])
def genai(request) -> Path:
    family, precision = request.param
    return genai_builder.cached(family, precision)


class _Session:
    """A plain ORT session with the runner interface (infer -> {name: array})."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        self.sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.sess.get_outputs()]

    def infer(self, feeds) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.sess.run(None, dict(feeds))))


@pytest.mark.parametrize("family,precision", CELLS, ids=[f"{f}-{p}" for f, p in CELLS])
def test_inspect_finds_the_dims_the_cache_and_a_mask_read_as_lengths(family, precision):
    shape = inspect_model(load_model(genai_builder.cached(family, precision)))
    expect = EXPECT | UNLIKE.get(family, {})
    assert {k: getattr(shape, k) for k in expect} == expect
    cache = shape.cache
    assert (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.layout, cache.mask) == (
        2, expect["num_kv_heads"], 32, "bhsd", "lengths")
    assert [(la.past_key, la.present_value) for la in cache.layers] == [
        (f"past_key_values.{i}.key", f"present.{i}.value") for i in range(2)]
    assert shape.sites.layers[0].attention.fused_op == "com.microsoft.GroupQueryAttention"
    assert shape.sites.layers[0].attention.rotary == (
        "partial" if family in PARTIAL_ROTARY else "full")


def test_verify_passes_on_itself_and_fails_a_corrupted_copy(genai, tmp_path, capsys):
    assert main(["verify", str(genai), str(genai)]) == 0
    bad = perturbed_copy(genai, tmp_path / "bad.onnx")  # the final norm's weight + 0.5
    assert main(["verify", str(genai), str(bad)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_left_padded_rollout_through_right_padding_equals_transformers():
    """The gate feeds left-padded rows; GroupQueryAttention reads only each row's length. Moved
    to the right and back (tuner.gate.right_pad), prefill and decode equal transformers."""
    import torch
    import transformers

    path = genai_builder.cached("llama", "fp32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(genai_builder.hf_folder("llama")).eval()
    roles = cache_record(load_model(path))
    run = RightPadded(_Session(path), roles)
    ids = np.random.default_rng(0).integers(0, 1003, (2, 6))
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # the second row left-padded
    first = prefill_feeds(roles, ids, mask)
    out = run.infer(first.arrays)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), use_cache=True,
                 position_ids=torch.tensor(np.where(mask == 0, 1, mask.cumsum(-1) - 1)))
    keep = mask.astype(bool)
    np.testing.assert_allclose(out["logits"][keep], ref.logits.numpy()[keep], atol=1e-4)
    token = out["logits"][:, -1].argmax(-1)
    step = next_feeds(first, out, token)
    got = run.infer(step.arrays)
    with torch.no_grad():
        ref2 = hf(torch.tensor(token[:, None]), attention_mask=torch.tensor(step.mask),
                  position_ids=torch.tensor(step.mask.cumsum(-1)[:, -1:] - 1),
                  past_key_values=ref.past_key_values, use_cache=True)
    np.testing.assert_allclose(got["logits"], ref2.logits.numpy(), atol=1e-4)
    # without the move, the padded row is wrong: the adapter is doing the work
    plain = _Session(path).infer(first.arrays)
    assert np.abs(plain["logits"][1][keep[1]] - ref.logits.numpy()[1][keep[1]]).max() > 1e-2


def _dequantized(node) -> np.ndarray:
    """(N, K) float weight of a MatMulNBits node, as ORT's formula gives it."""
    w = nbits.read(node)
    full = (w.q.astype(np.float64) - w.zero[:, :, None]) * w.scales[:, :, None]
    return full.reshape(w.n, -1)[:, :w.k]


# int4-cuda: the GPU build (no accuracy level), exact through the CPU gate (README)
@pytest.mark.parametrize("family,precision", [("llama", "int4"), ("qwen2_tied", "int4-cuda")])
def test_pad_vocab_and_ffn_through_matmulnbits_is_exact(family, precision, tmp_path):
    src = genai_builder.cached(family, precision)
    out = tmp_path / "pad.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64",
                 "--ffn-multiple", "128"]) == 0  # the gate ran: greedy rollouts matched
    before, after = load_model(src), load_model(out)
    nodes = {n.name: n for n in after.graph}
    old = {n.name: n for n in before.graph}
    head = nodes["/lm_head/MatMul_Q4"]
    assert int(head.attributes["N"].value) == 1024
    w = _dequantized(head)
    assert np.array_equal(w[:1003], _dequantized(old["/lm_head/MatMul_Q4"]))
    assert not w[1003:].any()  # the new vocabulary rows dequantize to exactly 0
    down = nodes["/model/layers.0/mlp/down_proj/MatMul_Q4"]
    assert int(down.attributes["K"].value) == 256
    wd = _dequantized(down)
    assert np.array_equal(wd[:, :200], _dequantized(old["/model/layers.0/mlp/down_proj/MatMul_Q4"]))
    assert not wd[:, 200:].any()  # new K entries (old block's tail and new blocks): exactly 0
    assert [o.name for o in after.graph.outputs] == [o.name for o in before.graph.outputs]


@pytest.mark.parametrize("flag", [["--head-dim", "64"], ["--heads", "8"]])
def test_head_dim_and_heads_inside_gqa_are_refused_naming_the_node(flag, tmp_path, capsys):
    src = genai_builder.cached("llama", "int4")
    assert main(["pad", str(src), "-o", str(tmp_path / "x.onnx"), *flag]) == 2
    err = capsys.readouterr().err
    assert "GroupQueryAttention" in err and "'/model/layers.0/attn/GroupQueryAttention'" in err
    assert not (tmp_path / "x.onnx").exists()


def test_the_planner_proposes_no_head_padding_inside_gqa():
    """optimize proposed head-dim variants that the rewrite then refused (GPT-OSS's
    head_dim-40, skipped with a note after its time was spent); inspect says why instead."""
    from tuner.hardware.facts import DEVICES
    from tuner.plan.findings import audited
    from tuner.plan.propose import propose

    shape = audited(inspect_model(load_model(genai_builder.cached("gpt_oss", "fp32"))))
    names = [c.name for c in propose(shape, DEVICES["h100"])]
    assert names and not any(n.startswith(("head_dim", "heads")) for n in names)
    assert any("not padded here" in f.message and "GroupQueryAttention" in f.message
               for f in shape.findings)


def test_pad_refuses_a_g_idx_naming_the_node():
    import onnx_ir as ir

    node = next(n for n in load_model(genai_builder.cached("llama", "int4")).graph
                if nbits.is_nbits(n))
    inputs = list(node.inputs) + [None] * (5 - len(node.inputs))
    inputs[4] = ir.Value(name="g_idx", const_value=ir.tensor(np.arange(128, dtype=np.int32)))
    fake = ir.Node("com.microsoft", "MatMulNBits", inputs, attributes=list(node.attributes.values()),
                   name="with_g_idx")
    with pytest.raises(Exception, match="'with_g_idx': MatMulNBits with a g_idx"):
        nbits.read(fake)


# ------------------------------------------------------------------------ optimize and serve


def _plain_greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    """ORT alone: batch 1, no padding, each step fed its own present (genai's I/O names)."""
    sess = _Session(path)
    ids = np.array([prompt], np.int64)
    past = {i.name: np.zeros((1, i.shape[1], 0, 32), np.float16 if "16" in i.type else np.float32)
            for i in sess.sess.get_inputs() if i.name.startswith("past_key_values")}
    mask = np.ones_like(ids)
    tokens: list[int] = []
    for _ in range(steps):
        out = sess.infer({"input_ids": ids, "attention_mask": mask, **past})
        tokens.append(int(out["logits"][0, -1].argmax()))
        past = {n: out[n.replace("past_key_values", "present")] for n in past}
        ids = np.array([[tokens[-1]]], np.int64)
        mask = np.ones((1, mask.shape[1] + 1), np.int64)
    return tokens


def _infer(port: int, name: str, prompt: list[int], max_tokens: int) -> list[int]:
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    ids = tg.InferInput("input_ids", [1, len(prompt)], "INT64")
    ids.set_data_from_numpy(np.array([prompt], np.int64))
    limit = tg.InferInput("max_tokens", [1], "INT32")
    limit.set_data_from_numpy(np.array([max_tokens], np.int32))
    return client.infer(name, [ids, limit]).as_numpy("output_ids").reshape(-1).tolist()


@pytest.mark.parametrize("family,precision", CELLS, ids=[f"{f}-{p}" for f, p in CELLS])
def test_optimize_then_serve_with_inflight_batching_equals_a_plain_greedy_loop(family, precision,
                                                                                tmp_path):
    src = genai_builder.cached(family, precision)
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt_tokens": p, "output_tokens": o}) + "\n"
                               for p, o in ((5, 8), (12, 12))))
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), "--requests", str(traffic), "--rounds",
                 "2", "--warmup", "0", "--bucket-rounds", "1", "--no-probe", "--no-fuse",
                 "--max-variants", "2", "--no-cache", "--max-buckets", "2", "-q",
                 "--no-plots"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["cache"]["layers"] == 2 and (out / "tokenizer.json").is_file()
    assert all(v["accuracy"]["passed"] for v in manifest["variants"])
    server = Server(out, ServerOptions(port=0, metrics_port=0, model_name="genai",
                                       generate=GenerateOptions(max_streams=8)),
                    say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        rng = np.random.default_rng(7)
        jobs = [(rng.integers(3, 1003, int(rng.integers(2, 20))).tolist(), int(rng.integers(4, 14)))
                for _ in range(6)]
        got: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(
            i, _infer(server.port, "genai", *jobs[i]))) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [got.get(i) for i in range(len(jobs))] == [_plain_greedy(src, p, k)
                                                          for p, k in jobs]
        # the builder's rotary cos cache holds the model's positions (no config.json here):
        # the cache is no longer, and a longer prompt is refused before it runs (it was
        # served up to 2048, and ONNX Runtime's GroupQueryAttention failed past the cache)
        assert server.slot.engine.generator.max_cache_len == genai_builder.POSITIONS
        with pytest.raises(InferenceServerException, match="at most 255 are accepted"):
            _infer(server.port, "genai", [5] * (genai_builder.POSITIONS + 20), 4)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                         timeout=10).read().decode()
        batched = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("tuner_batch_size_count")]
        single = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith('tuner_batch_size_bucket{le="1.0"')]
        stays = server.slot.engine.generator.rows_stay  # why rows may not share a run
        # some decode steps ran several streams at once, unless the engine's start check found
        # a row's logits moved beside another: a GPU build's MatMulNBits on the CPU runs one
        # row another way than two (1.2e-4 on qwen2_tied int4-cuda), and then each runs alone
        assert sum(batched) > sum(single) if stays is None else "beside another row" in stays
    finally:
        server.stop(5)


def _own_cache(sess: _Session, record, prompt: list[int]) -> dict[str, np.ndarray]:
    ids = np.array([prompt], np.int64)
    past = {n: np.zeros(record.past_shape(1, 0, n), np.float32) for n in record.past}
    out = sess.infer({"input_ids": ids, "attention_mask": np.ones_like(ids), **past})
    return {p: out[q] for p, q in record.past_to_present.items()}


def test_rows_at_the_start_decode_like_each_row_alone():
    """A batch of rows of 3, 9 and 5 entries (and a padding row) in the rows-at-start layout:
    two decode steps give each row's logits alone; the same rows left-padded (what a graph
    that reads its mask by position takes) give other logits here."""
    src = genai_builder.cached("llama", "fp32")
    sess, record = _Session(src), cache_record(load_model(src))
    assert record.rows_at_start
    prompts = [[5, 9, 11], [7, 3, 2, 8, 10, 4, 6, 12, 13], [21, 22, 23, 24, 25]]
    caches = [_own_cache(sess, record, p) for p in prompts]
    arrays, mask = pad_rows(record, caches, batch=4, past=9)
    assert mask.tolist()[0] == [1, 1, 1, 0, 0, 0, 0, 0, 0]  # row 0 from position 0
    step = step_feeds(record, [(40,), (41,), (42,), None], mask, arrays)
    out = sess.infer(step.arrays)
    later = next_step(step, out, np.array([50, 51, 52, 0]))
    out2 = sess.infer(later.arrays)
    for i, prompt in enumerate(prompts):
        alone = _plain_logits(sess, record, prompt, [40 + i, 50 + i])
        np.testing.assert_allclose(out["logits"][i, 0], alone[0], atol=1e-4)
        np.testing.assert_allclose(out2["logits"][i, 0], alone[1], atol=1e-4)
        presents = {p: out[q] for p, q in record.past_to_present.items()}
        mine = row_cache(record, presents, step.mask[i], i)  # the step's mask keeps its present
        assert mine[record.past[0]].shape[2] == len(prompt) + 1
    left = np.zeros_like(mask)
    left[:, -3:] = 1  # row 0's three entries where left padding puts them
    moved = {n: np.roll(a, 6, axis=2) for n, a in arrays.items()}
    wrong = sess.infer(step_feeds(record, [(40,), (41,), (42,), None], left, moved).arrays)
    assert np.abs(wrong["logits"][0, 0] - out["logits"][0, 0]).max() > 1e-2


def _plain_logits(sess: _Session, record, prompt: list[int], tokens: list[int]) -> list:
    past = _own_cache(sess, record, prompt)
    got, n = [], len(prompt)
    for t in tokens:
        out = sess.infer({"input_ids": np.array([[t]], np.int64),
                          "attention_mask": np.ones((1, n + 1), np.int64), **past})
        got.append(out["logits"][0, 0])
        past, n = {p: out[q] for p, q in record.past_to_present.items()}, n + 1
    return got


@pytest.mark.parametrize("options,binding", [
    (dict(prefill_tokens=8), True), (dict(prefill_tokens=64), False),
    (dict(prefill_tokens=16, budget_tokens=64), True),
    (dict(prefill_tokens=8, share_buffers=False), True)],
    ids=["chunked-shared", "whole-shared-no-binding", "preempted-shared", "chunked-copies"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "phi3"])
def test_the_engine_on_a_genai_graph_equals_a_plain_greedy_loop(options, binding, family):
    """Streams sharing a 32-token prefix (prefix hits), prompts 3..40 tokens, prefilled in
    chunks of 8 (each chunk after a past runs alone: GroupQueryAttention's rule) or whole, and
    a cache budget that forces preemption: every stream equals the plain loop. The decode
    batch lives in shared buffers the graph writes into (IO binding; a runner without it
    gets its past cut and its present copied in), or in each step's present. Llama at fp32,
    the other families at int4 (their bias, rotary and layer-norm layouts differ)."""
    src = genai_builder.cached(family, "fp32" if family == "llama" else "int4")
    runner = OrtRunner(load_cpu(src)) if binding else _Session(src)
    assert getattr(runner, "writes_into", False) == binding
    record = cache_record(load_model(src))
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 1003, 32).tolist()
    prompts = [shared + rng.integers(3, 1003, int(k)).tolist() for k in (2, 5, 8)]
    prompts += [rng.integers(3, 1003, int(k)).tolist() for k in (3, 17, 40)]
    options = dict(options)
    if "budget_tokens" in options:
        options["kv_cache_bytes"] = options.pop("budget_tokens") * record.bytes_per_token
    hits, preempted = [], []
    stats = GenerationStats(on_prefix=lambda looked, hit: hits.append(hit),
                            on_preempt=lambda: preempted.append(1))
    gen = Generator(runner, record, 1003,
                    GenerateOptions(max_streams=6, prefix_block=16, **options),
                    max_positions=128, stats=stats)
    assert gen.cache.shared == options.get("share_buffers", True)
    try:
        first = [t for c in gen.generate(GenerationRequest(tuple(prompts[0]), 12)) for t in c.ids]
        streams = collect(gen, [GenerationRequest(tuple(p), 12) for p in prompts])  # at once
        got = [[t for c in chunks for t in c.ids] for chunks in streams]
    finally:
        gen.close()
    assert first == _plain_greedy(src, prompts[0], 12)
    assert got == [_plain_greedy(src, p, 12) for p in prompts]
    assert bool(preempted) == ("kv_cache_bytes" in options)
    if gen.cache.shared:  # one gather a batch formed (the first stream's, the six's), more
        assert gen.cache.gathers >= 2  # where a tight budget makes the buffers grow
    if "kv_cache_bytes" not in options:  # (a tight budget evicts prefix blocks first)
        assert sum(hits) >= 32  # the streams behind the first found the shared prefix


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_a_windowed_cache_is_read_and_where_one_cache_length_is_needed_refused(family,
                                                                                capsys):
    """Gemma 2 and GPT-OSS from the builder: their sliding-window layers' caches hold only
    the window (`past_sliding_length`). inspect reads them, the windowed layer and GPT-OSS's
    experts too (ONNX Runtime's fused MoE op: 4 of width 96); a command that feeds the cache
    as one length (`verify`) exits 2 naming the way out, where it was an internal error out
    of ONNX Runtime (optimize and serve: tests/test_unwindow.py)."""
    src = genai_builder.cached(family, "fp32")
    assert main(["inspect", str(src), "--json"]) == 0  # what it is can still be read
    got = json.loads(capsys.readouterr().out)
    roles = {i["name"]: i["role"] for i in got["inputs"]}
    assert roles["input_ids"] == "token_ids"  # Gemma's tied embedding: the head's weight transposed
    assert (got["cache"]["windowed_layers"], got["cache"]["window"]) == ([0], 16)
    assert "windowed-cache" in {f["rule"] for f in got["findings"]}
    if family == "gpt_oss":
        assert [(e["count"], e["width"]) for e in got["sites"]["experts"]] == [(4, 96)] * 2
    assert main(["verify", str(src), str(src)]) == 2
    assert "keep only a window of 16 positions" in capsys.readouterr().err


def test_a_gpu_build_the_cpu_cannot_run_is_bad_input_not_a_failed_gate(tmp_path, capsys):
    """Qwen3's int4 CUDA build fuses its q/k norms into GroupQueryAttention, which the CPU
    provider does not run: exit 2 saying so (pad said "not exact"), nothing written."""
    src = genai_builder.cached("qwen3", "int4-cuda")
    assert main(["verify", str(src), str(src)]) == 2
    assert "cannot run" in capsys.readouterr().err
    out = tmp_path / "pad.onnx"
    assert main(["pad", str(src), "-o", str(out), "--vocab-multiple", "64"]) == 2
    assert "cannot run the original" in capsys.readouterr().err and not out.exists()

