"""onnxruntime-genai's windowed caches (Gemma 2, GPT-OSS from its builder: a sliding-window
layer's cache holds only its window, `past_sliding_length`, apart from the full layers'):

- the windowed graph itself equals transformers on the same weights (the oracle below runs
  it as genai does: buffers of the window's capacity, each step fed its own present);
- `tuner.rewrite.unwindow` drops the flag and gives every layer one cache length; its check
  (tuner.gate.windowed) passes it over rollouts that cross the window and FAILS a copy that
  lost its window; `tuner unwindow` writes it (exit 0) and refuses a graph with nothing
  windowed (exit 2, nothing written);
- `tuner optimize` makes the windowed caches full-length first (saying so) and `tuner serve`
  generates from the artifact with in-flight batching, chunked prefill and prefix hits,
  every stream token-identical to the windowed graph's own greedy loop, past its window.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest
from serving_support import collect

from models import genai_builder
from serving.generation import GenerateOptions, Generator
from serving.sampling import GenerationRequest
from tuner.cli import main
from tuner.gate.windowed import check_unwindowed, rollouts
from tuner.graph.cache_record import cache_record
from tuner.graph.load import load_model, save_model
from tuner.graph.windowed import windowed_cache
from tuner.jobs.pad import NotExact, load_reference
from tuner.jobs.unwindow import unwindow_file
from tuner.rewrite.unwindow import unwindow
from tuner.runtime.ort import OrtRunner, load_cpu

pytestmark = pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)

FAMILIES = ["gemma2", "gpt_oss"]
WINDOW, VOCAB = 16, 1003  # the builder's tiny configs (models/genai_builder.py)


@pytest.fixture(scope="module", autouse=True)
def _builds() -> None:
    """This file's builds, made together in one builder process before its first test."""
    genai_builder.build_all([(family, "fp32") for family in FAMILIES] + [("llama", "fp32")])


