"""Smoke runs of the serving benchmarks that drive the HTTP port (tiny sizes: they must
run and print their tables, not measure anything)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, *args: str) -> str:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_throughput_over_rest_runs() -> None:
    out = _run("serve_throughput.py", "--model", "bert", "--seconds", "0.3", "--rounds", "1",
               "--protocol", "both", "--no-adaptive", "--mlserver", "/nonexistent/mlserver")
    assert "tuner serve REST, batching on" in out and "tuner serve REST binary" in out
    assert "skipped MLServer" in out and "load average" in out


def test_latency_over_rest_runs() -> None:
    out = _run("serve_latency.py", "--models", "bert", "--seq", "16", "--rounds", "3")
    assert "added, REST " in out and "1.5 ms goal" in out


def test_openai_stream_runs() -> None:
    out = _run("serve_openai_stream.py", "--tokens", "4", "--rounds", "1")
    assert "OpenAI / gRPC per round" in out and "Messages / gRPC per round" in out
