"""Benchmark: ONNX Runtime's fused variant against the original, as `tuner optimize` measures
and selects it, on Optimum's exports whose fused variant could not be offered before
2026-12-07 (Optimum's fp16 Llama: float32 rotary caches beside float16 activations; Gemma,
Gemma 2, Nemotron: one row of positions for every batch row).

    .venv/bin/python bench/fused_variants.py               # 3 whole alternations of 4 models
    .venv/bin/python bench/fused_variants.py --smoke       # one model, once, 2 rounds

Each run is `tuner optimize --no-cache` in its own process (its paired rounds: prefill plus
decode per request at its reference shapes); the models alternate within each repetition,
and the table gives the median ratio over repetitions with its range, how often the fused
variant was selected, and the 1-minute load average around the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models import optimum  # noqa: E402

MODELS = {"llama-fp16": ("llama", optimum.FP16_TASK), "gemma": ("gemma", optimum.TASKS[0]),
          "gemma2": ("gemma2", optimum.TASKS[0]), "nemotron": ("nemotron", optimum.TASKS[0])}


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def one_run(src: Path, out: Path, rounds: int) -> tuple[float, bool]:
    """The fused variant's speedup in one `tuner optimize`, and whether it was selected."""
    tuner = Path(sys.executable).with_name("tuner")  # the venv's command, as a user runs it
    subprocess.run([str(tuner), "optimize", str(src), "-o", str(out),
                    "--force", "--rounds", str(rounds), "--no-cache", "--no-plots", "-q"],
                   check=True, capture_output=True, cwd=ROOT)
    manifest = json.loads((out / "manifest.json").read_text())
    fused = next((v for v in manifest["variants"] if v["name"] == "fuse"), None)
    if fused is None or fused.get("speedup") is None:
        raise SystemExit(f"{src}: no fused variant measured: {manifest.get('notes')}")
    return fused["speedup"]["ratio"], manifest["selected"].startswith("fuse")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--repeats", type=int, default=3, help="whole alternations of the models")
    p.add_argument("--rounds", type=int, default=6, help="tuner optimize --rounds")
    p.add_argument("--smoke", action="store_true", help="gemma, once, 2 rounds")
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.repeats, a.rounds = ["gemma"], 1, 2
    sources = {m: optimum.cached(*MODELS[m]) for m in a.models}
    runs: dict[str, list[tuple[float, bool]]] = {m: [] for m in a.models}
    loads = [_load()]
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.repeats):
            for m in a.models:
                runs[m].append(one_run(sources[m], Path(tmp) / m, a.rounds))
                loads.append(_load())
                print(f"repeat {r + 1}: {m} {runs[m][-1][0]:.3f}x", file=sys.stderr, flush=True)
    print(f"| model | fused / original, median [min..max] of {a.repeats} | selected | "
          "load (1-min) |")
    print("|---|---|---|---|")
    for m, rows in runs.items():
        xs = [x for x, _ in rows]
        print(f"| {m} | {statistics.median(xs):.3f}x [{min(xs):.3f}..{max(xs):.3f}] | "
              f"{sum(s for _, s in rows)}/{len(rows)} | {min(loads):.1f}-{max(loads):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
