"""Every bench/ script runs: each one once on a tiny model or setting, in its own process, as
a user runs it, so that the figures the README publishes come from scripts that work.

Covered elsewhere: bench/big_model.py (tests/test_bench_big_model.py, --smoke),
bench/generation_bounds.py (tests/test_bench_bounds.py), bench/generate_one_stream.py
(tests/test_bench_one_stream.py), bench/
gpu_session.sh and bench/gpu_check.py --smoke (tests/test_gpu_session.py). bench/
serve_common.py is the library of the serve_* scripts and bench/serve_floor_server.py is
started by serve_latency.py: both run here through those. bench/generate_vs_genai.py needs
onnxruntime-genai, which the test venv does not install (its smoke test is its own).
bench/serve_perf_analyzer.py runs here up to where it needs the perf_analyzer binary (not
installed by the test extra)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from models import optimum
from models.build import cached

ROOT = Path(__file__).resolve().parent.parent


def _bench(script: str, *args: str, timeout: float = 300) -> str:
    """Run bench/<script> with this interpreter; its stdout (stderr on failure)."""
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"{script} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_design_stability_smoke():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "design_stability.py"), "--smoke"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = r.stdout
    found = re.search(r"pairs: (\d+) separated in both runs and agreeing, (\d+) disagreeing, "
                      r"(\d+) within the noise", out)
    assert found, out + r.stderr[-2000:]
    pairs = sum(int(x) for x in found.groups())
    assert pairs >= 1 and "run 1:" in out and "run 2:" in out
    # exit 1 exactly when a pair disagreed (3 rounds can: the verdict is the script's job)
    assert r.returncode == (1 if int(found.group(2)) else 0), r.stderr[-2000:]


def test_kv_policies_smoke():
    out = _bench("kv_policies.py", "--families", "gpt2", "--rounds", "3", "--past", "8",
                 "--prompt", "4")
    assert "decode 1x1 @ past 8" in out and "prefill 1x4" in out
    for row in ("original", "head_dim-128 keep", "head_dim-128 widen"):
        assert re.search(rf"^{row} +\d+\.\d+ ms", out, re.M), out


def test_optimize_gpt2_smoke():
    """Both parts on gpt2/small (not the 12-layer default), optimize with few rounds."""
    fast = ("--rounds 2 --warmup 0 --bucket-rounds 1 --no-probe --max-variants 2 --max-seq 16 "
            "--max-batch 1 --no-fuse")
    out = _bench("optimize_gpt2.py", "--model", str(cached("gpt2", "small")), "--rounds", "3",
                 "--shapes", "1x8", "--optimize-args", fast, timeout=600)
    assert "| whole `tuner optimize` (default settings) |" in out and "selected: " in out
    assert re.search(r"^  original +passed=True", out, re.M), out
    assert "accuracy gate: pass" in out
    assert re.search(r"^\| 1x8 \| [\d.]+ \([\d.]+\) \| [\d.]+ \([\d.]+\) \| [\d.]+x \[", out, re.M)


def test_serve_shared_memory_smoke():
    """Both paths (tensors in the messages, in shared memory) through tritonclient, equal."""
    out = _bench("serve_shared_memory.py", "--model", "bert", "--shapes", "1x16", "--rounds",
                 "3", "--repeats", "1")
    assert re.search(r"^  tensors in the messages +\d+\.\d+ ms", out, re.M), out
    assert re.search(r"^  tensors in shared memory +\d+\.\d+ ms", out, re.M), out
    diff = re.search(r"outputs max abs ([\d.e+-]+)", out)
    assert diff and float(diff.group(1)) < 1e-5 and "load average" in out, out


def test_serve_latency_smoke():
    """The server, the in-process baseline and the floor server (serve_floor_server.py)."""
    out = _bench("serve_latency.py", "--rounds", "5", "--models", "bert", "--seq", "16")
    for row in ("ORT in-process", "server, raw gRPC stub", "server, tritonclient",
                "floor: bare grpcio + same ORT", "added, raw gRPC", "server, REST (http.client)",
                "added, REST"):
        assert re.search(rf"^  {re.escape(row)} +-?\d+\.\d+", out, re.M), out
    assert "1.5 ms goal" in out and "load average" in out


def test_serve_throughput_smoke(tmp_path):
    """tuner serve, on what tuner optimize wrote, with its defaults and with batching on and
    off, over gRPC and REST (JSON and binary); MLServer's rows say why they are skipped when its venv is absent (here: a path
    that does not exist)."""
    out = _bench("serve_throughput.py", "--model", "bert", "--seconds", "0.3", "--rounds", "1",
                 "--quick", "--protocol", "both", "--mlserver", str(tmp_path / "no-mlserver"))
    assert re.search(r"^tuner optimize's artifact: (batching|no batch timings)", out, re.M), out
    for row in ("tuner serve, defaults", "tuner serve, batching on",
                "tuner serve, batching off", "tuner serve REST, defaults",
                "tuner serve REST binary, defaults", "tuner serve REST, batching on"):
        assert re.search(rf"^{row} +\d+\.\d+ ", out, re.M), out
    assert f"skipped MLServer: {tmp_path / 'no-mlserver'} not found" in out


def test_serve_perf_analyzer_without_the_binary_says_so(tmp_path):
    out = _bench("serve_perf_analyzer.py", "--model", "bert", "--perf-analyzer",
                 str(tmp_path / "perf_analyzer"))
    assert out.strip() == (f"skipped: {tmp_path / 'perf_analyzer'} not found (see this script's "
                           "docstring to install it)")


def test_mlserver_runtime_imports():
    pytest.importorskip("mlserver", reason="MLServer is optional and not in the test venv "
                                           "(bench/serve_throughput.py says how to install it)")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import mlserver_ort_runtime
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert issubclass(mlserver_ort_runtime.OrtRuntime, __import__("mlserver").MLModel)


def test_prefill_logits_smoke():
    """The LM head cut's bench: a 2-layer GPT-2, both ways, its table and its summary."""
    out = _bench("prefill_logits.py", "--smoke")
    assert re.search(r"^\| 1 \| gpt2 \| 8 \| \d+\.\d \| \d+\.\d \| \d\.\d{3} \[", out, re.M), out
    assert "gpt2, prompt 8: last / every" in out and "load average" in out


