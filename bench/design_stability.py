"""Is `tuner design`'s ranking stable? Run the search twice and compare every pair of shapes.

    .venv/bin/python bench/design_stability.py [--params 125e6] [--device cpu] [--rounds 15]
    .venv/bin/python bench/design_stability.py --smoke    # tiny, in seconds (the test suite's)

For each pair of shapes, each run gives a paired speedup with a 95% bootstrap interval (rounds
are paired within a run). A pair is "separated" in a run when its interval lies wholly outside
1 +- margin. The acceptance: every pair separated in both runs is ordered the same way in both;
pairs that are noisy in either run are listed, not counted as disagreements. Prints the wall
time of each run too (the 125M search must finish in under 5 minutes on the 2-core CPU).
"""

from __future__ import annotations

import argparse
import itertools
import time

from rich.console import Console
from rich.table import Table

from tuner.design.search import DesignRequest, run
from tuner.measure.stats import paired_ratio_ci
from tuner.util.progress import rich_progress


def separated(ci, margin: float) -> int:
    """+1: the first shape is faster beyond noise and margin; -1: slower; 0: noise."""
    if ci.low > 1 + margin:
        return 1
    if ci.high < 1 / (1 + margin):
        return -1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=125e6)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--ffn", default="plain")
    ap.add_argument("--margin", type=float, default=0.01)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny search (20M parameters, vocab 8000, 6-8 layers, batch 1 x 32, "
                         "3 rounds): the same code path in seconds, for the test suite")
    args = ap.parse_args()
    req = DesignRequest(int(args.params), None, None, ffn=args.ffn)
    shape: dict = {}
    if args.smoke:
        req = DesignRequest(20_000_000, None, (6, 8), vocab=8000, ffn=args.ffn, max_candidates=4)
        shape, args.rounds = {"batch": 1, "seq": 32, "threads": 1}, 3
    runs, walls = [], []
    for i in range(2):
        t0 = time.perf_counter()
        with rich_progress(title=f"run {i + 1}") as bar:
            ranking, _ = run(req, args.device, rounds=args.rounds, progress=bar, **shape)
        walls.append(time.perf_counter() - t0)
        runs.append({r.name: r.cost.total_ms for r in ranking.rows})
        print(f"run {i + 1}: {walls[-1]:.1f} s, ranking: {' > '.join(r.name for r in ranking.rows)}")
    names = sorted(runs[0])
    table = Table(title=f"pairwise speedups, two runs (margin {args.margin:.0%})")
    for col in ("A", "B", "run 1: A over B [95% CI]", "run 2", "verdict"):
        table.add_column(col)
    counts = {"agree": 0, "disagree": 0, "noise": 0}
    for a, b in itertools.combinations(names, 2):
        cis = [paired_ratio_ci(r[b], r[a]) for r in runs]  # > 1: a faster than b
        signs = [separated(ci, args.margin) for ci in cis]
        if 0 in signs:
            verdict = "noise"
        else:
            verdict = "agree" if signs[0] == signs[1] else "disagree"
        counts[verdict] += 1
        table.add_row(a, b, *(f"{ci.ratio:.3f} [{ci.low:.3f}, {ci.high:.3f}]" for ci in cis),
                      verdict)
    Console(width=160).print(table)
    print(f"pairs: {counts['agree']} separated in both runs and agreeing, {counts['disagree']} "
          f"disagreeing, {counts['noise']} within the noise in at least one run; "
          f"wall times {walls[0]:.1f} s and {walls[1]:.1f} s")
    return 1 if counts["disagree"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
