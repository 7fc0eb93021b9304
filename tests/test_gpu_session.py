"""bench/gpu_session.sh, the one command a GPU session runs: its --smoke mode runs every step
here on the CPU (the gpu tests skip) and leaves the same flat files under $OUT."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_session.sh"
FILES = {"session.log", "summary.txt", "facts.txt", "pytest_gpu.txt", "gpu_check.txt",
         "design.md", "design.json", "design.png"}
STEPS = ("facts", "pytest", "gpu_check", "design")


def _run(out: Path, *args: str, py: str = sys.executable) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PY": py}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)


def _summary(out: Path) -> dict[str, int]:
    rows = [line.split() for line in (out / "summary.txt").read_text().splitlines()]
    return {r[0]: int(r[2]) for r in rows}


def test_smoke_runs_every_step_and_writes_the_flat_files(tmp_path):
    out = tmp_path / "out"
    r = _run(out, "--smoke")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    names = {p.name for p in out.iterdir()}
    assert names == FILES
    # what the device tool brings back: plain files, directly under $OUT, plain names
    assert all(p.is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in out.iterdir())
    assert _summary(out) == {s: 0 for s in STEPS}
    for s in STEPS:
        assert f"===== [{s}] exit 0 after " in r.stdout
    assert (out / "session.log").read_text() == r.stdout

    facts = (out / "facts.txt").read_text()
    assert '"kind": "cpu"' in facts and "onnxruntime " in facts  # python -m tuner.hardware.detect ran
    tests = (out / "pytest_gpu.txt").read_text()
    assert "tests/test_probe.py" in tests and re.search(r"\d+ skipped, \d+ deselected", tests)
    check = (out / "gpu_check.txt").read_text()
    assert "SMOKE" in check
    for row in ("| probe | tiny  | vocab (lm_head)", "| torch | tiny  | vocab, whole LM",
                "| torch | tiny  | heads (head dim), layer stack", "| e2e   | tiny  | vocab on ort-cpu"):
        assert row in check
    design = json.loads((out / "design.json").read_text())
    assert design["backend"] == "ort-cpu" and design["baseline_kind"] == "start"
    assert (out / "design.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_step_does_not_stop_the_next_and_sets_the_exit_code(tmp_path):
    out = tmp_path / "out"
    r = _run(out, "--smoke", py=str(tmp_path / "no-such-python"))
    assert r.returncode == len(STEPS)
    assert _summary(out) == {s: 127 for s in STEPS}
    assert f"===== summary ({len(STEPS)} failed) =====" in r.stdout


def test_an_unknown_argument_exits_2(tmp_path):
    r = _run(tmp_path / "out", "--full")
    assert r.returncode == 2 and "usage: bash bench/gpu_session.sh [--smoke]" in r.stderr
