"""bench/generation_bounds.py: its bound arithmetic on given costs, and a smoke run on both
cache layouts (the torch export's past fed back; onnxruntime-genai's GroupQueryAttention graph
decoding into shared buffers)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from models import genai_builder
from models.build import cached

pytestmark = pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("generation_bounds",
                                                  ROOT / "bench" / "generation_bounds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COSTS = {"p(1,100)": 1e-3, "p(8,100)": 1e-3, "d(1)": 0.010, "d(8)": 0.020, "d(16)": 0.030,
         "d(32)": 0.050}


def test_bounds_follow_the_costs():
    b = _bench().bounds(COSTS, prompt=100, new=11, spread_s=0.0)
    # one stream, and 8 streams of as many prompt tokens as the static batch: genai's own
    # schedule is the best there is
    assert b["1 stream / genai 1"] == (pytest.approx(1.0), 1.0)
    assert b["8 streams / genai static 8"] == (pytest.approx(1.0), 1.3)
    # static 8: 800 ms of prompts + 10 steps of 20 ms = 1.0 s for 88 tokens; 32 streams at
    # best: 3.2 s of prompts + 10 steps of 50 ms = 3.7 s for 352 tokens
    assert b["32 streams / genai static 8"][0] == pytest.approx((352 / 3.7) / (88 / 1.0))
    # all 32 arrive at once, each prompt prefilled in turn: TTFT p50 is the 16th/17th prompt's
    ttft = _bench().ttft_prefill_only(np.full(32, 100), np.zeros(32), 1e-3)
    assert ttft == pytest.approx(1.65)


def test_cheaper_decode_of_many_rows_raises_the_32_stream_bound():
    bench = _bench()
    cheap = {**COSTS, "d(32)": 0.025}
    assert (bench.bounds(cheap, 100, 11, 0.0)["32 streams / genai static 8"][0]
            > bench.bounds(COSTS, 100, 11, 0.0)["32 streams / genai static 8"][0])


def _smoke(graph: Path) -> str:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "generation_bounds.py"), "--graph",
                        str(graph), "--repeats", "1", "--prompt", "8", "--new", "4",
                        "--spread-s", "0.1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    for row in ("p(1,8)", "p(8,8)", "d(1)", "d(32)"):
        assert re.search(rf"^{re.escape(row)} +\d+\.\d+ \[", r.stdout, re.M), r.stdout
    assert re.search(r"^32 streams / genai static 8 +\d+\.\d+ \[.*\] +1\.5x +(yes|no)$",
                     r.stdout, re.M), r.stdout
    return r.stdout


def test_smoke_on_the_torch_export():
    assert "past fed back" in _smoke(cached("llama-kv", "awkward"))


def test_smoke_on_genais_graph():
    assert "rows at start, shared buffers" in _smoke(genai_builder.cached("llama", "fp32"))


def test_a_graph_without_a_cache_is_refused():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "generation_bounds.py"), "--graph",
                        str(cached("bert", "small"))], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "no KV cache found" in r.stderr
