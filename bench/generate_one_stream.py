"""Where one generation stream's time goes against onnxruntime-genai (the goal: 1 stream at
>= 1.0x genai's tokens/s), on genai's own graph of bench/generate_vs_genai.py's Llama.
Three comparisons, the two sides of each alternated round by round in one run, so that the
shared machine's drift hits both:

  engine / bare ORT   `tuner serve`'s generation engine in-process (scheduler, cache
                      manager, runner, output processor; no transport) against a bare loop
                      of IO-bound decode runs on the SAME onnxruntime session: what the
                      engine's own code costs per token;
  bare ORT / genai    the same bare loop against genai's generate loop, both in genai's
                      environment (its onnxruntime): whether the runtime alone decodes this
                      graph as fast as genai does;
  served / genai      `tuner serve` as a subprocess, one tritonclient gRPC stream, against
                      genai (bench/generate_vs_genai.py's 1-stream row).

Every side generates greedily --new tokens after the round's own --prompt random tokens;
a round's ratio is of the two sides' inter-token p50s (time per token: below 1 is faster);
the table gives the median [min..max] over --rounds and the load average. The bare loop
runs the graph as genai and the server run it: shared past/present buffers written in place
(GroupQueryAttention), new ids and the mask bound each step. The engine and the server run without prompt lookup
(`--speculate 0`): this bench measures what a decode run costs around it, one token a run;
bench/generate_vs_genai.py and bench/speculate.py measure what the drafts win.

    .venv/bin/python bench/generate_one_stream.py [--small] [--rounds 8] [--threads 2]
        [--serve-threads N]
        [--genai DIR --artifact DIR]  (a genai model folder and `tuner optimize`'s artifact
                                       of its model.onnx; default: made as generate_vs_genai
                                       makes them, under --work)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def bare_loop(session, prompt: list[int], new: int, past_shape: tuple[int, ...]
              ) -> tuple[np.ndarray, list[int]]:
    """Inter-token seconds and the tokens of a greedy generation as bare decode runs on
    `session` (genai's builder graph: past_key_values.N.key/value in, present.N.* out, each
    into one buffer of `past_shape`, (1, kv heads, capacity, head dim)). Needs nothing but
    onnxruntime and numpy: it runs in both environments."""
    pasts = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    if not pasts:
        raise SystemExit("the graph has no past_key_values.* inputs (not genai's builder's)")
    buffers = {i.name: np.zeros(past_shape, np.float32) for i in pasts}
    io = session.io_binding()
    for name, buf in buffers.items():
        for bind, bound in ((io.bind_input, name),
                            (io.bind_output, name.replace("past_key_values", "present"))):
            bind(bound, "cpu", 0, np.float32, list(buf.shape), buf.ctypes.data)
    stamps, length = [], 0

    def run(ids: list[int]) -> int:
        nonlocal length
        length += len(ids)
        io.bind_cpu_input("input_ids", np.array([ids], np.int64))
        io.bind_cpu_input("attention_mask", np.ones((1, length), np.int64))
        io.bind_output("logits", "cpu")
        session.run_with_iobinding(io)
        return int(np.argmax(io.get_outputs()[-1].numpy()[0, -1]))

    tokens = [run(prompt)]
    stamps.append(time.perf_counter())
    for _ in range(new - 1):
        tokens.append(run(tokens[-1:]))
        stamps.append(time.perf_counter())
    del buffers  # bound until here
    return np.diff(stamps), tokens


def genai_loop(model, prompt: list[int], new: int) -> np.ndarray:
    """Inter-token seconds of genai's own greedy loop (generate_next_token)."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, min_length=len(prompt) + new,
                              do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([prompt], np.int32))
    stamps = []
    while not generator.is_done():
        generator.generate_next_token()
        stamps.append(time.perf_counter())
    return np.diff(stamps)


