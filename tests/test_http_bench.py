"""Smoke runs of the serving benchmarks that drive the HTTP port (tiny sizes: they must
run and print their tables, not measure anything). serve_throughput.py's and
serve_latency.py's REST rows are checked in tests/test_bench_smoke.py, in the same runs as
their gRPC rows. bench/soak.py's runs are in tests/test_soak.py."""

from __future__ import annotations

import os
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
