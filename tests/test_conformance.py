"""The conformance matrix: every command on the exports users bring, made by the exporters
they run. Exporters: Hugging Face Optimum (optimum-onnx in its own environment, tasks
text-generation-with-past and text-generation; models/optimum.py) and torch.onnx.export
(TorchScript and dynamo; models/build.py, models/kv.py). Families: GPT-2, Llama (GQA),
Mistral, Qwen2, Phi-3, GPT-NeoX, Gemma, two layers with odd sizes; and Optimum's other
decoders with their cache only (Qwen3, Gemma 2 and 3, Granite, OLMo 2, SmolLM3, Phi,
StableLM, Falcon, Bloom, GPTBigCode, OPT, GPT-J, GPT-Neo, CodeGen, Cohere, MPT, Nemotron,
OLMo, Arcee, Helium, GLM, GPT-OSS, Qwen3-MoE, DeepSeek-V3: `optimum.FAMILIES[...].tasks`).

Each cell: `inspect` finds the dims, each input's role and the cache; `verify m m` passes;
`pad` is exact (or refused, naming the node); `optimize` writes an artifact; `serve` on it
generates token-identically to a plain ONNX Runtime greedy loop over the original (cache
exports) or answers a forward as the original does (the others). README.md's "Every export"
table is this matrix. Exit 1 (internal error) is never an answer here.

Over 400 lines on purpose: the matrix, its answer key (roles, refusals) and the greedy
reference it is held to read together.
"""

from __future__ import annotations

import contextlib
import io
import json
import queue
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as tg

from models import build, optimum
from serving.generation import GenerateOptions
from serving.server import Server, ServerOptions
from tests.serving_support import quantize_dynamic_copy
from tuner.cli import main

pytestmark = pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)

KV_TASK, PLAIN_TASK = optimum.TASKS


@dataclass(frozen=True)
class Cell:
    exporter: str  # optimum | torchscript | dynamo
    family: str
    kv: bool  # exported with its KV cache

    @property
    def id(self) -> str:
        return f"{self.exporter}-{self.family}-{'kv' if self.kv else 'nokv'}"


# Optimum's --optimize O2 (ONNX Runtime's transformer optimizer inside the export) on the
# families its optimizer knows: fused SkipLayerNorm / LayerNorm / FastGelu / BiasGelu
O2_FAMILIES = ("gpt2", "llama", "gpt_neox", "gptj", "gpt_bigcode", "granite")
# Optimum's --dtype fp16 (on the CPU): half-precision weights, cache and logits
FP16_FAMILIES = ("llama", "qwen3", "phi3")
# The values' own head dim where it is not the keys' (multi-head latent attention: DeepSeek-V3
# caches keys 24 wide, 16 per head and 8 of rotary shared by the heads, and values 16)
VALUE_HEAD_DIM = {"deepseek_v3": 16}
CELLS = ([Cell("optimum", f, kv) for f, fam in optimum.FAMILIES.items() for kv in (True, False)
          if (KV_TASK if kv else PLAIN_TASK) in fam.tasks]
         + [Cell("optimum-O2", f, True) for f in O2_FAMILIES]
         + [Cell("optimum-fp16", f, True) for f in FP16_FAMILIES]
         + [Cell(e, f, True) for f in build.KV_FAMILIES for e in build.EXPORTERS]
         + [Cell("torchscript", "qwen2", False), Cell("dynamo", "phi3", False),
            Cell("dynamo", "gemma", False), Cell("torchscript", "llama", False)])
# What `pad --vocab-multiple 64 --ffn-multiple 64 --head-dim <next multiple of 32>` answers
# where it is not exact: the cell, and words of the refusal (which names the node or the
# reason); the vocab and FFN padding alone is exact there. Head dim 24 -> 32 where the rotary
# layout is one the rewrite does not follow: Cohere's interleaved cos/sin (repeat_interleave),
# Helium's and GLM's gathered or sliced pairs; and DeepSeek-V3's keys and values of their own
# widths.
PAD_REFUSED: dict[str, str] = {"optimum-cohere-kv": "/model/rotary_emb/Tile",
                               "optimum-helium-kv": "self_attn/GatherND",
                               "optimum-glm-kv": "self_attn/Slice_2",
                               "optimum-deepseek_v3-kv": "keys and values have head dims of "
                                                         "their own (keys 24, values 16"}
FAST = ["--no-plots", "--rounds", "2", "--warmup", "0", "--bucket-rounds", "1", "--no-probe",
        "--no-fuse", "--max-variants", "2", "--no-cache", "--max-buckets", "2"]
# Small traffic keeps optimize's shapes small: prompts and outputs for cache exports.
TRAFFIC = {True: [{"prompt_tokens": p, "output_tokens": o} for p, o in ((5, 8), (12, 6), (20, 4))],
           False: [{"seq": s, "batch": 2} for s in (5, 12, 20)]}
