"""bench/generate_one_stream.py: a smoke run on the genai builder's small Llama (its graph,
`tuner optimize`'s artifact of it, genai in its own environment), which also checks that
its bare decode loop generates the engine's own tokens (the two sides it compares do the
same work)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from models import genai_builder

pytestmark = pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench")]


def test_smoke(tmp_path) -> None:
    import generate_vs_genai as g

    folder = genai_builder.cached("llama", "fp32").parent
    artifact = g.prepare_artifact(folder / "model.onnx", tmp_path / "a", 2, quick=True)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "generate_one_stream.py"),
                        "--genai", str(folder), "--artifact", str(artifact), "--rounds", "2",
                        "--prompt", "12", "--new", "5"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    for row in ("engine in-process / bare ORT", "bare ORT / genai's loop", "served (gRPC"):
        assert re.search(rf"^{re.escape(row)}.* +\d+\.\d+ \[\d+\.\d+\.\.\d+\.\d+\]", r.stdout,
                         re.M), r.stdout
    assert "the bare loop's tokens = the engine's: yes" in r.stdout