def test_speculate_smoke():
    """Prompt lookup's bench on the test Llama: both settings, their table, equal outputs."""
    out = _bench("speculate.py", "--smoke", "--graph",
                 str(cached("llama-kv", "awkward", "torchscript")))
    assert re.search(r"^ +3 +\d+\.\d \[.*\] +\d\.\d{3}x \[.*\] +\d+/\d+ +yes ", out, re.M), out
    assert "peak RSS" in out


@pytest.mark.parametrize("family", ["t5", "whisper"])
def test_seq2seq_generate_smoke(family):
    """The encoder-decoder loop against Optimum's generate, on the tests' tiny T5 and
    Whisper (random features): every workload's row, the memory line, and both sides'
    tokens the same."""
    out = _bench("seq2seq_generate.py", "--family", family, "--rounds", "1", "--new", "4")
    for row in ("1 stream", "8 at once", "32 at once"):
        assert re.search(rf"^{row} +\d+\.\d \[.*\] +\d+\.\d \[.*\] +\d+\.\d\dx \[", out,
                         re.M), out
    assert re.search(r"^8 over 1 s +\d+\.\d .*\(no server\)", out, re.M), out
    assert "1-stream tokens equal: yes" in out and "peak RSS" in out and "load average" in out


@pytest.mark.venv(*optimum.VENV)  # built beside the first tests (conftest)
def test_fused_variants_smoke():
    out = _bench("fused_variants.py", "--smoke")
    assert re.search(r"\| gemma \| \d\.\d{3}x \[", out), out
