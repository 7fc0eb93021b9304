"""Encoder-decoder generation: `tuner serve FOLDER`'s loop (serving/generation/seq2seq.py,
in-process, no transport) against the loop users write around the same export, Optimum's
ORTModelForSeq2SeqLM and its greedy `generate`, on the same threads.

Workloads (--new tokens each, greedy, no early end; sources of 24-48 random ids, or for an
audio encoder (--family whisper_tiny) random log-mel features, one 30-s window each):
  1 stream     one source
  8 at once    8 sources submitted together: one cohort here; one `generate` call (a
               static batch, right-padded) in Optimum
  32 at once   32 sources likewise
  8 over 1 s   8 sources arriving evenly over a second: here each joins a cohort as it
               comes (rows at different steps run apart); Optimum has no server to take
               them as they come, so it has no column here

Each side runs in a process of its own each round (the model loaded before the clock starts;
its peak RSS reported), the two sides alternating round by round, --rounds rounds (3 or
more: the machine is shared). The table: tokens/s of each side, median [min..max], the median
ratio (here / Optimum) with its range, and the load average before and after. The first
round also checks that both sides generated the same tokens for the 1-stream source.

    .venv/bin/python bench/seq2seq_generate.py [--family t5_small] [--rounds 3]
        [--threads 2] [--new 32]      (--family t5 / whisper: the tests' tiny ones, a smoke
                                       run; --family whisper_tiny: Whisper-tiny's shape)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKLOADS = ("1 stream", "8 at once", "32 at once")
SPREAD = "8 over 1 s"


SIZES = {"1 stream": 1, "8 at once": 8, "32 at once": 32, SPREAD: 8}


def sources(vocab: int, seed: int = 0) -> dict[str, list[list[int]]]:
    """Each workload's sources: random token ids, 24-48 of them each."""
    rng = np.random.default_rng(seed)
    return {name: [rng.integers(4, vocab, int(rng.integers(24, 49))).tolist()
                   for _ in range(n)] for name, n in SIZES.items()}


def audio_sources(shape: tuple[int, int], path: Path, seed: int = 0) -> dict[str, list[int]]:
    """An audio encoder's: random log-mel features in Whisper's range, one (bins, frames)
    array per stream, saved to `path` (.npy); each workload names its rows."""
    rng = np.random.default_rng(seed)
    total = sum(SIZES.values())
    np.save(path, rng.uniform(-1, 1, (total, *shape)).astype(np.float32))
    rows, out = iter(range(total)), {}
    for name, n in SIZES.items():
        out[name] = [next(rows) for _ in range(n)]
    return out


# ------------------------------------------------------------------------ this side's worker


def _ours(folder: Path, threads: int, spec: dict) -> dict:
    """The loop in this process: each workload's tokens/s (and the 1-stream tokens)."""
    from serving.generation import GenerateOptions
    from serving.generation.seq2seq import Seq2SeqGenerator
    from serving.sampling import GenerationRequest, Sampling
    from serving.seq2seq import load_seq2seq
    from serving.text_config import load_text_config
    from tuner.runtime.base import SessionSettings

    model = load_seq2seq(folder, settings=SessionSettings(intra_op_threads=threads))
    eos = frozenset(load_text_config(folder).eos_ids)
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder,
                                 GenerateOptions(max_streams=32), max_target=model.max_target)
    new, features = spec["new"], spec.get("features")
    rows = np.load(features, mmap_mode="r") if features else None

    def request(source) -> GenerationRequest:
        """Token ids, or (audio) a row of the features file after the start token."""
        audio = rows is not None
        return GenerationRequest(prompt=(model.decoder.start,) if audio else tuple(source),
                                 max_tokens=new, min_tokens=new, sampling=Sampling(),
                                 stop_ids=eos, encoder_input=np.array(rows[source])
                                 if audio else None)

    def run(batch: list, spread_s: float = 0.0) -> tuple[float, int, list]:
        done, tokens = threading.Semaphore(0), [[] for _ in batch]

        def collect(i):
            def on_chunk(chunk):
                tokens[i].extend(chunk.ids)
                if chunk.final:
                    done.release()
            return on_chunk

        began = time.perf_counter()
        for i, source in enumerate(batch):
            if spread_s:
                time.sleep(max(0.0, began + i * spread_s / len(batch) - time.perf_counter()))
            generator.submit(request(source), collect(i))
        for _ in batch:
            done.acquire()
        return time.perf_counter() - began, sum(map(len, tokens)), tokens

    run([0 if rows is not None else [5, 6, 7]])  # warm up
    out = {}
    for name, batch in spec["workloads"].items():
        seconds, count, tokens = run(batch, 1.0 if name == SPREAD else 0.0)
        out[name] = {"seconds": seconds, "tokens": count}
        if name == "1 stream":
            out["first_tokens"] = tokens[0]
    generator.close()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _worker(argv: list[str]) -> int:
    folder, threads, path = Path(argv[0]), int(argv[1]), argv[2]
    print(json.dumps(_ours(folder, threads, json.loads(Path(path).read_text()))))
    return 0


