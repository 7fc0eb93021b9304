"""The best any engine can reach with one decoder graph on this machine, from the graph's own
measured costs: the ceilings under bench/generate_vs_genai.py's goals.

    .venv/bin/python bench/generation_bounds.py [--graph model.onnx] [--small] [--threads 2]
        [--prompt 128] [--new 64] [--spread-s 1.0] [--repeats 3] [--work DIR]

Without --graph, the graph is onnxruntime-genai's builder's (the Llama of
bench/generate_vs_genai.py, made in --work the way that script makes it, and shared with it
when both are given the same --work). Costs measured (ONNX Runtime on the CPU, --threads
threads, spinning as genai's sessions spin), each whole set --repeats times in turn:
  p(B, S)  a prompt token: one run of B rows x S tokens from an empty cache, / (B x S);
  d(B)     a decode step of B rows with prompt + new/2 cached entries each (the mean over a
           generation), written into shared buffers where the graph allows it (as `tuner
           serve` runs GroupQueryAttention's graphs), else fed its present as the next past.
From them, for bench/generate_vs_genai.py's workloads (N streams of `prompt` tokens on average,
`new` tokens each):
  genai's schedule   one request: prompt p(1, prompt) + (new - 1) d(1); a static batch of 8:
                     8 prompt p(8, prompt) + (new - 1) d(8) (the rows prefilled in one run,
                     then decoded together);
  any engine's best  N prompt p_min + (new - 1) d(N): every prompt token computed once at the
                     cheapest cost measured, every stream's new - 1 decode steps in the fewest
                     runs (all N rows together). It assumes a decode run costs at least d(B)
                     for B rows (d grows with B, d(B)/B shrinks: the table shows it) and
                     prompt and decode tokens in separate runs (GroupQueryAttention's graphs
                     run a prompt chunk beside a past at batch 1 only);
  TTFT p50           32 streams arriving uniformly over --spread-s: prompts prefilled one
                     after another as they arrive, nothing else run in between (first tokens
                     as soon as the prompts allow), against the static batch's first token
                     (its one prefill run).
A goal above its bound cannot be met with this graph on this machine by any scheduler: the
README's "Generation" section reads the goals against these.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner.gate.decode_step import pad_rows, step_feeds  # noqa: E402
from tuner.gate.kv_feeds import prefill_feeds  # noqa: E402
from tuner.graph.cache_record import CacheRecord, find_cache_record  # noqa: E402
from tuner.graph.io import load_model  # noqa: E402
from tuner.runtime.base import SessionSettings  # noqa: E402
from tuner.runtime.ort import OrtRunner, load_cpu  # noqa: E402

ROWS = (1, 8, 16, 32)  # decode batches measured
STEPS = 12  # decode steps per measurement (their median is d(B))


def genai_graph(work: Path, small: bool, threads: int) -> Path:
    """onnxruntime-genai's graph of bench/generate_vs_genai.py's Llama, made as it makes it."""
    sys.path.insert(0, str(ROOT / "bench"))
    import generate_vs_genai as g

    shape = "small" if small else "full"
    hf, out = work / shape / "hf", work / shape / "genai"
    g.prepare_hf(hf, g.SMALL if small else g.FULL)
    g.prepare_genai(hf, out, threads)
    return out / "model.onnx"


class Costs:
    """Times one graph's prompt runs and decode steps (seconds)."""

    def __init__(self, graph: Path, threads: int) -> None:
        record = find_cache_record(load_model(graph))
        if record is None:
            raise SystemExit(f"{graph}: no KV cache found (a decoder exported with its cache "
                             "is needed)")
        self.record: CacheRecord = record
        session = load_cpu(graph, SessionSettings(intra_op_threads=threads, allow_spinning=True))
        self.runner = OrtRunner(session)
        self.vocab = record.vocab or 2  # the ids only need to be valid
        self.rng = np.random.default_rng(0)

    def prompt_token(self, batch: int, seq: int) -> float:
        """p(batch, seq): one prefill run from an empty cache, per token."""
        ids = self.rng.integers(3, self.vocab, (batch, seq))
        feeds = prefill_feeds(self.record, ids).arrays
        began = time.perf_counter()
        self.runner.infer(feeds)
        return (time.perf_counter() - began) / (batch * seq)

    def decode_step(self, batch: int, past: int) -> float:
        """d(batch): the median of STEPS decode steps over caches of `past` entries."""
        r = self.record
        rows = [{n: self.rng.standard_normal(r.past_shape(1, past, n)).astype(
                     r.dtypes.get(n, r.dtype)) for n in r.past} for _ in range(batch)]
        shared = r.rows_at_start and self.runner.writes_into
        arrays, mask = pad_rows(r, rows, batch, past, past + STEPS if shared else None)
        seconds = []
        for _ in range(STEPS):
            tokens = [[int(t)] for t in self.rng.integers(3, self.vocab, batch)]
            feeds = step_feeds(r, tokens, mask, arrays)
            began = time.perf_counter()
            if shared:  # past and present one buffer: the graph writes the new entries
                self.runner.infer_into(feeds.arrays, {q: arrays[p] for p, q in
                                                      r.past_to_present.items()})
            else:
                out = self.runner.infer(feeds.arrays)
                arrays = {p: out[q] for p, q in r.past_to_present.items()}
            seconds.append(time.perf_counter() - began)
            mask = feeds.mask
        return float(np.median(seconds))


