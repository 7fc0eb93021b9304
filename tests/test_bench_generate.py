"""bench/generate_vs_genai.py: its summary arithmetic, and a smoke run of the whole bench on
a small Llama (tuner optimize of the genai builder's graph -> tuner serve twice -> streaming
clients, against onnxruntime-genai, in its own environment where our venv does not import
it)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from models import genai_builder

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("generate_vs_genai",
                                                  ROOT / "bench" / "generate_vs_genai.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["generate_vs_genai"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_ratios_and_their_median_and_range():
    bench = _bench()
    Run = bench.Run

    def run(tps: float, ttft: float, itl=(0.01, 0.01, 0.03), ids=((1, 2),)) -> Run:
        return Run(int(tps * 10), 10.0, (ttft,), itl, ids)

    alternation = {
        "genai 1": (run(50, 0.1), 1.0, 1.0), "serve 1": (run(55, 0.1), 1.0, 1.0),
        "genai static8": (run(100, 1.0), 1.0, 1.0), "serve 8": (run(140, 0.5), 1.0, 1.0),
        "serve 32": (run(160, 0.9), 1.0, 1.0), "serve 32 over time": (run(150, 0.5), 1.0, 1.0),
        "genai static8, varied lengths": (run(80, 1.0), 1.0, 1.0),
        "serve 32, varied lengths": (run(120, 0.9), 1.0, 1.0),
        "serve shared, prefix cache": (run(90, 0.2), 1.0, 1.0),
        "serve shared, no prefix cache": (run(60, 0.8), 1.0, 1.0),
        "serve 1, no speculation": (run(44, 0.1, ids=((1, 3),)), 1.0, 1.0),
        "genai 1, 4 beams": (run(20, 1.0, ids=((5, 6),)), 1.0, 1.0),
        "serve 1, 4 beams": (run(25, 1.0, ids=((5, 6),)), 1.0, 1.0),
        "genai batch 4, 4 beams": (run(40, 1.0, ids=((5, 6), (7, 8))), 1.0, 1.0),
        "serve 4 at once, 4 beams": (run(60, 1.0, ids=((5, 6), (7, 9))), 1.0, 1.0),
    }
    r = bench.ratios(alternation)
    assert r["1 stream / genai (goal >= 1.0)"] == pytest.approx(1.1)
    assert r["32 streams / genai static 8 (goal >= 1.5)"] == pytest.approx(1.6)
    assert r["32 varied lengths / genai static 8 on them (no goal)"] == pytest.approx(1.5)
    assert r["32 over 1 s: 2 x ITL p50 / p99 (goal >= 1)"] == pytest.approx(
        2 * 10 / 29.6, rel=1e-3)  # p99 of (10, 10, 30) ms
    assert r["shared prefix: TTFT p50 without / with prefix cache (goal >= 3)"] == pytest.approx(4)
    assert r["shared prefix: outputs identical (1 = yes)"] == 1.0
    assert bench.median_range([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert r["1 stream without prompt lookup / genai"] == pytest.approx(0.88)
    assert r["1 stream with prompt lookup / without"] == pytest.approx(1.25)
    assert r["1 stream: outputs identical with and without (1 = yes)"] == 0.0
    assert r["1 stream, 4 beams / genai 4 beams (no goal)"] == pytest.approx(1.25)
    assert r["4 beams: outputs identical to genai's (1 = yes)"] == 1.0
    assert r["4 searches at once / genai's batch of 4 (no goal)"] == pytest.approx(1.5)
    assert r["4 searches: outputs identical to genai's (1 = yes)"] == 0.0


@pytest.mark.venv(*genai_builder.VENV)  # built beside the first tests (conftest)
def test_the_bench_runs_end_to_end_on_a_small_llama(tmp_path, capsys):
    bench = _bench()
    # the genai builder's graph only (the README's headline source): the torch export's
    # path through optimize and serve is the same code, and the suite's time is bounded
    assert bench.main(["--small", "--repeats", "1", "--new", "4", "--prompt", "16",
                       "--system", "32", "--spread-s", "0.2", "--quick-optimize",
                       "--sources", "genai", "--work", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "served: genai graph, variant" in out
    assert "load before..after" in out
    lines = [x for x in out.splitlines() if x.startswith("shared prefix: outputs identical")]
    assert len(lines) == 1
    assert all(" 1.00x" in x for x in lines)  # with and without the prefix cache: same tokens
    # memory: each side's peak resident set, the server's over all it served
    memory = out.split("peak RSS, MB")[1]
    assert float(re.search(r"genai static8 +(\d+)", memory).group(1)) > 10
    assert float(re.search(r"tuner serve \(prefix\) +(\d+)", memory).group(1)) > 10