def _genai_side() -> int:
    """In genai's environment: per round, genai's loop and the bare loop on a session of
    genai's onnxruntime (its threads from genai_config.json), in alternating order; the
    rounds' ITL p50s as JSON."""
    import onnxruntime as ort
    import onnxruntime_genai as og

    spec = json.loads(sys.stdin.read())
    folder = Path(spec["folder"])
    options = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    so = ort.SessionOptions()
    so.intra_op_num_threads = options.get("session_options", {}).get("intra_op_num_threads", 0)
    session = ort.InferenceSession(str(folder / "model.onnx"), so,
                                   providers=["CPUExecutionProvider"])
    model = og.Model(str(folder))
    new, past_shape = spec["new"], tuple(spec["past_shape"])
    sides = {"genai": lambda p: genai_loop(model, p, new),
             "bare": lambda p: bare_loop(session, p, new, past_shape)[0]}
    for side in sides.values():  # warm-up
        side(spec["prompts"][0][:8])
    out = []
    for i, prompt in enumerate(spec["prompts"]):
        order = list(sides) if i % 2 == 0 else list(sides)[::-1]
        out.append({k: float(np.median(sides[k](prompt))) for k in order})
    print(json.dumps({"rounds": out, "onnxruntime": ort.__version__}))
    return 0


def genai_side(python: Path, folder: Path, prompts: list[list[int]], new: int,
               past_shape: tuple[int, ...]) -> dict:
    spec = json.dumps({"folder": str(folder), "prompts": prompts, "new": new,
                       "past_shape": list(past_shape)})
    done = subprocess.run([str(python), "-P", str(Path(__file__).resolve()), "--genai-side"],
                          input=spec, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the genai side failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def engine_side(artifact: Path, threads: int, prompts: list[list[int]], new: int) -> dict:
    """In this process: the engine (serving.generation.Generator on the served variant) and
    the bare loop on the engine's own session, alternating; ITL p50s and run times."""
    import onnxruntime

    from serving.decoder import decoder_vocab
    from serving.generation.engine import Generator
    from serving.generation.options import GenerateOptions
    from serving.model import load_artifact
    from serving.sampling import GenerationRequest
    from tuner.runtime.base import SessionSettings

    model = load_artifact(artifact, settings=SessionSettings(intra_op_threads=threads,
                                                             allow_spinning=True))
    gen = Generator(model.runner, model.cache, decoder_vocab(model.signature, model.cache),
                    GenerateOptions(speculate=0), max_positions=model.max_positions,
                    batch_buckets=model.buckets.batch)
    runs: list[float] = []
    gen.step_runner.on_run = lambda rows, seconds: runs.append(seconds)

    tokens: dict[str, list[int]] = {}

    def engine(prompt: list[int]) -> np.ndarray:
        """Stamped where the engine hands each chunk on (its thread), as genai's loop is
        stamped when generate_next_token returns."""
        stamps, tokens["engine"], done = [], [], threading.Event()

        def on_chunk(chunk) -> None:
            stamps.append(time.perf_counter())
            tokens["engine"] += chunk.ids
            if chunk.final:
                done.set()

        gen.submit(GenerationRequest(tuple(prompt), max_tokens=new), on_chunk)
        done.wait()
        return np.diff(stamps)

    past_shape = model.cache.past_shape(1, gen.max_cache_len)  # as the engine's buffers

    def bare(prompt: list[int]) -> np.ndarray:
        itl, tokens["bare"] = bare_loop(model.runner.session, prompt, new, past_shape)
        return itl

    sides = {"engine": engine, "bare": bare}
    try:
        for side in sides.values():  # warm-up
            side(prompts[0][:8])
        out = []
        for i, prompt in enumerate(prompts):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            runs.clear()
            out.append({k: float(np.median(sides[k](prompt))) for k in order})
            out[-1]["engine run"] = float(np.median(runs[1:]))  # its decode runs alone
            out[-1]["same tokens"] = float(tokens["engine"] == tokens["bare"])
    finally:
        gen.close()
    return {"rounds": out, "onnxruntime": onnxruntime.__version__,
            "past_shape": tuple(int(d) for d in past_shape)}


def served_side(g, artifact: Path, genai_dir: Path, threads: int, prompts: list[list[int]],
                new: int) -> list[dict]:
    """`tuner serve` (a subprocess) and genai (its environment), alternating per round."""
    proc, port = g.start_server(artifact, threads, "--speculate", "0")
    name = g.artifact_name(artifact)
    try:
        g.served_run(port, name, [g.Job(tuple(prompts[0][:8]), 4)])  # warm-up
        out = []
        for i, prompt in enumerate(prompts):
            job = [g.Job(tuple(prompt), new)]
            sides = {"served": lambda: g.served_run(port, name, job),
                     "genai": lambda: g.genai_run(genai_dir, job)}
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]
            done = {k: sides[k]() for k in order}
            out.append({**{k: float(np.median(r.itl_s)) for k, r in done.items()},
                        "tokens/s": done["served"].tokens_per_s / done["genai"].tokens_per_s})
    finally:
        proc.terminate()
        proc.wait(60)
    return out