PROMPT, NEW_TOKENS = [5, 17, 301, 9, 42, 7], 8


@pytest.fixture(scope="session")
def optimum_exports() -> dict[tuple[str, bool], Path]:
    """Every Optimum export, made in one Optimum process (and its environment, first time)
    and cached. pip failing to install optimum-onnx FAILS here: it is what users run."""
    cells = [(c.family, _task(c)) for c in CELLS if c.exporter.startswith("optimum")]
    paths = optimum.export_all(cells)
    return {(f, t): p for (f, t), p in zip(cells, paths)}


def _task(cell: Cell) -> str:
    if cell.exporter == "optimum-O2":
        return optimum.O2_TASK
    if cell.exporter == "optimum-fp16":
        return optimum.FP16_TASK
    return KV_TASK if cell.kv else PLAIN_TASK


def _source(cell: Cell, optimum_exports) -> Path:
    if cell.exporter.startswith("optimum"):
        return optimum_exports[(cell.family, _task(cell))]
    name = f"{cell.family}-kv" if cell.kv else cell.family
    return build.cached(name, "awkward", cell.exporter)


def _expect(cell: Cell) -> dict:
    if cell.exporter.startswith("optimum"):
        return optimum.FAMILIES[cell.family].expect
    return build.spec(f"{cell.family}-kv" if cell.kv else cell.family, "awkward").expect


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _role_by_name(name: str) -> str:
    """The role each exporter's input names mean (the matrix's answer key)."""
    if name.startswith("past_key_values"):
        return "kv_cache"
    return {"input_ids": "token_ids", "attention_mask": "attention_mask",
            "position_ids": "position_ids"}[name]


# ---------------------------------------------------------------------- the greedy reference


def _ort_greedy(path: Path, prompt: list[int], steps: int) -> list[int]:
    """A plain ONNX Runtime greedy loop over a cache export: past starts empty, present
    comes back as past, the mask covers past + new, positions count on."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in sess.get_inputs()}
    outputs = [o.name for o in sess.get_outputs()]
    past = {n: np.zeros((1, i.shape[1], 0, i.shape[3]),  # (B, kv_heads, 0, d)
                        np.float16 if i.type == "tensor(float16)" else np.float32)
            for n, i in inputs.items() if n.startswith("past_key_values")}
    ids, done, got = np.array([prompt], np.int64), 0, []
    for _ in range(steps):
        seq = ids.shape[1]
        feed = {"input_ids": ids, "attention_mask": np.ones((1, done + seq), np.int64), **past}
        if "position_ids" in inputs:
            feed["position_ids"] = np.arange(done, done + seq, dtype=np.int64)[None]  # (1, S)
        out = dict(zip(outputs, sess.run(None, feed)))
        token = int(out["logits"][0, -1].argmax())
        got.append(token)
        past = {n: out[n.replace("past_key_values", "present")] for n in past}
        done, ids = done + seq, np.array([[token]], np.int64)
    return got


def _served_greedy(server: Server, prompt: list[int], steps: int) -> list[int]:
    """The server's own generation (decoupled ModelStreamInfer), greedy."""
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    ids = np.array([prompt], np.int64)
    made = [tg.InferInput("input_ids", list(ids.shape), "INT64"),
            tg.InferInput("max_tokens", [1], "INT32")]
    made[0].set_data_from_numpy(ids)
    made[1].set_data_from_numpy(np.array([steps], np.int32))
    got: list[int] = []
    try:
        client.async_stream_infer(server.slot.name, made, request_id="c")
        while True:
            result, error = answers.get(timeout=60)
            if error is not None:
                raise error
            got += result.as_numpy("output_ids").reshape(-1).tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def _forward_feeds(path: Path) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    ids = np.array([PROMPT, PROMPT[::-1]], np.int64)  # (2, S)
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    feed = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in names:
        feed["position_ids"] = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return feed


def _served_forward(server: Server, feed: dict[str, np.ndarray]) -> np.ndarray:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    made = []
    for name, a in feed.items():
        made.append(tg.InferInput(name, list(a.shape), "INT64"))
        made[-1].set_data_from_numpy(a)
    return client.infer(server.slot.name, made).as_numpy("logits")


# ----------------------------------------------------------------------------- the matrix


def _check_inspect(cell: Cell, src: Path) -> None:
    code, out, err = _run(["inspect", str(src), "--json"])
    assert code == 0, err
    got = json.loads(out)
    want = _expect(cell)
    assert {k: got[k] for k in want} == want
    roles = {i["name"]: i["role"] for i in got["inputs"]}
    assert roles == {n: _role_by_name(n) for n in roles}, roles
    assert (got["cache"] is not None) == cell.kv
    if cell.kv:
        c = got["cache"]
        assert (c["num_layers"], c["num_kv_heads"], c["head_dim"]) == (
            want["num_layers"], want["num_kv_heads"], want["head_dim"])
        assert c["value_head_dim"] == VALUE_HEAD_DIM.get(cell.family), c


