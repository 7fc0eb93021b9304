"""Speculative decoding by prompt lookup (`tuner serve --speculate N`) against none, in the
generation engine in-process: one stream at a time, the same prompts, the settings
alternated in a rotating order within each round so that the shared machine's drift hits
every one of them.

    .venv/bin/python bench/speculate.py [--small] [--rounds 5] [--drafts 2 3 4]
                                        [--graph MODEL.onnx] [--threads 2] [--smoke]

The model is bench/generate_vs_genai.py's random-weight Llama (8 layers, h 1024; `--small`
for 4 layers, h 256) exported by torch.onnx.export (or `--graph`: any decoder exported with
its cache, vocab read from its logits). Greedy, --new tokens after each of --streams random
--prompt-token prompts (new ones each round). Drafts come from the stream's own tokens, so
they are accepted where the output repeats itself: with random weights that is where the
model falls into a loop, which it does on some prompts and not others. The table gives
tokens/s (median [min..max] over rounds), the per-round ratio to no speculation, the drafts
accepted, whether every output equals the one without drafts, the load average before and
after each setting, and the process's peak RSS. `--smoke` runs a tiny shape in seconds
(tests/test_speculation.py).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def _graph(a) -> Path:
    if a.graph is not None:
        return a.graph
    import generate_vs_genai as g  # the same Llama, saved and exported as that bench does

    shape = "small" if a.small else "full"
    work = a.work / shape
    g.prepare_hf(work / "hf", g.SMALL if a.small else g.FULL)
    (work / "export").mkdir(parents=True, exist_ok=True)
    return g.torch_export(work / "hf", work / "export")


def _engine(graph: Path, threads: int, drafts: int, on_draft):
    from serving.generation import GenerateOptions, GenerationStats, Generator
    from tuner.graph.cache_record import cache_record
    from tuner.graph.load import load_model
    from tuner.runtime.base import SessionSettings
    from tuner.runtime.ort import OrtRunner, load_cpu

    record = cache_record(load_model(graph))
    runner = OrtRunner(load_cpu(graph, SessionSettings(intra_op_threads=threads)))
    vocab = record.vocab
    if vocab is None:
        raise SystemExit(f"{graph}: the logits' vocabulary is not static")
    return Generator(runner, record, vocab, GenerateOptions(speculate=drafts, max_streams=1),
                     max_positions=1024, stats=GenerationStats(on_draft=on_draft)), vocab


def _generate(gen, prompts, new: int) -> tuple[float, list[list[int]]]:
    """Tokens/s over the prompts, one after another, and each one's output ids."""
    from serving.sampling import GenerationRequest

    outputs, tokens, began = [], 0, time.perf_counter()
    for prompt in prompts:
        ids = [t for c in gen.generate(GenerationRequest(tuple(prompt), new)) for t in c.ids]
        outputs.append(ids)
        tokens += len(ids)
    return tokens / (time.perf_counter() - began), outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a small Llama (4 layers, h 256)")
    ap.add_argument("--smoke", action="store_true", help="tiny and quick: the tests' run")
    ap.add_argument("--graph", type=Path, help="a decoder exported with its cache")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--drafts", type=int, nargs="+", default=[2, 3, 4],
                    help="draft counts compared with none (tuner serve --speculate N)")
    ap.add_argument("--streams", type=int, default=4, help="prompts a round, one at a time")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-generate-v2")
    a = ap.parse_args(argv)
    if a.smoke:
        a.small, a.rounds, a.streams, a.prompt, a.new, a.drafts = True, 1, 2, 16, 8, [3]
    graph = _graph(a)
    settings = [0, *a.drafts]
    counted: dict[int, list[tuple[int, int]]] = {n: [] for n in settings}
    engines = {}
    for n in settings:
        engines[n], vocab = _engine(graph, a.threads, n,
                                    lambda d, k, n=n: counted[n].append((d, k)))
    rng = np.random.default_rng(0)
    warm = [rng.integers(3, vocab, a.prompt).tolist()]
    for gen in engines.values():
        _generate(gen, warm, a.new)  # the arena's first shapes, each engine's own
    tps: dict[int, list[float]] = {n: [] for n in settings}
    loads: dict[int, list[float]] = {n: [] for n in settings}
    same = {n: True for n in settings}
    try:
        for r in range(a.rounds):
            prompts = [rng.integers(3, vocab, a.prompt).tolist() for _ in range(a.streams)]
            outputs = {}
            for n in settings[r % len(settings):] + settings[:r % len(settings)]:
                before = os.getloadavg()[0]
                speed, outputs[n] = _generate(engines[n], prompts, a.new)
                tps[n].append(speed)
                loads[n] += [before, os.getloadavg()[0]]
            for n in settings:
                same[n] &= outputs[n] == outputs[0]
            print(f"round {r + 1} of {a.rounds}: " + ", ".join(
                f"{n} drafts {tps[n][-1]:.1f} tok/s" for n in settings), flush=True)
    finally:
        for gen in engines.values():
            gen.close()
    _table(a, graph, settings, tps, counted, same, loads)
    return 0


def _table(a, graph, settings, tps, counted, same, loads) -> None:
    print(f"\n{graph.name}: {a.streams} streams a round one at a time, prompt {a.prompt}, "
          f"{a.new} new tokens, greedy, {a.threads} threads, {a.rounds} rounds; "
          f"{os.cpu_count()} cores, shared")
    head = (f"{'--speculate':>11s} {'tokens/s median [min..max]':>28s} "
            f"{'per round / none':>22s} {'accepted / drafts':>18s} {'same':>5s} "
            f"{'load':>10s}")
    print(head)
    print("-" * len(head))
    for n in settings:
        v = np.asarray(tps[n])
        ratio = np.asarray(tps[n]) / np.asarray(tps[0])
        drafted, accepted = sum(d for d, _ in counted[n]), sum(k for _, k in counted[n])
        share = f"{accepted}/{drafted}" if n else "-"
        print(f"{n:11d} {np.median(v):9.1f} [{v.min():7.1f}..{v.max():7.1f}] "
              f"{np.median(ratio):8.3f}x [{ratio.min():.2f}..{ratio.max():.2f}] "
              f"{share:>18s} {'yes' if same[n] else 'NO':>5s} "
              f"{min(loads[n]):4.1f}..{max(loads[n]):.1f}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of this process (every engine's session): {peak:.0f} MB")


if __name__ == "__main__":
    sys.exit(main())
