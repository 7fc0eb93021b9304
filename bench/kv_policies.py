"""What each KV-cache policy costs: the original cache export against its head dim padded to
128 with the cache kept (past padded inside the graph, present sliced back: copies every
step) and widened (a wider cache interface: no copies, but a wider cache to move), timed in
interleaved rounds on ONNX Runtime CPU, for a decode step (b x 1 against a cache of P) and a
prefill (b x s, past 0).

    python bench/kv_policies.py [--families gpt2,llama] [--rounds 15] [--past 128] [--threads 2]

Prints one table per family: median ms [IQR] per phase and the paired speedup over the
original with its 95% interval (> 1 is faster).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from models.build import cached
from tuner.graph.cache_record import cache_record
from tuner.gate.kv_feeds import decode_feeds, prefill_feeds
from tuner.gate.kv_gate import widen_feeds
from tuner.graph.inspect import inspect_model
from tuner.graph.kv_cache import widened_cache
from tuner.graph.load import load_model
from tuner.jobs.pad import pad_file
from tuner.measure.stats import paired_ratio_ci
from tuner.measure.timing import _calibrated, interleave
from tuner.rewrite.compose import PadRequest
from tuner.runtime.base import SessionSettings
from tuner.runtime.ort import OrtRunner, load_cpu


def _variants(family: str, tmp: Path) -> dict[str, Path]:
    src = cached(f"{family}-kv", "awkward", "dynamo")
    shape = inspect_model(load_model(src))
    out = {"original": src}
    for policy in ("keep", "widen"):
        dst = tmp / f"{family}-{policy}.onnx"
        pad_file(src, dst, PadRequest.from_multiples(shape, head_dim=128, cache_policy=policy))
        out[f"head_dim-128 {policy}"] = dst
    return out


def _time(runners, feeds, rounds: int) -> np.ndarray:
    calls = []
    for r, f in zip(runners, feeds):
        for _ in range(2):
            r.infer(f)
        calls.append(_calibrated(lambda r=r, f=f: r.infer(f), None, 20.0))
    out = interleave([c for c, _ in calls], rounds, warmup=0)
    return out / np.array([[reps] for _, reps in calls])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default="gpt2,llama")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--past", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    settings = SessionSettings(intra_op_threads=a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families.split(","):
            paths = _variants(family, Path(tmp))
            roles = cache_record(load_model(paths["original"]))
            runners = [OrtRunner(load_cpu(p, settings)) for p in paths.values()]
            tables = {}
            for phase, step in (
                    (f"decode {a.batch}x1 @ past {a.past}",
                     decode_feeds(roles, a.batch, a.past, 1, 1003, seed=1)),
                    (f"prefill {a.batch}x{a.prompt}",
                     prefill_feeds(roles, np.random.default_rng(1).integers(
                         0, 1003, (a.batch, a.prompt))))):
                feeds = [dict(widen_feeds(step, widened_cache(load_model(p))).arrays)
                         for p in paths.values()]
                tables[phase] = _time(runners, feeds, a.rounds)
            print(f"\n{family}-kv (dynamo), ORT CPU {a.threads} threads, {a.rounds} rounds")
            print(f"{'variant':22s} " + " ".join(f"{ph:>44s}" for ph in tables))
            for i, name in enumerate(paths):
                cells = []
                for ph, t in tables.items():
                    q1, med, q3 = np.percentile(t[i], [25, 50, 75])
                    ci = paired_ratio_ci(t[0], t[i]) if i else None
                    sp = f"{ci.ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}]" if ci else "-"
                    cells.append(f"{med:8.3f} ms [{q3 - q1:6.3f}] {sp:>22s}")
                print(f"{name:22s} " + " ".join(f"{c:>44s}" for c in cells))
            for r in runners:
                r.close()


if __name__ == "__main__":
    main()