def _windowed_greedy(path: Path, prompt: list[int], steps: int) -> tuple[list[int], list]:
    """The windowed graph as onnxruntime-genai runs it: batch 1, the sliding layer's buffers
    of the window's capacity, the full layer's growing, each fed its own present."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    past = {i.name: np.zeros((1, 2, WINDOW if "sliding" in i.shape[2] else 0, 32), np.float32)
            for i in sess.get_inputs() if i.name.startswith("past_key_values")}
    ids, tokens, logits = np.array([prompt], np.int64), [], []
    for _ in range(steps):
        mask = np.ones((1, len(prompt) + len(tokens)), np.int64)
        out = dict(zip(names, sess.run(None, {"input_ids": ids, "attention_mask": mask, **past})))
        logits.append(out["logits"][0, -1])
        tokens.append(int(logits[-1].argmax()))
        past = {n: out[n.replace("past_key_values", "present")] for n in past}
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens, logits


def test_the_windowed_graph_equals_transformers():
    """The oracle is right: the builder's Gemma 2 run with window-sized buffers gives
    transformers' logits on the same weights, 24 steps past a 20-token prompt."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = np.random.default_rng(0).integers(3, VOCAB, 20).tolist()
    tokens, logits = _windowed_greedy(genai_builder.cached("gemma2", "fp32"), prompt, 24)
    hf = AutoModelForCausalLM.from_pretrained(str(genai_builder.hf_folder("gemma2")),
                                              dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
    assert np.abs(np.array(logits) - want).max() < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_unwindow_gives_one_cache_length_and_its_check_fails_a_copy_without_the_window(
        family, tmp_path):
    src = genai_builder.cached(family, "fp32")
    model = load_model(src)
    found = unwindow(model)
    assert found.window == WINDOW and found.pasts == ("past_key_values.0.key",
                                                      "past_key_values.0.value")
    assert windowed_cache(model.graph) is None
    record = cache_record(model)  # refused before: the layers' caches had lengths of their own
    assert record.rows_at_start and len(record.past) == 4
    full = save_model(model, tmp_path / "full" / "model.onnx")
    for n in model.graph:  # the corrupted copy: its layers see every past position
        if n.op_type == "GroupQueryAttention":
            n.attributes["local_window_size"] = ir.AttrInt64("local_window_size", -1)
    blind = save_model(model, tmp_path / "blind" / "model.onnx")
    good = check_unwindowed(lambda: load_reference(src), lambda: load_reference(full),
                            record, found, VOCAB)
    bad = check_unwindowed(lambda: load_reference(src), lambda: load_reference(blind),
                           record, found, VOCAB)
    assert good and good.outputs[0].max_abs < 1e-5 and good.outputs[0].compared > 0
    assert not bad and bad.outputs[0].max_abs > 1e-2  # only prompts past the window differ
    # what the rollouts cover: a prompt that fills the window while decoding, one longer
    # than its buffer, one in chunks after a past with room for compaction
    plans = rollouts(WINDOW, VOCAB)
    assert [len(r.pieces) for r in plans] == [1, 1, 3]
    assert [sum(map(len, r.pieces)) for r in plans] == [WINDOW - 2, WINDOW + 3, WINDOW + 5]
    assert [r.capacity for r in plans] == [WINDOW, WINDOW, WINDOW + 3]


def test_the_unwindow_command_writes_checked_and_refuses_what_is_not_windowed(tmp_path, capsys):
    src = genai_builder.cached("gemma2", "fp32")
    out = tmp_path / "full.onnx"
    assert main(["unwindow", str(src), "-o", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["written"] and got["accuracy"]["passed"] and out.is_file()
    assert windowed_cache(load_model(out).graph) is None
    plain = tmp_path / "plain.onnx"
    assert main(["unwindow", str(genai_builder.cached("llama", "fp32")), "-o", str(plain)]) == 2
    assert "nothing to unwindow" in capsys.readouterr().err and not plain.exists()


def test_a_blind_rewrite_is_not_written(tmp_path, monkeypatch):
    """unwindow_file writes nothing when the check fails: the rule made blind to the window."""
    from tuner.jobs import unwindow as job

    real = job.unwindow

    def blind(model):
        found = real(model)
        for n in model.graph:
            if n.op_type == "GroupQueryAttention":
                n.attributes["local_window_size"] = ir.AttrInt64("local_window_size", -1)
        return found

    monkeypatch.setattr(job, "unwindow", blind)
    out = tmp_path / "full.onnx"
    with pytest.raises(NotExact):
        unwindow_file(genai_builder.cached("gemma2", "fp32"), out)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family", FAMILIES)
def test_optimize_then_the_engine_equals_the_windowed_graph_past_its_window(family, tmp_path,
                                                                           capsys):
    """Streams sharing a 20-token prefix (prefix hits after the first), prompts longer than
    the window and shorter, prefilled in chunks of 8 and decoding side by side, 20 tokens
    each: every stream equals the windowed graph's own greedy loop."""
    src = genai_builder.cached(family, "fp32")
    out = tmp_path / "out"
    assert main(["optimize", str(src), "-o", str(out), "--rounds", "2", "--warmup", "0",
                 "--bucket-rounds", "1", "--no-probe", "--no-fuse", "--max-variants", "2",
                 "--no-cache", "--max-buckets", "2", "-q", "--no-plots"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert any("window of 16 positions" in n and "made full-length" in n
               for n in manifest["notes"])
    served = out / next(v["path"] for v in manifest["variants"]
                        if v["name"] == manifest["selected"])
    record = cache_record(load_model(served))
    rng = np.random.default_rng(5)
    shared = rng.integers(3, VOCAB, 20).tolist()
    prompts = [shared + rng.integers(3, VOCAB, int(k)).tolist() for k in (3, 9)]
    prompts += [rng.integers(3, VOCAB, int(k)).tolist() for k in (5, 14, 30)]
    gen = Generator(OrtRunner(load_cpu(served)), record, VOCAB,
                    GenerateOptions(max_streams=4, prefix_block=16, prefill_tokens=8),
                    max_positions=128)
    try:
        streams = collect(gen, [GenerationRequest(tuple(p), 20) for p in prompts])  # at once
        got = [[t for c in chunks for t in c.ids] for chunks in streams]
    finally:
        gen.close()
    assert got == [_windowed_greedy(src, p, 20)[0] for p in prompts]