def measure(costs: Costs, prompt: int, past: int) -> dict[str, float]:
    """One set of costs: p(1, prompt), p(8, prompt), d(B) for B in ROWS."""
    out = {f"p(1,{prompt})": costs.prompt_token(1, prompt),
           f"p(8,{prompt})": costs.prompt_token(8, prompt)}
    for b in ROWS:
        out[f"d({b})"] = costs.decode_step(b, past)
    return out


def ttft_prefill_only(prompts: np.ndarray, arrivals: np.ndarray, per_token: float) -> float:
    """TTFT p50 when prompts are prefilled one after another in arrival order and nothing else
    runs: each first token comes when its prompt's run ends."""
    free, ttft = 0.0, []
    for n, at in zip(prompts, arrivals):
        free = max(free, at) + n * per_token
        ttft.append(free - at)
    return float(np.median(ttft))


def bounds(c: dict[str, float], prompt: int, new: int, spread_s: float
           ) -> dict[str, tuple[float, float | None]]:
    """{workload: (best ratio any engine reaches, the goal or None)} from one set of costs."""
    p1, p8 = c[f"p(1,{prompt})"], c[f"p(8,{prompt})"]
    p_min = min(p1, p8)
    genai_one = prompt * p1 + (new - 1) * c["d(1)"]
    static8 = 8 * prompt * p8 + (new - 1) * c["d(8)"]

    def best(n: int) -> float:  # tokens/s of n streams at the best schedule
        return n * new / (n * prompt * p_min + (new - 1) * c[f"d({n})"])

    rng = np.random.default_rng(0)  # the bench's spread: prompts prompt/2..3 prompt/2
    prompts = rng.integers(prompt // 2, prompt * 3 // 2 + 1, 32)
    arrivals = np.sort(rng.uniform(0, spread_s, 32))
    return {
        "1 stream / genai 1": (best(1) / (new / genai_one), 1.0),
        "8 streams / genai static 8": (best(8) / (8 * new / static8), 1.3),
        "32 streams / genai static 8": (best(32) / (8 * new / static8), 1.5),
        f"32 over {spread_s:g} s: static 8 TTFT / TTFT p50":
            (8 * prompt * p8 / ttft_prefill_only(prompts, arrivals, p_min), 1.0),
    }


def median_range(values: list[float]) -> str:
    v = np.asarray(values)
    return f"{np.median(v):.3f} [{v.min():.3f}..{v.max():.3f}]"


def run(graph: Path, threads: int, prompt: int, new: int, spread_s: float, repeats: int,
        say: Callable[[str], None] = print) -> dict[str, list[float]]:
    costs = Costs(graph, threads)
    past = prompt + new // 2
    measure(costs, prompt, past)  # warm-up: first runs of each shape allocate
    load = [os.getloadavg()[0]]
    sets = []
    for i in range(repeats):
        sets.append(measure(costs, prompt, past))
        load.append(os.getloadavg()[0])
        say(f"set {i + 1} of {repeats}: " + ", ".join(f"{k} {v * 1e3:.2f} ms"
                                                      for k, v in sets[-1].items()))
    say(f"\n{graph.name} ({'rows at start, shared buffers' if costs.record.rows_at_start else 'past fed back'}), "
        f"{threads} threads, prompt {prompt}, {new} new tokens, decode at {past} cached "
        f"entries; median of {repeats} [min..max], load {min(load):.2f}..{max(load):.2f}")
    say(f"{'cost':<12} {'ms':>26}  per row")
    for key in sets[0]:
        ms = [s[key] * 1e3 for s in sets]
        rows = int(key[2:-1]) if key.startswith("d(") else None
        say(f"{key:<12} {median_range(ms):>26}  "
            + (f"{np.median(ms) / rows:.2f} ms" if rows else "(per token)"))
    ratios: dict[str, list[float]] = {}
    for s in sets:
        for k, (ratio, _) in bounds(s, prompt, new, spread_s).items():
            ratios.setdefault(k, []).append(ratio)
    goals = {k: g for k, (_, g) in bounds(sets[0], prompt, new, spread_s).items()}
    say(f"\n{'workload: best any engine reaches':<48} {'bound':>22}  goal   reachable")
    for k, v in ratios.items():
        say(f"{k:<48} {median_range(v):>22}  {goals[k]:.1f}x  "
            f"{'yes' if np.median(v) >= goals[k] else 'no'}")
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", type=Path, help="a decoder graph with its KV cache (default: "
                    "onnxruntime-genai's builder's Llama, made in --work)")
    ap.add_argument("--small", action="store_true", help="the small Llama, for a quick run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--spread-s", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-generate-v2",
                    help="where the default graph is made (generate_vs_genai.py's too)")
    a = ap.parse_args(argv)
    if a.prompt < 2 or a.new < 2 or a.repeats < 1:
        ap.error("--prompt and --new must be >= 2, --repeats >= 1")
    graph = a.graph or genai_graph(a.work, a.small, a.threads)
    run(graph, a.threads, a.prompt, a.new, a.spread_s, a.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