def _check_pad(cell: Cell, src: Path, tmp: Path) -> None:
    head = -(-_expect(cell)["head_dim"] // 32) * 32 if _expect(cell)["head_dim"] % 32 else None
    vocab_ffn = ["pad", str(src), "-o", str(tmp / "padded.onnx"), "--vocab-multiple", "64",
                 "--ffn-multiple", "64"]
    code, out, err = _run(vocab_ffn + (["--head-dim", str(head)] if head else []))
    if cell.id in PAD_REFUSED:
        assert code == 2 and PAD_REFUSED[cell.id] in err, err
        code, out, err = _run(vocab_ffn)  # the vocab and FFN padding alone: exact
    assert code == 0, err + out[-2000:]
    assert (tmp / "padded.onnx").exists()


def _check_serve(cell: Cell, src: Path, out: Path) -> None:
    server = Server(out, ServerOptions(port=0, metrics_port=0,
                                       generate=GenerateOptions(max_tokens=64)),
                    say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        if cell.kv:
            assert _served_greedy(server, PROMPT, NEW_TOKENS) == _ort_greedy(src, PROMPT,
                                                                             NEW_TOKENS)
        else:
            feed = _forward_feeds(src)
            sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
            want = sess.run(["logits"], feed)[0]
            np.testing.assert_allclose(_served_forward(server, feed), want, atol=1e-4,
                                       rtol=1e-4)
    finally:
        server.stop(5)


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.id)
def test_every_command_on_every_export(cell: Cell, optimum_exports, tmp_path) -> None:
    src = _source(cell, optimum_exports)
    _check_inspect(cell, src)
    code, out, err = _run(["verify", str(src), str(src)])
    assert code == 0 and "PASS" in out, err + out[-2000:]
    _check_pad(cell, src, tmp_path)
    art, traffic = tmp_path / "art", tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps(r) + "\n" for r in TRAFFIC[cell.kv]))
    code, _, err = _run(["optimize", str(src), "-o", str(art), "--requests", str(traffic), *FAST])
    assert code == 0, err
    assert (art / "manifest.json").exists()
    if cell.exporter.startswith("optimum"):  # its folder's tokenizer travels with the artifact
        assert (art / "tokenizer.json").is_file()
    _check_serve(cell, src, art)


def test_the_optimum_exports_come_from_the_pinned_exporter(optimum_exports) -> None:
    """Each export records the versions that wrote it: optimum-onnx 0.1 with the transformers
    it pins (4.57), not ours."""
    for path in optimum_exports.values():
        made = json.loads((path.parent / "exporter.json").read_text())
        assert made["optimum-onnx"] == optimum.OPTIMUM_ONNX.split("==")[1]
        assert made["transformers"].startswith("4.57"), made


