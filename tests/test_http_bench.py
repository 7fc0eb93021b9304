"""Smoke runs of the serving benchmarks that drive the HTTP port (tiny sizes: they must
run and print their tables, not measure anything). serve_throughput.py's and
serve_latency.py's REST rows are checked in tests/test_bench_smoke.py, in the same runs as
their gRPC rows. The soak runs a few seconds, and fails a server whose streams (or embedding
vectors) are not each what they are alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str, code: int = 0) -> str:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert r.returncode == code, r.stdout + r.stderr
    return r.stdout


def test_openai_stream_runs() -> None:
    out = _run("serve_openai_stream.py", "--tokens", "4", "--rounds", "1")
    assert "OpenAI / gRPC per round" in out and "Messages / gRPC per round" in out
    assert "Ollama / gRPC per round" in out


def test_soak_runs_every_client_and_finds_nothing_left() -> None:
    out = _run("soak.py", "--seconds", "5", "--clients", "4")
    for row in ("greedy, checked (openai)", "stream cancelled or read (tritonclient.grpc)",
                "malformed, answered 4xx (http)", "/v1/messages streamed"):
        assert f"| {row}" in out, out
    assert "client errors: 0" in out and "0 streams running, 0 queued" in out, out
    checked = re.search(r"idle server's answer: (\d+) of (\d+)", out)
    assert checked and checked[1] == checked[2] and int(checked[2]) > 0, out


def test_soak_fails_a_server_whose_streams_change_with_their_batch(reference_model,
                                                                   tmp_path) -> None:
    """ONNX Runtime's quantize_dynamic: one activation range per run, so a stream's tokens
    depend on the rows it shares runs with; served with --allow-batch-variance, the greedy
    checks differ from the idle server's and the soak exits 1."""
    sys.path.insert(0, str(ROOT / "bench"))
    from serve_common import decoder_artifact
    from serving_support import quantize_dynamic_copy

    quantized = quantize_dynamic_copy(reference_model("llama-kv", "awkward", "torchscript"),
                                      tmp_path / "q.onnx")
    art = decoder_artifact(tmp_path, quantized)
    out = _run("soak.py", "--seconds", "5", "--clients", "4", "--artifact", str(art),
               "--serve-args=--allow-batch-variance", code=1)
    checked = re.search(r"idle server's answer: (\d+) of (\d+)", out)
    assert checked and int(checked[1]) < int(checked[2]), out


def test_soak_checks_an_embedding_models_vectors_from_every_client() -> None:
    out = _run("soak.py", "--seconds", "3", "--clients", "4", "--model", "embedding")
    for row in ("embeddings, float, checked (openai)", "TEI /embed, checked (http)",
                "infer, checked (tritonclient.grpc)", "infer, checked (tritonclient.http)",
                "malformed, answered 4xx (http)"):
        assert f"| {row}" in out, out
    assert "client errors: 0" in out and "answers as before: yes" in out, out
    checked = re.search(r"vectors equal to the idle server's answer: (\d+) of (\d+)", out)
    assert checked and checked[1] == checked[2] and int(checked[2]) > 0, out


def test_soak_fails_an_embedding_server_whose_vectors_change_with_their_batch(tmp_path) -> None:
    """MiniLM quantized dynamically (one activation range per run) and batched with
    --allow-batch-variance: a text's vector depends on the texts beside it in the run, which
    the vector checks see (exit 1)."""
    from models.build import cached

    sys.path.insert(0, str(ROOT / "bench"))
    from serve_common import embedding_artifact
    from serving_support import quantize_dynamic_copy

    quantized = quantize_dynamic_copy(cached("minilm", "real", "torchscript"),
                                      tmp_path / "q.onnx")
    art = embedding_artifact(tmp_path, quantized)
    out = _run("soak.py", "--seconds", "5", "--clients", "4", "--artifact", str(art),
               "--serve-args=--max-batch 4 --allow-batch-variance", code=1)
    checked = re.search(r"vectors equal to the idle server's answer: (\d+) of (\d+)", out)
    assert checked and int(checked[1]) < int(checked[2]), out


def test_soak_checks_whisper_transcriptions_from_every_client() -> None:
    out = _run("soak.py", "--seconds", "3", "--clients", "4", "--model", "whisper")
    for row in ("transcribe, greedy, checked (openai)", "malformed, answered 4xx (http)",
                "bls, greedy, checked (tritonclient.grpc, Triton's Whisper names)"):
        assert f"| {row}" in out, out
    assert "client errors: 0" in out and "answers as before: yes" in out, out
    checked = re.search(r"transcriptions equal to the idle server's answer: (\d+) of (\d+)", out)
    assert checked and checked[1] == checked[2] and int(checked[2]) > 0, out


def test_soak_checks_a_rerankers_and_a_classifiers_scores_from_every_client() -> None:
    for model, rows in (("reranker", ("/v1/rerank, checked", "TEI /rerank, checked",
                                      "/score, checked")),
                        ("classifier", ("/classify, checked", "KServe V1 predict, checked",
                                        "TEI /predict, texts and pairs, checked"))):
        out = _run("soak.py", "--seconds", "2", "--clients", "4", "--model", model)
        for row in (*rows, "infer, checked (tritonclient.grpc)", "malformed, answered 4xx"):
            assert f"| {row}" in out, out
        assert "client errors: 0" in out and "answers as before: yes" in out, out
        checked = re.search(r"scores equal to the idle server's answer: (\d+) of (\d+)", out)
        assert checked and checked[1] == checked[2] and int(checked[2]) > 0, out
