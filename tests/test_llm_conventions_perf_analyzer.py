"""Triton's own perf_analyzer (the load generator under genai-perf) driving a decoder over
gRPC streaming with genai-perf's payloads for each backend (its tensorrtllm and vllm
converters write them as below), and an encoder over HTTP (`-i http`). perf_analyzer is a
binary from the tritonclient 2.51.0 wheel in its own venv (bench/serve_perf_analyzer.py
says how to install it); these tests skip, saying so, where it is absent."""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

import pytest
from llm_support import PROMPT, decoder_artifact, llama  # noqa: F401 - a fixture
from serving_support import free_port, make_artifact, serve_process

PERF_ANALYZER = os.environ.get("PERF_ANALYZER", "/tmp/pa-venv/bin/perf_analyzer")
TOKENS = 6


def _perf_analyzer(*args: str, tmp: Path) -> tuple[str, list[dict]]:
    if not Path(PERF_ANALYZER).exists():
        pytest.skip(f"perf_analyzer is not installed at {PERF_ANALYZER} (optional; see "
                    "bench/serve_perf_analyzer.py)")
    env = dict(os.environ)
    cuda = glob.glob(str(Path(PERF_ANALYZER).parents[1] / "lib/python3*/site-packages/nvidia/"
                         "cuda_runtime/lib"))
    if cuda:  # perf_analyzer links libcudart.so.12 even without a GPU
        env["LD_LIBRARY_PATH"] = cuda[0] + os.pathsep + env.get("LD_LIBRARY_PATH", "")
    profile = tmp / "profile.json"
    r = subprocess.run([PERF_ANALYZER, *args, "--measurement-mode", "count_windows",
                        "--measurement-request-count", "6", "--stability-percentage", "1000",
                        "--max-trials", "3", "--profile-export-file", str(profile)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout, [q for e in json.loads(profile.read_text())["experiments"]
                      for q in e["requests"]]


PAYLOADS = {
    "tensorrtllm": {"text_input": [PROMPT], "max_tokens": [TOKENS], "stream": [True],
                    "min_length": [TOKENS]},
    "vllm": {"text_input": [PROMPT], "exclude_input_in_output": [True], "stream": [True],
             "sampling_parameters": [json.dumps({"max_tokens": f"{TOKENS}",
                                                 "min_tokens": f"{TOKENS}"})]},
}


@pytest.mark.parametrize("backend", sorted(PAYLOADS))
def test_perf_analyzer_streams_genai_perf_payloads(llama, tmp_path, backend) -> None:  # noqa: F811
    if not Path(PERF_ANALYZER).exists():
        pytest.skip(f"perf_analyzer is not installed at {PERF_ANALYZER}")
    out = decoder_artifact(tmp_path / "art", llama)
    data = tmp_path / "inputs.json"
    data.write_text(json.dumps({"data": [PAYLOADS[backend]]}))
    port = free_port()
    proc = serve_process(out, port, "llm")
    try:
        report, requests = _perf_analyzer("-m", "llm", "-u", f"127.0.0.1:{port}", "-i", "grpc",
                                          "--streaming", "--input-data", str(data),
                                          "--concurrency-range", "2", tmp=tmp_path)
    finally:
        proc.terminate()
        proc.wait(60)
    assert "Detected decoupled model" in report and requests
    # each request: one response per token, then the empty final one perf_analyzer asks for
    assert {len(q["response_timestamps"]) for q in requests} == {TOKENS + 1}
    outputs = requests[0]["response_outputs"]
    assert [o["sequence_length"] for o in outputs[:TOKENS]] == list(range(1, TOKENS + 1))


def test_perf_analyzer_over_http(reference_model, tmp_path) -> None:
    if not Path(PERF_ANALYZER).exists():
        pytest.skip(f"perf_analyzer is not installed at {PERF_ANALYZER}")
    out = make_artifact(tmp_path / "art", reference_model("bert", "small"))
    data = tmp_path / "inputs.json"
    data.write_text(json.dumps({"data": [{"input_ids": {"content": [101, 592, 88, 102],
                                                        "shape": [4]},
                                          "attention_mask": {"content": [1, 1, 1, 1],
                                                             "shape": [4]}}]}))
    port, http = free_port(), free_port()
    proc = serve_process(out, port, "bert", "--http-port", str(http))
    try:
        report, requests = _perf_analyzer("-m", "bert", "-u", f"127.0.0.1:{http}", "-i", "http",
                                          "--input-data", str(data),
                                          "--concurrency-range", "1", tmp=tmp_path)
    finally:
        proc.terminate()
        proc.wait(60)
    assert "throughput" in report and len(requests) >= 6