def test_requests_that_meet_on_an_optimum_export_over_http(optimum_exports, tmp_path) -> None:
    """An Optimum export without its cache, optimized and served with the defaults (on a CPU
    of 2+ threads: every thread for a lone request, a one-thread session for one that starts
    beside another) and driven by tritonclient.http with 24 requests in flight at once: both
    sessions answer, and every answer is the original's."""
    import time

    import tritonclient.http as th

    from serving.overlap import OverlapRunner

    src = optimum_exports[("llama", PLAIN_TASK)]
    art, traffic = tmp_path / "art", tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps(r) + "\n" for r in TRAFFIC[False]))
    code, _, err = _run(["optimize", str(src), "-o", str(art), "--requests", str(traffic),
                         "--threads", "2", *FAST])
    assert code == 0, err
    server = Server(art, ServerOptions(port=0, http_port=0, metrics_port=0),
                    say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        runner = server.slot.engine.model.runner
        assert isinstance(runner, OverlapRunner)
        # this two-layer graph runs in well under a millisecond, less than an HTTP request
        # takes to parse: its full-thread runs are held 20 ms longer, as a real model's last,
        # so that requests meet (the sessions still compute every answer)
        full_infer = runner.full.infer
        runner.full.infer = lambda feeds: (time.sleep(0.02), full_infer(feeds))[1]
        sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(3)
        feeds = []
        for _ in range(24):
            ids = rng.integers(3, 200, (1, int(rng.integers(4, 21)))).astype(np.int64)
            feed = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            if "position_ids" in [i.name for i in sess.get_inputs()]:
                feed["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None]
            feeds.append(feed)
        client = th.InferenceServerClient(f"127.0.0.1:{server.http_port}", concurrency=24)
        pending = []
        for feed in feeds:
            made = [th.InferInput(n, list(a.shape), "INT64") for n, a in feed.items()]
            for m, a in zip(made, feed.values()):
                m.set_data_from_numpy(a)
            pending.append(client.async_infer(server.slot.name, made))
        for feed, call in zip(feeds, pending):
            want = sess.run(["logits"], feed)[0]
            np.testing.assert_allclose(call.get_result().as_numpy("logits"), want, atol=1e-4,
                                       rtol=1e-4)
        assert runner.runs["full"] > 0 and runner.runs["single"] > 0, runner.runs
        client.close()
    finally:
        server.stop(5)


def test_a_merged_decoder_is_refused_saying_what_to_do(optimum_exports, tmp_path) -> None:
    """Optimum's legacy `decoder_model_merged.onnx` (made by Optimum's own merge_decoders)
    holds the model inside an If: every command but unmerge refuses it with exit 2, naming
    the If and its use_cache_branch input and `tuner unmerge`, and writes nothing."""
    merged = optimum.merged("llama")
    commands = [["inspect", str(merged)], ["verify", str(merged), str(merged)],
                ["pad", str(merged), "-o", str(tmp_path / "p.onnx"), "--vocab-multiple", "64"],
                ["optimize", str(merged), "-o", str(tmp_path / "art"), *FAST]]
    for args in commands:
        code, out, err = _run(args)
        assert code == 2 and "If " in err and "use_cache_branch" in err, (args, err)
        assert "tuner unmerge" in err and "text-generation-with-past" in err
    assert not (tmp_path / "p.onnx").exists() and not (tmp_path / "art").exists()


def test_unmerge_makes_the_merged_decoder_the_plain_graph_it_was_made_of(
        optimum_exports, tmp_path) -> None:
    """`tuner unmerge`: the with-cache branch inlined, gated against the merged file (fed
    use_cache_branch = True) and written; the result has no If and no flag, equals the
    with-cache export that was merged (verify: max abs 0; the other branch is a corrupted
    copy), and optimizes like it. A plain
    graph is refused, and a corrupted copy FAILS the unmerge gate."""
    from serving_support import perturbed_copy

    from tuner.graph.load import load_model
    from tuner.graph.merged import FLAG, with_cache
    from tuner.jobs.pad import NotExact, gate
    from tuner.jobs.unmerge import prepared

    kv = optimum.cached("llama")
    # the else_branch (use_cache_branch false) a corrupted copy: only the right branch gives
    # the with-cache export back
    merged = optimum.merge(perturbed_copy(kv, tmp_path / "other.onnx"), kv,
                           tmp_path / "decoder_model_merged.onnx")
    plain = tmp_path / "model.onnx"
    code, out, err = _run(["unmerge", str(merged), "-o", str(plain)])
    assert code == 0 and "PASS" in out and "greedy rollouts" in out, err + out
    model = load_model(plain)
    assert FLAG not in {v.name for v in model.graph.inputs}
    assert not [n for n in model.graph if n.op_type == "If"]
    code, out, _ = _run(["verify", str(kv), str(plain), "--atol", "0", "--rtol", "0"])
    assert code == 0 and "PASS" in out, out
    _check_inspect(Cell("optimum", "llama", True), plain)
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps(r) + "\n" for r in TRAFFIC[True]))
    code, _, err = _run(["optimize", str(plain), "-o", str(tmp_path / "art"), "--requests",
                         str(traffic), *FAST])
    assert code == 0, err
    code, _, err = _run(["unmerge", str(kv), "-o", str(tmp_path / "again.onnx")])
    assert code == 2 and "not an Optimum merged decoder" in err
    check = prepared(merged, model, with_cache(load_model(merged, merged_ok=True)))
    try:
        with pytest.raises(NotExact):
            gate(check, perturbed_copy(plain, tmp_path / "corrupted.onnx"))
    finally:
        check.close()


def test_a_quantized_merged_decoder_unmerges_too(optimum_exports, tmp_path) -> None:
    """The hub's `decoder_model_merged_quantized.onnx` (ONNX Runtime's quantize_dynamic over
    the merged file, as transformers.js repositories ship it): the quantizer reaches into
    the If's branches, unmerge inlines the quantized with-cache branch exactly (max abs 0
    against the quantized merged file) and inspect reads the dims through MatMulInteger."""
    quantized = quantize_dynamic_copy(optimum.merged("llama"),
                                      tmp_path / "decoder_model_merged_quantized.onnx")
    plain = tmp_path / "model.onnx"
    code, out, err = _run(["unmerge", str(quantized), "-o", str(plain), "--atol", "0",
                           "--rtol", "0"])
    assert code == 0 and "PASS" in out, err + out
    _check_inspect(Cell("optimum", "llama", True), plain)
