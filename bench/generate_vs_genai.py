"""Generation through `tuner serve` (gRPC, real tritonclient streaming clients) against
onnxruntime-genai on the same weights, same threads, same machine, in one run.

    .venv/bin/python bench/generate_vs_genai.py [--small] [--threads 2] [--work DIR]

One random-weight Llama (the issue's shape: 8 layers, h 1024, 16 heads, 4 kv heads, FFN
2816, vocab 3072, ~96M parameters; `--small` for a quick run) is saved with save_pretrained,
with a byte-level BPE tokenizer made with the `tokenizers` library beside it. From that one
folder:
  - onnxruntime-genai's model builder (`python -m onnxruntime_genai.models.builder -i HF -o
    OUT -p fp32 -e cpu`) makes its own optimised graph; it is run in this process, batch 1
    one request after another, and as one static batch of 8;
  - models.kv exports the Hugging Face cache layout, written as an artifact (tuner.artifact)
    and served by `tuner serve` as a subprocess; tritonclient streams from it.
The two never run at the same time (they would share the cores). Workloads: greedy, 64 new
tokens; one stream with a prompt of 128; 8 and 32 independent streams arriving at random
times over --spread-s seconds with prompts of 64..192 tokens (mean 128), against genai
serving the same requests one after another. Prints one table with the ratios.
onnxruntime-genai runs in its own virtual environment (models/venvs.py, made on first use
under $SHAPETUNER_CACHE/venvs/): it needs the `onnxruntime` CPU wheel, which writes the same
module as the one onnxruntime wheel of ours (README: "One onnxruntime"). Its builder and its
timed runs are this script again, started with that environment's python (`--genai-side`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FULL = dict(num_hidden_layers=8, hidden_size=1024, num_attention_heads=16,
            num_key_value_heads=4, intermediate_size=2816)
SMALL = dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
             num_key_value_heads=2, intermediate_size=704)
VOCAB, POSITIONS = 3072, 512
# onnxruntime-genai's environment: its model builder reads the checkpoint with torch and
# transformers and writes the graph with onnx / onnx_ir.
GENAI_REQUIREMENTS = ("onnxruntime-genai==0.18.*", "torch==2.13.0", "transformers>=4.45",
                      "onnx", "onnx-ir", "onnxscript")


def genai_python() -> Path:
    """onnxruntime-genai's environment's python, made on first use."""
    sys.path.insert(0, str(ROOT))
    from models.venvs import ensure_venv

    return ensure_venv("genai", GENAI_REQUIREMENTS)


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    new: int
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Run:
    """One workload's outcome: tokens, wall time, first-token and inter-token latencies."""

    tokens: int
    wall_s: float
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    def itl_ms(self, q: float) -> float:
        return float(np.percentile(self.itl_s, q) * 1e3) if self.itl_s else float("nan")


# ------------------------------------------------------------------------------ prepare


def prepare_hf(folder: Path, dims: dict) -> None:
    """Random-weight Llama + tokenizer, saved the way a user's checkpoint folder looks."""
    import torch
    import transformers

    from models.genai_builder import save_tokenizer

    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**dims, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    save_tokenizer(folder, VOCAB)


