"""What the LM head cut (`logits_to_keep`, tuner/rewrite/logits_to_keep.py) saves on a prompt.

    .venv/bin/python bench/prefill_logits.py [--models llama,gpt2] [--prompts 128,512]
        [--rounds 15] [--repeats 3] [--threads 2] [--work DIR] [--smoke]

Each model is cut as `tuner optimize` cuts the decoder it serves, and its prompt run (1 x S
tokens from an empty cache, the first thing a request costs) is timed on the cut graph's one
session both ways, alternating round by round: every position's logits (the input not fed:
the graph as it was) and each row's last only (the server's prompt runs). Models:
  llama  bench/generate_vs_genai.py's Llama as onnxruntime-genai's builder writes it (8
         layers, h 1024, vocab 3072: the head is 3% of a prompt token's work), made in --work
         as bench/generation_bounds.py makes it (needs onnxruntime-genai's environment);
  gpt2   a GPT-2-small-shaped random-weight export (12 layers, h 768, vocab 50257: the head
         is about a third), TorchScript with its cache (models/kv.py), made in --work.
The builder's graph is shared with those two scripts (their --work, --genai-work here); the
cut graphs are written in --work.
Prints per model and prompt length the median time of each way, their ratio (last / all:
median [min..max] over the rounds), the logits each run writes, and the load average
before and after each repeat. `--smoke`: a 2-layer GPT-2 of the test models, 3 rounds, once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner.gate.decode_step import last_only  # noqa: E402
from tuner.gate.kv_feeds import prefill_feeds  # noqa: E402
from tuner.graph.cache_record import cache_record  # noqa: E402
from tuner.graph.load import load_model, save_model  # noqa: E402
from tuner.rewrite.logits_to_keep import add_logits_to_keep  # noqa: E402
from tuner.runtime.base import SessionSettings  # noqa: E402
from tuner.runtime.ort import OrtRunner, load_cpu  # noqa: E402


def gpt2_small(work: Path, smoke: bool) -> Path:
    """A random-weight GPT-2-small shape exported with its cache (the smoke: a test model)."""
    if smoke:
        from models.build import cached
        return cached("gpt2-kv", "awkward", "torchscript")
    out = work / "gpt2-small" / "model.onnx"
    if not out.exists():
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        from models.build import IR_VERSION, OPSET_DYNAMO, OPSET_TORCHSCRIPT
        from models.kv import export_kv
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config()).eval()  # 12 layers, h 768, vocab 50257
        out.parent.mkdir(parents=True, exist_ok=True)
        export_kv(model, "torchscript", out,
                  {"torchscript": OPSET_TORCHSCRIPT, "dynamo": OPSET_DYNAMO}, IR_VERSION)
    return out


def llama_genai(work: Path, threads: int) -> Path:
    sys.path.insert(0, str(ROOT / "bench"))
    from generation_bounds import genai_graph
    return genai_graph(work, small=False, threads=threads)


def cut(graph: Path, work: Path, name: str) -> Path:
    """The graph cut as optimize cuts it (its external data rewritten beside the cut), made
    once per source file (its path, size and time: the smoke's model is another one)."""
    st = graph.stat()
    key = hashlib.sha256(f"{graph.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()
    dst = work / f"{name}-cut-{key[:10]}" / "model.onnx"
    if not dst.exists():
        model = load_model(graph)
        add_logits_to_keep(model)
        save_model(model, dst)
    return dst


def measure(graph: Path, prompt: int, rounds: int, threads: int) -> tuple[list, list, int, int]:
    """Seconds of each round's run with every logit and with the last only, and the bytes of
    logits each writes."""
    record = cache_record(load_model(graph))
    runner = OrtRunner(load_cpu(graph, SessionSettings(intra_op_threads=threads,
                                                       allow_spinning=True)))
    vocab = record.vocab or 1000
    ids = np.random.default_rng(prompt).integers(0, min(vocab, 1000), (1, prompt))
    everything = prefill_feeds(record, ids)
    last = last_only(everything)
    sizes = [runner.infer(f.arrays)[record.logits].nbytes for f in (everything, last)]  # warm
    times: tuple[list, list] = ([], [])
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate which goes first
        for i in order:
            feeds = (everything, last)[i].arrays
            began = time.perf_counter()
            runner.infer(feeds)
            times[i].append(time.perf_counter() - began)
    runner.close()
    return times[0], times[1], sizes[0], sizes[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--models", default="llama,gpt2", help="comma-separated: llama, gpt2")
    p.add_argument("--prompts", default="128,512", help="prompt lengths, comma-separated")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--repeats", type=int, default=3, help="the whole run, this many times")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-prefill-logits")
    p.add_argument("--genai-work", type=Path, default=ROOT / ".cache" / "bench-generate-v2",
                   help="where bench/generate_vs_genai.py keeps the builder's graph")
    p.add_argument("--smoke", action="store_true", help="a 2-layer GPT-2, 3 rounds, once")
    a = p.parse_args(argv)
    models = ["gpt2"] if a.smoke else a.models.split(",")
    try:
        prompts = [8] if a.smoke else [int(x) for x in a.prompts.split(",")]
    except ValueError:
        p.error(f"--prompts takes token counts like 128,512, not {a.prompts!r}")
    rounds, repeats = (3, 1) if a.smoke else (a.rounds, a.repeats)
    makers = {"gpt2": lambda: gpt2_small(a.work, a.smoke),
              "llama": lambda: llama_genai(a.genai_work, a.threads)}
    unknown = [m for m in models if m not in makers]
    if unknown:
        p.error(f"unknown model(s) {unknown}: choose from {sorted(makers)}")
    graphs = {m: cut(makers[m](), a.work, m) for m in models}
    rows = []
    for repeat in range(repeats):
        before = os.getloadavg()[0]
        for m in models:
            for s in prompts:
                full, last, full_bytes, last_bytes = measure(graphs[m], s, rounds, a.threads)
                ratio = np.array(last) / np.array(full)
                rows.append((repeat + 1, m, s, np.median(full) * 1e3, np.median(last) * 1e3,
                             np.median(ratio), ratio.min(), ratio.max(), full_bytes, last_bytes))
        print(f"repeat {repeat + 1}: load average {before:.2f} before, "
              f"{os.getloadavg()[0]:.2f} after", flush=True)
    print("\n| repeat | model | prompt | every position ms | last only ms | last / every, "
          "median [min..max] | logits written |")
    print("|---|---|---|---|---|---|---|")
    for rep, m, s, f, l, med, lo, hi, fb, lb in rows:
        print(f"| {rep} | {m} | {s} | {f:.1f} | {l:.1f} | {med:.3f} [{lo:.3f}..{hi:.3f}] | "
              f"{fb / 2**20:.1f} MiB -> {lb / 2**10:.1f} KiB |")
    for m in models:
        for s in prompts:
            meds = [r[5] for r in rows if r[1] == m and r[2] == s]
            print(f"{m}, prompt {s}: last / every {np.median(meds):.3f} "
                  f"[{min(meds):.3f}..{max(meds):.3f}] over {len(meds)} repeat(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
