"""`tuner optimize` end to end on the small reference models (real exports, real ORT sessions).

Few rounds and tiny shapes keep these fast; what they check does not depend on timings:
the manifest is complete and valid, the selected variant is exact (proven by running it
against the source), buckets cover the request file, an interrupted run leaves nothing
behind and its rerun reuses the cache, and bad input exits 2 with one line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tuner.artifact.store import read_manifest, variant_path
from tuner.cli import main

FAST = ["--rounds", "2", "--warmup", "1", "--bucket-rounds", "1", "--quiet"]


def _run(args, capsys) -> tuple[int, str, str]:
    code = main(["optimize", *(str(a) for a in args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def _outputs_match(src: Path, variant: Path, vocab: int) -> None:
    """The variant's outputs equal the source's on fresh feeds (exactness, by running)."""
    import onnxruntime as ort

    rng = np.random.default_rng(7)
    feeds = {"input_ids": rng.integers(0, vocab, (2, 11), dtype=np.int64),
             "attention_mask": np.ones((2, 11), dtype=np.int64)}
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(str(variant), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        np.testing.assert_allclose(y, x, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("name, exporter", [("gpt2", "torchscript"), ("llama", "dynamo")])
def test_optimize_writes_a_complete_artifact(reference_model, tmp_path, capsys, name, exporter):
    src = reference_model(name, "awkward", exporter)
    req = tmp_path / "requests.jsonl"
    req.write_text("".join(json.dumps({"batch": b, "seq": s}) + "\n"
                           for b, s in [(1, 5), (1, 9), (1, 30), (2, 12), (1, 7), (3, 20)]))
    out = tmp_path / "out"
    code, stdout, err = _run([src, "-o", out, "--requests", req, "--json", "--max-variants", "3",
                              "--cache-dir", tmp_path / "cache", "--advise", *FAST], capsys)
    assert code == 0, err
    summary = json.loads(stdout)
    m = read_manifest(out)
    assert summary["selected"] == m.selected
    names = [v.name for v in m.variants]
    assert names[0] == "original" and 1 < len(names) <= 3
    sel = m.selected_variant()
    assert sel.exact and sel.accuracy.passed
    for v in m.variants:  # every variant was gated, measured at the comparison shapes, inspected
        assert v.accuracy.passed and v.latency and v.shape["hidden_size"] == 160
        assert (v.speedup is None) == (v.name == "original")
    # buckets cover every request in the file
    assert m.buckets.seq[-1] >= 30 and m.buckets.batch[-1] >= 3 and m.buckets.requests == 6
    e = m.buckets.expected
    assert e is not None and e.chosen_ms <= e.pad_to_max_ms + 1e-9
    for b in m.buckets.batch:
        for s in m.buckets.seq:
            assert f"{b}x{s}" in sel.latency  # the winner was timed at every bucket shape
    assert m.source_sha256 and Path(m.source_path) == src.resolve()
    assert m.advice and all(a.exact is False for a in m.advice)  # h=160: a retrain to 192
    assert all(a.name not in names for a in m.advice)
    assert m.settings["intra_op_threads"] >= 1 and m.device["name"]
    assert (out / "report.md").read_text().count("| ") > 5
    assert "data:image/png;base64" in (out / "report.html").read_text()
    vocab = m.variant("original").shape["vocab_size"]
    for v in m.variants[1:]:
        _outputs_match(src, variant_path(out, v), vocab)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def test_encoder_without_requests_uses_default_buckets(reference_model, tmp_path, capsys):
    out = tmp_path / "bert"
    code, _, err = _run([reference_model("bert", "small"), "-o", out, "--max-seq", "128",
                         "--max-batch", "2", "--no-fuse", "--no-cache", *FAST], capsys)
    assert code == 0, err
    m = read_manifest(out)
    assert m.variant("original").shape["vocab_size"] is None
    assert m.buckets.batch == (1, 2) and m.buckets.seq[-1] == 128
    assert set(m.buckets.seq) <= {64, 128}
    assert m.buckets.source.startswith("default")
    # --force replaces a finished artifact (only once the new one is complete)
    (out / "stale.txt").write_text("old")
    code, _, err = _run([reference_model("bert", "small"), "-o", out, "--max-seq", "64",
                         "--max-batch", "1", "--no-fuse", "--no-cache", "--force", *FAST], capsys)
    assert code == 0, err
    assert not (out / "stale.txt").exists() and read_manifest(out).buckets.seq[-1] == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


def test_interrupted_run_leaves_nothing_and_resumes_from_cache(reference_model, tmp_path, capsys):
    src = reference_model("gpt2", "small")
    cache, out = tmp_path / "cache", tmp_path / "out"
    args = [str(src), "-o", str(out), "--cache-dir", str(cache), "--max-seq", "64",
            "--max-batch", "2", "--rounds", "6", "--warmup", "1", "--no-fuse", "--max-variants",
            "2", "--no-probe", "--quiet"]
    # the bucket grid is made endless (a million rounds of >= 20 ms a shape: hours), so the
    # kill always lands in it, after the comparison of variants has reached the cache
    # (a child of a background job inherits SIGINT ignored: restore the default first)
    proc = subprocess.Popen([sys.executable, "-m", "tuner", "optimize", *args, "--bucket-rounds", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    cache_file = cache / "bench-cache.json"
    deadline = time.time() + 240
    while not cache_file.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert cache_file.exists(), "the first measured shape should reach the cache"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "tuner: interrupted" in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    stored = json.loads(cache_file.read_text())["entries"]
    assert len(stored) >= 2  # one shape, every variant

    code, _, err = _run([*args, "--bucket-rounds", "1"], capsys)
    assert code == 0, err
    m = read_manifest(out)
    assert any("taken from the results cache" in n for n in m.notes), m.notes
    again = json.loads(cache_file.read_text())["entries"]
    for k, v in stored.items():  # reused, not re-measured
        assert again[k] == v


def test_bad_inputs_exit_2_with_one_line(reference_model, tmp_path, capsys):
    src = reference_model("gpt2", "small")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00not a model")
    bad_req = tmp_path / "r.jsonl"
    bad_req.write_text('{"seq": "long"}\n')
    long_req = tmp_path / "long.jsonl"
    long_req.write_text('{"seq": 5000}\n')
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    cases = [
        ([tmp_path / "missing.onnx", "-o", tmp_path / "o1"], "no such model file"),
        ([junk, "-o", tmp_path / "o2"], "not a readable ONNX model"),
        ([src, "-o", tmp_path / "o3", "--requests", bad_req], "seq must be a positive integer"),
        ([src, "-o", tmp_path / "o4", "--requests", long_req], "longer than the model's maximum"),
        ([src, "-o", full], "exists and is not empty"),
        ([src, "-o", tmp_path / "o5", "--rounds", "1"], "--rounds must be >= 2"),
        (["-o", tmp_path / "o6", "--demo", "t5"], "--demo must be one of"),
        (["-o", tmp_path / "o7"], "give a MODEL.onnx or --demo"),
        ([src, "-o", tmp_path / "o8", "--backend", "nope"], "unknown backend"),
    ]
    for args, msg in cases:
        code, _, err = _run([*args, "--no-cache", "--quiet"], capsys)
        assert code == 2, (args, err)
        assert msg in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "junk.onnx", "long.jsonl", "r.jsonl"]


def test_cli_exit_code_from_a_real_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "tuner", "optimize", str(tmp_path / "nope.onnx"),
                        "-o", str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2 and r.stderr.strip().startswith("tuner: error:")


def test_rerun_plans_the_same_candidates_from_the_cache(reference_model, tmp_path, capsys):
    """The probe's timings are cached too: a rerun builds the same variants and finds their
    timings, instead of re-probing into other noise and measuring other variants."""
    src = reference_model("gpt2", "small")
    args = [src, "--cache-dir", tmp_path / "cache", "--max-seq", "16", "--max-batch", "1",
            "--max-variants", "3", "--no-fuse", *FAST]
    assert _run([*args, "-o", tmp_path / "a"], capsys)[0] == 0
    assert _run([*args, "-o", tmp_path / "b"], capsys)[0] == 0
    a, b = read_manifest(tmp_path / "a"), read_manifest(tmp_path / "b")
    assert [v.name for v in a.variants] == [v.name for v in b.variants]
    assert any("taken from the results cache" in n for n in b.notes)
    assert a.variant("original").latency == b.variant("original").latency