def _ratio(rounds: list[dict], a: str, b: str) -> tuple[float, float, float]:
    r = np.array([x[a] / x[b] for x in rounds])
    return float(np.median(r)), float(r.min()), float(r.max())


def _ms(rounds: list[dict], key: str) -> float:
    return float(np.median([x[key] for x in rounds])) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the small Llama, for a quick run")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-threads", type=int, help="the server's intra-op threads "
                    "(default: --threads): fewer than the cores leave one to the server's "
                    "and the client's delivery work")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--genai", type=Path, help="a genai model folder (genai_config.json)")
    ap.add_argument("--artifact", type=Path, help="tuner optimize's artifact of its model.onnx")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-generate-v2")
    a = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import generate_vs_genai as g

    if (a.genai is None) != (a.artifact is None):
        ap.error("--genai and --artifact go together")
    if a.genai is None:
        work = a.work / ("small" if a.small else "full")
        g.prepare_hf(work / "hf", g.SMALL if a.small else g.FULL)
        g.prepare_genai(work / "hf", work / "genai", a.threads)
        a.genai = work / "genai"
        a.artifact = g.prepare_artifact(a.genai / "model.onnx", work / "artifact-genai",
                                        a.threads, quick=a.small)
    vocab = json.loads((a.genai / "genai_config.json").read_text())["model"]["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, a.prompt).tolist() for _ in range(a.rounds)]
    load = [os.getloadavg()[0]]
    engine = engine_side(a.artifact, a.threads, prompts, a.new)
    load.append(os.getloadavg()[0])
    genai = genai_side(g.genai_python(), a.genai, prompts, a.new, engine["past_shape"])
    load.append(os.getloadavg()[0])
    served = served_side(g, a.artifact, a.genai, a.serve_threads or a.threads, prompts, a.new)
    load.append(os.getloadavg()[0])
    print_table(a, engine, genai, served, load)
    return 0


def print_table(a, engine: dict, genai: dict, served: list[dict], load: list[float]) -> None:
    rows = [("engine in-process / bare ORT, same session", engine["rounds"], "engine", "bare",
             f"onnxruntime {engine['onnxruntime']}"),
            ("bare ORT / genai's loop, genai's runtime", genai["rounds"], "bare", "genai",
             f"onnxruntime {genai['onnxruntime']}"),
            ("served (gRPC stream) / genai", served, "served", "genai",
             f"served on {a.serve_threads or a.threads} threads")]
    print(f"\none stream, genai's graph, prompt {a.prompt}, {a.new} new tokens, {a.threads} "
          f"threads, {a.rounds} rounds; load {min(load):.2f}..{max(load):.2f}")
    head = (f"{'time per token, A / B':44s} {'median [min..max]':>20s} {'A ms':>7s} "
            f"{'B ms':>7s}  note")
    print(head)
    print("-" * len(head))
    for label, rounds, x, y, note in rows:
        m, lo, hi = _ratio(rounds, x, y)
        print(f"{label:44s} {m:6.3f} [{lo:.3f}..{hi:.3f}] {_ms(rounds, x):7.2f} "
              f"{_ms(rounds, y):7.2f}  {note}")
    m = np.median([r["tokens/s"] for r in served])
    runs = _ms(engine["rounds"], "engine run")
    same = all(r["same tokens"] for r in engine["rounds"])
    print(f"\nserved tokens/s / genai's: {m:.3f} (the goal: >= 1.0); the engine's decode runs "
          f"{runs:.2f} ms of its {_ms(engine['rounds'], 'engine'):.2f} ms a token (the rest "
          f"is its Python between runs); the bare loop's tokens = the engine's: "
          f"{'yes' if same else 'NO'}")


if __name__ == "__main__":
    sys.exit(_genai_side() if sys.argv[1:] == ["--genai-side"] else main())
