"""bench/generate_one_stream.py: a smoke run on the genai builder's small Llama (its graph,
`tuner optimize`'s artifact of it, genai in its own environment), and its bare decode loop
generating the engine's own tokens (so the two sides it compares do the same work)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from models import genai_builder

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench")]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, Path]:
    import generate_vs_genai as g

    folder = genai_builder.cached("llama", "fp32").parent
    artifact = g.prepare_artifact(folder / "model.onnx", tmp_path_factory.mktemp("one") / "a",
                                  2, quick=True)
    return folder, artifact


def test_the_bare_loop_generates_the_engines_tokens(small) -> None:
    import generate_one_stream as b

    folder, artifact = small
    prompts = [[5, 17, 301, 9, 42, 7, 11, 12], [100, 3, 4, 200]]
    out = b.engine_side(artifact, 2, prompts, 6)
    assert [r["same tokens"] for r in out["rounds"]] == [1.0, 1.0]
    assert all(r["engine"] > 0 and r["bare"] > 0 for r in out["rounds"])


def test_smoke(small) -> None:
    folder, artifact = small
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "generate_one_stream.py"),
                        "--genai", str(folder), "--artifact", str(artifact), "--rounds", "2",
                        "--prompt", "12", "--new", "5"], cwd=ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    for row in ("engine in-process / bare ORT", "bare ORT / genai's loop", "served (gRPC"):
        assert re.search(rf"^{re.escape(row)}.* +\d+\.\d+ \[\d+\.\d+\.\.\d+\.\d+\]", r.stdout,
                         re.M), r.stdout
    assert "the bare loop's tokens = the engine's: yes" in r.stdout