# ------------------------------------------------------------------------------- the driver


def side(python: Path, script: list[str], folder: Path, threads: int, spec: Path) -> dict:
    done = subprocess.run([str(python), *script, str(folder), str(threads), str(spec)],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                               "OMP_NUM_THREADS": str(threads)})
    if done.returncode != 0:
        raise SystemExit(f"{script[-1]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _rate(run: dict, name: str) -> float:
    return run[name]["tokens"] / run[name]["seconds"]


def _mr(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} [{min(values):.1f}..{max(values):.1f}]"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="t5_small", help="models/optimum.py family (an "
                   "encoder-decoder): t5_small (the default), whisper_tiny (audio: random "
                   "log-mel features), or the tests' tiny t5 / whisper")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new", type=int, default=32, help="tokens each stream generates")
    a = p.parse_args(argv)
    from models import optimum

    family = optimum.family(a.family)
    task = family.tasks[0]
    if task not in optimum.SEQ2SEQ_TASKS[:2]:
        raise SystemExit(f"{a.family} is not an encoder-decoder of text or audio")
    folder = optimum.export_all([(a.family, task)])[0].parent
    ours_py, theirs_py = Path(sys.executable), optimum.ensure_venv()
    here = [str(Path(__file__).resolve()), "--worker"]
    there = ["-P", str(Path(__file__).with_name("_optimum_seq2seq_worker.py"))]
    load = [os.getloadavg()[0]]
    rounds: list[tuple[dict, dict]] = []
    with tempfile.TemporaryDirectory(prefix="seq2seq-bench-") as tmp:
        extra = {}
        if task == optimum.SEQ2SEQ_TASKS[1]:  # speech: features, (80, 3000) each
            extra = {"features": str(Path(tmp) / "features.npy")}
            work = audio_sources((family.config["num_mel_bins"], 3000), Path(extra["features"]))
        else:
            work = sources(family.config["vocab_size"])
        ours_spec, theirs_spec = Path(tmp) / "ours.json", Path(tmp) / "theirs.json"
        ours_spec.write_text(json.dumps({"new": a.new, "workloads": work, **extra}))
        theirs_spec.write_text(json.dumps({"new": a.new, **extra, "workloads": {
            k: v for k, v in work.items() if k != SPREAD}}))
        for r in range(a.rounds):
            order = [("ours", ours_py, here, ours_spec), ("theirs", theirs_py, there,
                                                         theirs_spec)]
            got = {name: side(py, script, folder, a.threads, spec)
                   for name, py, script, spec in (order if r % 2 == 0 else order[::-1])}
            rounds.append((got["ours"], got["theirs"]))
            load.append(os.getloadavg()[0])
    print_table(a, folder, rounds, load)
    return 0


def print_table(a, folder: Path, rounds: list[tuple[dict, dict]], load: list[float]) -> None:
    print(f"{a.family} ({folder.name}), {a.new} new tokens per stream, {a.threads} threads, "
          f"{len(rounds)} rounds alternating; load average (1 min) {min(load):.2f}-"
          f"{max(load):.2f} on {os.cpu_count()} cores")
    print(f"{'workload':12s} {'tuner serve tok/s':>24s} {'Optimum generate tok/s':>24s} "
          f"{'ratio':>22s}")
    for name in (*WORKLOADS, SPREAD):
        ours = [_rate(o, name) for o, _ in rounds]
        if name == SPREAD:
            print(f"{name:12s} {_mr(ours):>24s} {'(no server)':>24s} {'':>22s}")
            continue
        theirs = [_rate(t, name) for _, t in rounds]
        ratios = [x / y for x, y in zip(ours, theirs)]
        print(f"{name:12s} {_mr(ours):>24s} {_mr(theirs):>24s} "
              f"{statistics.median(ratios):6.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]")
    rss = [(o["peak_rss_mb"], t["peak_rss_mb"]) for o, t in rounds]
    print(f"peak RSS: tuner serve's loop {max(r[0] for r in rss):.0f} MB, Optimum "
          f"{max(r[1] for r in rss):.0f} MB (each process, model loaded)")
    print("1-stream tokens equal: " + ("yes" if all(o["first_tokens"] == t["first_tokens"]
                                                   for o, t in rounds) else "NO"))


if __name__ == "__main__":
    sys.exit(main())