def prepare_genai(hf: Path, out: Path, threads: int) -> None:
    if not (out / "genai_config.json").is_file():
        subprocess.run([str(genai_python()), "-P", "-m", "onnxruntime_genai.models.builder",
                        "-i", str(hf),
                        "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(out / "cache")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    path = out / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=2))


def prepare_artifact(hf: Path, out: Path, threads: int) -> Path:
    """The cache export of the same weights (models.kv), as an artifact with the tokenizer."""
    import transformers

    from models.build import IR_VERSION, OPSET_DYNAMO, OPSET_TORCHSCRIPT
    from models.kv import export_kv
    from tuner.artifact.records import Accuracy, Buckets, Manifest, Variant
    from tuner.artifact.store import write_manifest

    graph = out / "variants" / "original" / "model.onnx"
    if not graph.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval().float()
        export_kv(model, "torchscript", graph,
                  {"torchscript": OPSET_TORCHSCRIPT, "dynamo": OPSET_DYNAMO}, IR_VERSION)
    for name in ("tokenizer.json", "config.json"):
        shutil.copyfile(hf / name, out / name)
    sha = hashlib.sha256(graph.read_bytes()).hexdigest()
    original = Variant("original", "variants/original/model.onnx", True, (), {},
                       Accuracy(True, 0.0, 0.0))
    write_manifest(out, Manifest(str(hf / "llama.onnx"), sha, {"name": "cpu", "kind": "cpu"},
                                 "ort-cpu", {"intra_op_threads": threads}, "original",
                                 Buckets((1, 2, 4, 8, 16, 32), (64, 128, 256)), (original,)))
    return out


# ------------------------------------------------------------------------------ genai


def genai_run(folder: Path, jobs: list[Job], batch: int = 1) -> Run:
    """`genai_here` in onnxruntime-genai's environment: this script with --genai-side."""
    spec = json.dumps({"folder": str(folder), "batch": batch,
                       "jobs": [[list(j.prompt), j.new, j.arrival_s] for j in jobs]})
    done = subprocess.run([str(genai_python()), "-P", str(Path(__file__).resolve()),
                           "--genai-side"], input=spec, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai failed: {done.stderr[-3000:]}")
    r = json.loads(done.stdout.splitlines()[-1])
    return Run(r["tokens"], r["wall_s"], tuple(r["ttft_s"]), tuple(r["itl_s"]))


def _genai_side() -> int:
    """Inside onnxruntime-genai's environment: one genai_here run, its Run as JSON."""
    spec = json.loads(sys.stdin.read())
    jobs = [Job(tuple(p), n, t) for p, n, t in spec["jobs"]]
    r = genai_here(Path(spec["folder"]), jobs, spec["batch"])
    print(json.dumps({"tokens": r.tokens, "wall_s": r.wall_s, "ttft_s": list(r.ttft_s),
                      "itl_s": list(r.itl_s)}))
    return 0


def genai_here(folder: Path, jobs: list[Job], batch: int = 1) -> Run:
    """Jobs one after another (batch 1), or in static batches of `batch` equal prompts."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    # each run is its own process: one short generation first, as the in-process warm-up was
    warm = og.GeneratorParams(model)
    warm.set_search_options(max_length=len(jobs[0].prompt) + 2, do_sample=False)
    warm_gen = og.Generator(model, warm)
    warm_gen.append_tokens(np.array([jobs[0].prompt], np.int32))
    while not warm_gen.is_done():
        warm_gen.generate_next_token()
    del warm_gen
    ttft, itl, tokens = [], [], 0
    start = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i:i + batch]
        length = len(group[0].prompt)
        params = og.GeneratorParams(model)
        total = length + group[0].new
        params.set_search_options(max_length=total, min_length=total, do_sample=False,
                                  batch_size=len(group))
        generator = og.Generator(model, params)
        began = time.perf_counter()
        generator.append_tokens(np.array([j.prompt for j in group], np.int32))
        last = None
        while not generator.is_done():
            generator.generate_next_token()
            now = time.perf_counter()
            (ttft.append(now - began) if last is None else itl.append(now - last))
            last = now
        tokens += sum(len(generator.get_sequence(r)) - length for r in range(len(group)))
        del generator
    return Run(tokens, time.perf_counter() - start, tuple(ttft), tuple(itl))


# ------------------------------------------------------------------------------ served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(artifact: Path, threads: int) -> tuple[subprocess.Popen, int]:
    import tritonclient.grpc as tg

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tuner", "serve", str(artifact), "--port",
                             str(port), "--metrics-port", "-1", "--threads", str(threads),
                             "--max-streams", "32"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    for _ in range(600):
        try:
            if client.is_model_ready(artifact_name(artifact)):
                return proc, port
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"tuner serve exited: {proc.stderr.read()}")
        time.sleep(0.2)
    raise RuntimeError("tuner serve did not become ready")


def artifact_name(artifact: Path) -> str:
    from tuner.artifact.store import read_manifest

    return Path(read_manifest(artifact).source_path).stem


def _stream_one(port: int, name: str, job: Job, t0: float, out: list) -> None:
    """One client, one stream: wait for the job's arrival, send, time every response."""
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put(
        (time.perf_counter(), result, error)))
    ids = np.array([job.prompt], np.int64)
    inputs = [tg.InferInput("input_ids", list(ids.shape), "INT64"),
              tg.InferInput("max_tokens", [1], "INT32")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.array([job.new], np.int32))
    time.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    client.async_stream_infer(name, inputs)
    stamps, count = [], 0
    while True:
        at, result, error = responses.get(timeout=300)
        if error is not None:
            raise RuntimeError(error)
        n = result.as_numpy("output_ids").size
        if n:
            stamps.append(at)
            count += n
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    out.append((sent, stamps, count))


def served_run(port: int, name: str, jobs: list[Job]) -> Run:
    results: list = []
    t0 = time.perf_counter() + 0.2
    threads = [threading.Thread(target=_stream_one, args=(port, name, j, t0, results))
               for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = min(sent for sent, _, _ in results)
    last = max(stamps[-1] for _, stamps, _ in results)
    ttft = tuple(stamps[0] - sent for sent, stamps, _ in results)
    itl = tuple(b - a for _, stamps, _ in results for a, b in zip(stamps, stamps[1:]))
    return Run(sum(c for _, _, c in results), last - first, ttft, itl)


# ------------------------------------------------------------------------------ main


def workloads(prompt: int, new: int, spread_s: float) -> dict[str, list[Job]]:
    rng = np.random.default_rng(0)

    def jobs(n: int) -> list[Job]:
        lengths = rng.integers(prompt // 2, prompt * 3 // 2 + 1, n)
        arrivals = np.sort(rng.uniform(0, spread_s, n))
        return [Job(tuple(rng.integers(3, VOCAB, int(k)).tolist()), new, float(a))
                for k, a in zip(lengths, arrivals)]

    one = [Job(tuple(rng.integers(3, VOCAB, prompt).tolist()), new)]
    batch8 = [Job(tuple(rng.integers(3, VOCAB, prompt).tolist()), new) for _ in range(8)]
    return {"1": one, "8": jobs(8), "32": jobs(32), "static8": batch8}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a small Llama, for a quick run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--spread-s", type=float, default=1.0, help="arrivals spread over this")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-generate")
    a = ap.parse_args()
    shape = "small" if a.small else "full"
    work = a.work / shape
    hf, genai_dir, artifact = work / "hf", work / "genai", work / "artifact"
    print(f"preparing {shape} Llama under {work} ...", flush=True)
    prepare_hf(hf, SMALL if a.small else FULL)
    prepare_genai(hf, genai_dir, a.threads)
    prepare_artifact(hf, artifact, a.threads)
    w = workloads(a.prompt, a.new, a.spread_s)

    # The server is started first and idles (no CPU) while genai runs; the two alternate,
    # workload by workload, so that a change in the shared machine's load hits both.
    proc, port = start_server(artifact, a.threads)
    load = [os.getloadavg()[0]]
    try:
        name = artifact_name(artifact)
        genai_run(genai_dir, w["1"])  # warm-ups
        served_run(port, name, w["1"])
        print("1 stream ...", flush=True)
        g1 = genai_run(genai_dir, w["1"] * 3)
        s1 = _pooled([served_run(port, name, w["1"]) for _ in range(3)])
        print("8 streams ...", flush=True)
        g8 = genai_run(genai_dir, w["8"])
        s8 = served_run(port, name, w["8"])
        gs8 = genai_run(genai_dir, w["static8"], batch=8)
        print("32 streams ...", flush=True)
        s32 = served_run(port, name, w["32"])
        g32 = genai_run(genai_dir, w["32"])
    finally:
        proc.terminate()
        proc.wait(60)
    load.append(os.getloadavg()[0])
    print(f"load average (1 min) at the start and end: {load[0]:.1f}, {load[1]:.1f} "
          f"({os.cpu_count()} cores, shared)")
    print_table(shape, a, g1, g8, g32, gs8, s1, s8, s32)
    return 0


def _pooled(runs: list[Run]) -> Run:
    """Several runs of one stream as one: tokens and times add, latencies pool."""
    return Run(sum(r.tokens for r in runs), sum(r.wall_s for r in runs),
               tuple(x for r in runs for x in r.ttft_s), tuple(x for r in runs for x in r.itl_s))


def print_table(shape, a, g1, g8, g32, gs8, s1, s8, s32) -> None:
    dims = SMALL if a.small else FULL
    print(f"\nLlama {shape} ({dims['num_hidden_layers']} layers, h {dims['hidden_size']}, "
          f"{dims['num_attention_heads']} heads, {dims['num_key_value_heads']} kv heads, FFN "
          f"{dims['intermediate_size']}, vocab {VOCAB}), greedy, {a.new} new tokens, "
          f"{a.threads} threads, prompts {a.prompt} (1 stream) or {a.prompt // 2}.."
          f"{a.prompt * 3 // 2} arriving over {a.spread_s:g} s")
    head = f"{'workload':34s} {'tokens/s':>9s} {'TTFT ms':>9s} {'ITL p50':>8s} {'ITL p99':>8s}"
    print(head)
    print("-" * len(head))

    def row(label: str, r: Run) -> None:
        print(f"{label:34s} {r.tokens_per_s:9.1f} {np.median(r.ttft_s) * 1e3:9.1f} "
              f"{r.itl_ms(50):8.1f} {r.itl_ms(99):8.1f}")

    row("genai, 1 stream", g1)
    row("genai, 8 requests one by one", g8)
    row("genai, 32 requests one by one", g32)
    row("genai, static batch of 8", gs8)
    row("tuner serve, 1 stream", s1)
    row("tuner serve, 8 concurrent streams", s8)
    row("tuner serve, 32 concurrent streams", s32)
    print(f"\nratios: 1 stream {s1.tokens_per_s / g1.tokens_per_s:.2f}x genai (goal >= 1.0); "
          f"8 streams {s8.tokens_per_s / g8.tokens_per_s:.2f}x genai one by one (goal >= 3) and "
          f"{s8.tokens_per_s / gs8.tokens_per_s:.2f}x its static batch of 8 (goal > 1); "
          f"32 streams {s32.tokens_per_s / g32.tokens_per_s:.2f}x one by one, "
          f"{s32.tokens_per_s / gs8.tokens_per_s:.2f}x the static batch")


if __name__ == "__main__":
    sys.exit(_genai_side() if sys.argv[1:] == ["--genai-side"] else main())
