"""Generation through `tuner serve` (gRPC, real tritonclient streaming clients) against
onnxruntime-genai on the same weights, same threads, same machine, in one run.

    .venv/bin/python bench/generate_vs_genai.py [--small] [--threads 2] [--repeats 3]
                                                [--sources genai torch]

One random-weight Llama (the issue's shape: 8 layers, h 1024, 16 heads, 4 kv heads, FFN
2816, vocab 3072, ~96M parameters; `--small` for a quick run) is saved with save_pretrained,
with a byte-level BPE tokenizer made with the `tokenizers` library beside it. From that one
folder:
  - onnxruntime-genai's model builder (`python -m onnxruntime_genai.models.builder -i HF -o
    OUT -p fp32 -e cpu`) makes its own optimised graph; it is run in this process, one
    request after another, and as one static batch of 8;
  - `tuner optimize` makes an artifact (its padded and fused variants gated and timed; the
    one it selects is served) from each source: `genai`, the builder's graph above (what a
    genai user brings: both engines then run the same graph, so the table compares engines),
    and `torch`, models.kv's export of the Hugging Face cache layout (torch.onnx.export:
    repeat_kv, no GroupQueryAttention); `tuner serve` serves it as a subprocess (twice: with
    and without the prefix cache, with its defaults otherwise, prompt lookup's speculation
    included; and a third time without it, `--speculate 0`, for the 1-stream workload);
    tritonclient streams from it.
The two never run at the same time (they would share the cores). Workloads, greedy: one
stream (prompt 128, 64 new tokens); 8 and 32 streams sent at once (prompts 64..192); 32
arriving over --spread-s; 32 sharing a 512-token system prompt; and one stream searched with
4 beams (two prompts, one after another; the end token masked out, as genai's min_length
does, and the outputs compared with genai's); four such searches at once against genai's
batch of 4 searched prompts. The whole alternation runs
--repeats times; the table shows medians with their range and the load average (1 min)
before and after each workload. onnxruntime-genai runs in this process where it is importable;
elsewhere in its own virtual environment (models/venvs.py, made on first use under
$SHAPETUNER_CACHE/venvs/), because it needs the `onnxruntime` CPU wheel, which writes the same
module as our one onnxruntime wheel (README: "One onnxruntime"): its builder and its timed
runs are then this script again, started with that environment's python (`--genai-side`).
Over 400 lines on purpose: a benchmark is one file a user runs and reads top to bottom.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import resource
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
VOCAB, POSITIONS = 3072, 1024
EOS = 2  # the end token of the saved config
BEAMS = 4  # the beam-search workloads' width
SEARCHES = 4  # searches at once (the server's beams share runs; genai's batch of them)


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
    ids: tuple = ()  # each stream's output ids (served runs)
    peak_mb: float | None = None  # genai's: its process's peak RSS (the model loaded, run)

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

    sys.path.insert(0, str(ROOT))
    from models.genai_builder import save_tokenizer

    if (folder / "config.json").is_file():
        return
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**dims, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    save_tokenizer(folder, VOCAB)


def _genai_importable() -> bool:
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        return False
    return True


def genai_python() -> Path:
    """A python that imports onnxruntime_genai: this one, or its own environment's (made on
    first use, models.genai_builder)."""
    if _genai_importable():
        return Path(sys.executable)
    sys.path.insert(0, str(ROOT))
    from models.genai_builder import venv_python

    return venv_python()


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


def torch_export(hf: Path, export: Path) -> Path:
    """The cache export of the same weights (models.kv), tokenizer and config beside it."""
    import transformers

    from models.build import IR_VERSION, OPSET_DYNAMO, OPSET_TORCHSCRIPT
    from models.kv import export_kv

    graph = export / "llama.onnx"
    if not graph.is_file():
        model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval().float()
        export_kv(model, "torchscript", graph,
                  {"torchscript": OPSET_TORCHSCRIPT, "dynamo": OPSET_DYNAMO}, IR_VERSION)
    for name in ("tokenizer.json", "config.json"):
        shutil.copyfile(hf / name, export / name)
    return graph


def prepare_artifact(graph: Path, out: Path, threads: int, quick: bool = False) -> Path:
    """`graph` through `tuner optimize`: the artifact is what optimize selects (padded and
    fused variants gated, timed and chosen like for any model, decode steps compared at the
    32 streams the server runs at once), served as it is. Made again when the tuner's code
    changed since (an artifact of older code would measure that code's choices)."""
    stamp = out / ".made-by"
    if not (out / "manifest.json").is_file() or not stamp.is_file() \
            or stamp.read_text() != _tuner_sha():
        rounds = ["--rounds", "2", "--warmup", "1", "--bucket-rounds", "1"] if quick else []
        subprocess.run([sys.executable, "-m", "tuner", "optimize", str(graph), "-o", str(out),
                        "--threads", str(threads), "--max-batch", "32", "--streams", "32",
                        "--force", "-q",
                        "--no-cache", *rounds], check=True, env=_env())
        stamp.write_text(_tuner_sha())
    return out


def _tuner_sha() -> str:
    """One hash of the tuner package's sources (what makes an artifact)."""
    digest = hashlib.sha256()
    for f in sorted((ROOT / "tuner").rglob("*.py")):
        digest.update(f.relative_to(ROOT).as_posix().encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------------------ genai


def genai_run(folder: Path, jobs: list[Job], batch: int = 1, beams: int = 1) -> Run:
    """genai_here, in this process where onnxruntime_genai imports, else in its own
    environment (this script with --genai-side, the Run back as JSON)."""
    if _genai_importable():
        return genai_here(folder, jobs, batch, beams)
    spec = json.dumps({"folder": str(folder), "batch": batch, "beams": beams,
                       "jobs": [[list(j.prompt), j.new, j.arrival_s] for j in jobs]})
    done = subprocess.run([str(genai_python()), "-P", str(Path(__file__).resolve()),
                           "--genai-side"], input=spec, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai failed: {done.stderr[-3000:]}")
    r = json.loads(done.stdout.splitlines()[-1])
    return Run(r["tokens"], r["wall_s"], tuple(r["ttft_s"]), tuple(r["itl_s"]),
               tuple(tuple(ids) for ids in r["ids"]), r["peak_mb"])


def _genai_side() -> int:
    """Inside onnxruntime-genai's environment: one genai_here run, its Run as JSON."""
    spec = json.loads(sys.stdin.read())
    jobs = [Job(tuple(p), n, t) for p, n, t in spec["jobs"]]
    r = genai_here(Path(spec["folder"]), jobs, spec["batch"], spec["beams"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (Linux: KiB)
    print(json.dumps({"tokens": r.tokens, "wall_s": r.wall_s, "ttft_s": list(r.ttft_s),
                      "itl_s": list(r.itl_s), "ids": [list(ids) for ids in r.ids],
                      "peak_mb": peak}))
    return 0


def genai_here(folder: Path, jobs: list[Job], batch: int = 1, beams: int = 1) -> Run:
    """Jobs one after another (batch 1), or in static batches of `batch` equal prompts. A
    batch runs until its longest job is done; the tokens counted are what each job asked
    for (a shorter job's row goes on being computed: what a static batch costs). `beams`:
    each job searched with that many (transformers' settings: no early stopping, length
    penalty 1), its best sequence kept."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    # a run in its own process: one short generation first (the in-process runs are warm)
    warm = og.GeneratorParams(model)
    warm.set_search_options(max_length=len(jobs[0].prompt) + 2, do_sample=False)
    warm_gen = og.Generator(model, warm)
    warm_gen.append_tokens(np.array([jobs[0].prompt], np.int32))
    while not warm_gen.is_done():
        warm_gen.generate_next_token()
    del warm_gen
    ttft, itl, tokens, ids = [], [], 0, []
    search = dict(num_beams=beams, early_stopping=False, length_penalty=1.0) if beams > 1 else {}
    start = time.perf_counter()
    for i in range(0, len(jobs), batch):
        group = jobs[i:i + batch]
        length = len(group[0].prompt)
        params = og.GeneratorParams(model)
        total = length + max(j.new for j in group)
        params.set_search_options(max_length=total, min_length=total, do_sample=False,
                                  batch_size=len(group), **search)
        generator = og.Generator(model, params)
        began = time.perf_counter()
        generator.append_tokens(np.array([j.prompt for j in group], np.int32))
        last = None
        while not generator.is_done():
            generator.generate_next_token()
            now = time.perf_counter()
            (ttft.append(now - began) if last is None else itl.append(now - last))
            last = now
        made = [generator.get_sequence(r)[length:length + j.new].tolist()
                for r, j in enumerate(group)]
        tokens += sum(len(m) for m in made)
        ids += [tuple(m) for m in made]
        del generator
    return Run(tokens, time.perf_counter() - start, tuple(ttft), tuple(itl), tuple(ids))


# ------------------------------------------------------------------------------ served


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(artifact: Path, threads: int, *extra: str) -> tuple[subprocess.Popen, int]:
    import tritonclient.grpc as tg

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuner", "serve", str(artifact), "--port",
                             str(port), "--metrics-port", "-1", "--threads", str(threads),
                             "--max-streams", "32", "--http-port", "-1",
                             # ORT's threads spin between runs in genai's sessions (the
                             # runtime's default): the server's do the same here
                             "--spin", *extra], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
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


def _stream_one(port: int, name: str, index: int, job: Job, t0: float, out: list,
                beams: int = 1) -> None:
    """One client, one stream: wait for the job's arrival, send, time every response.
    `beams` > 1: searched with TensorRT-LLM's beam_width, the end token masked out for the
    whole length (end_id with min_length, as genai's min_length masks it)."""
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
    if beams > 1:
        for control, value in (("beam_width", beams), ("end_id", EOS), ("min_length", job.new)):
            inputs.append(tg.InferInput(control, [1], "INT32"))
            inputs[-1].set_data_from_numpy(np.array([value], np.int32))
    time.sleep(max(0.0, t0 + job.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    client.async_stream_infer(name, inputs)
    stamps, ids = [], []
    while True:
        at, result, error = responses.get(timeout=300)
        if error is not None:
            raise RuntimeError(error)
        got = result.as_numpy("output_ids")[0].tolist()  # (beams, n): the best beam's
        if got:
            stamps.append(at)
            ids += got
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    out.append((index, sent, stamps, ids))


def served_run(port: int, name: str, jobs: list[Job], beams: int = 1) -> Run:
    results: list = []
    t0 = time.perf_counter() + 0.2
    threads = [threading.Thread(target=_stream_one, args=(port, name, i, j, t0, results, beams))
               for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort()
    first = min(sent for _, sent, _, _ in results)
    last = max(stamps[-1] for _, _, stamps, _ in results)
    ttft = tuple(stamps[0] - sent for _, sent, stamps, _ in results)
    itl = tuple(b - a for _, _, stamps, _ in results for a, b in zip(stamps, stamps[1:]))
    return Run(sum(len(ids) for *_, ids in results), last - first, ttft, itl,
               tuple(tuple(ids) for *_, ids in results))


# ------------------------------------------------------------------------------ main


def workloads(prompt: int, new: int, spread_s: float, system: int, seed: int = 0
              ) -> dict[str, list[Job]]:
    """1 stream (three prompts, one after another); 8 and 32 streams sent at once (prompts
    prompt/2..3*prompt/2); 32 arriving over `spread_s`; 32 sharing a `system`-token prefix
    (each its own 16-token question, 16 new tokens); genai's static batch of 8 (equal
    prompts); 32 of equal prompts asking for new/4..7*new/4 tokens (as many in all as the
    others), sent at once to the server and as static batches of 8 to genai; two prompts for
    the beam search. Every prompt is new for each `seed`: a server's prefix cache must not
    find an earlier alternation's (or the warm-up's) prompts, which genai could not."""
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.integers(3, VOCAB, int(n)).tolist())

    def jobs(n: int, spread: float) -> list[Job]:
        lengths = rng.integers(prompt // 2, prompt * 3 // 2 + 1, n)
        arrivals = np.sort(rng.uniform(0, spread, n)) if spread else np.zeros(n)
        return [Job(tokens(k), new, float(a)) for k, a in zip(lengths, arrivals)]

    shared = tokens(system)
    return {"1": [Job(tokens(prompt), new) for _ in range(3)], "8": jobs(8, 0.0),
            "32": jobs(32, 0.0), "32 over time": jobs(32, spread_s),
            "shared prefix": [Job(shared + tokens(16), 16, float(a))
                              for a in np.sort(rng.uniform(0, spread_s, 32))],
            "static8": [Job(tokens(prompt), new) for _ in range(8)],
            "varied": [Job(tokens(prompt), int(n))
                       for n in rng.integers(new // 4, new * 7 // 4 + 1, 32)],
            "beams": [Job(tokens(prompt), new) for _ in range(2)],
            "searches": [Job(tokens(prompt), new) for _ in range(SEARCHES)]}


def _load() -> float:
    return os.getloadavg()[0]


def peak_rss_mb(pid: int) -> float | None:
    """A running process's peak resident memory so far (VmHWM), MB; None where /proc has
    no such line."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def alternation(genai_dir: Path, servers: dict, w: dict) -> dict[str, tuple[Run, float, float]]:
    """Every workload once, genai and the server in turn: {label: (run, load before, after)}."""
    out: dict[str, tuple[Run, float, float]] = {}

    def timed(label: str, fn) -> None:
        before = _load()
        out[label] = (fn(), before, _load())

    port, name = servers["prefix"]
    timed("genai 1", lambda: genai_run(genai_dir, w["1"]))
    timed("serve 1", lambda: _pooled([served_run(port, name, [job]) for job in w["1"]]))
    timed("genai static8", lambda: genai_run(genai_dir, w["static8"], batch=8))
    timed("serve 8", lambda: served_run(port, name, w["8"]))
    timed("serve 32", lambda: served_run(port, name, w["32"]))
    timed("serve 32 over time", lambda: served_run(port, name, w["32 over time"]))
    timed("genai static8, varied lengths", lambda: genai_run(genai_dir, w["varied"], batch=8))
    timed("serve 32, varied lengths", lambda: served_run(port, name, w["varied"]))
    timed("serve shared, prefix cache", lambda: served_run(port, name, w["shared prefix"]))
    cold_port, cold_name = servers["no prefix"]
    timed("serve shared, no prefix cache",
          lambda: served_run(cold_port, cold_name, w["shared prefix"]))
    plain_port, plain_name = servers["no speculation"]  # tuner serve --speculate 0
    timed("serve 1, no speculation", lambda: _pooled([served_run(plain_port, plain_name, [job])
                                                      for job in w["1"]]))
    timed(f"genai 1, {BEAMS} beams", lambda: genai_run(genai_dir, w["beams"], beams=BEAMS))
    timed(f"serve 1, {BEAMS} beams", lambda: _pooled([served_run(port, name, [job], BEAMS)
                                                      for job in w["beams"]]))
    timed(f"genai batch {SEARCHES}, {BEAMS} beams",
          lambda: genai_run(genai_dir, w["searches"], batch=SEARCHES, beams=BEAMS))
    timed(f"serve {SEARCHES} at once, {BEAMS} beams",
          lambda: served_run(port, name, w["searches"], BEAMS))
    return out


def ratios(a: dict[str, tuple[Run, float, float]]) -> dict[str, float]:
    """The goals' ratios of one alternation (each >= its goal when met)."""
    r = {k: v[0] for k, v in a.items()}
    shared = r["serve shared, prefix cache"], r["serve shared, no prefix cache"]
    spread = r["serve 32 over time"]
    plain = r["serve 1, no speculation"]
    return {
        "1 stream / genai (goal >= 1.0)": r["serve 1"].tokens_per_s / r["genai 1"].tokens_per_s,
        "1 stream without prompt lookup / genai": plain.tokens_per_s / r["genai 1"].tokens_per_s,
        "1 stream with prompt lookup / without": r["serve 1"].tokens_per_s / plain.tokens_per_s,
        "1 stream: outputs identical with and without (1 = yes)":
            float(plain.ids == r["serve 1"].ids),
        "8 streams / genai static 8 (goal >= 1.3)":
            r["serve 8"].tokens_per_s / r["genai static8"].tokens_per_s,
        "32 streams / genai static 8 (goal >= 1.5)":
            r["serve 32"].tokens_per_s / r["genai static8"].tokens_per_s,
        "32 varied lengths / genai static 8 on them (no goal)":
            r["serve 32, varied lengths"].tokens_per_s
            / r["genai static8, varied lengths"].tokens_per_s,
        "32 over 1 s: 2 x ITL p50 / p99 (goal >= 1)": 2 * spread.itl_ms(50) / spread.itl_ms(99),
        "32 over 1 s: genai static 8 TTFT / TTFT p50 (goal > 1)":
            float(np.median(r["genai static8"].ttft_s)) / float(np.median(spread.ttft_s)),
        "shared prefix: TTFT p50 without / with prefix cache (goal >= 3)":
            float(np.median(shared[1].ttft_s)) / float(np.median(shared[0].ttft_s)),
        "shared prefix: outputs identical (1 = yes)": float(shared[0].ids == shared[1].ids),
        f"1 stream, {BEAMS} beams / genai {BEAMS} beams (no goal)":
            r[f"serve 1, {BEAMS} beams"].tokens_per_s / r[f"genai 1, {BEAMS} beams"].tokens_per_s,
        f"{BEAMS} beams: outputs identical to genai's (1 = yes)":
            float(r[f"serve 1, {BEAMS} beams"].ids == r[f"genai 1, {BEAMS} beams"].ids),
        f"{SEARCHES} searches at once / genai's batch of {SEARCHES} (no goal)":
            r[f"serve {SEARCHES} at once, {BEAMS} beams"].tokens_per_s
            / r[f"genai batch {SEARCHES}, {BEAMS} beams"].tokens_per_s,
        f"{SEARCHES} searches: outputs identical to genai's (1 = yes)":
            float(r[f"serve {SEARCHES} at once, {BEAMS} beams"].ids
                  == r[f"genai batch {SEARCHES}, {BEAMS} beams"].ids),
    }


def median_range(values) -> tuple[float, float, float]:
    v = np.asarray(list(values), dtype=float)
    return float(np.median(v)), float(v.min()), float(v.max())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a small Llama, for a quick run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--system", type=int, default=512, help="the shared prefix's tokens")
    ap.add_argument("--spread-s", type=float, default=1.0, help="arrivals spread over this")
    ap.add_argument("--repeats", type=int, default=3, help="whole alternations")
    ap.add_argument("--quick-optimize", action="store_true", help="fewer timing rounds")
    ap.add_argument("--prefill-tokens", type=int, default=256,
                    help="the server's per-step token budget (tuner serve --prefill-tokens)")
    ap.add_argument("--max-stall", type=float, default=0.0,
                    help="the server's bound on prompt work beside decoding rows "
                         "(tuner serve --max-stall; 0, the default of both: none)")
    ap.add_argument("--sources", nargs="+", choices=("genai", "torch"),
                    default=["genai", "torch"],
                    help="what `tuner optimize` is given: the builder's graph, the torch export")
    ap.add_argument("--work", type=Path, default=ROOT / ".cache" / "bench-generate-v2")
    a = ap.parse_args(argv)
    shape = "small" if a.small else "full"
    work = a.work / shape
    hf, genai_dir = work / "hf", work / "genai"
    print(f"preparing {shape} Llama under {work} ...", flush=True)
    prepare_hf(hf, SMALL if a.small else FULL)
    prepare_genai(hf, genai_dir, a.threads)
    for source in a.sources:
        graph = genai_dir / "model.onnx" if source == "genai" else torch_export(hf, work / "export")
        artifact = prepare_artifact(graph, work / f"artifact-{source}", a.threads,
                                    a.quick_optimize)
        bench_source(a, shape, source, genai_dir, artifact)
    return 0


def bench_source(a, shape: str, source: str, genai_dir: Path, artifact: Path) -> None:
    """The alternations against one artifact, and their table."""
    from tuner.artifact.store import read_manifest

    served = read_manifest(artifact).selected
    warm = workloads(a.prompt, a.new, a.spread_s, a.system, seed=1000)

    # The servers start first and idle (no CPU) while genai runs; the two alternate,
    # workload by workload, so that a change in the shared machine's load hits both.
    procs, servers = [], {}
    try:
        budget = ("--prefill-tokens", str(a.prefill_tokens), "--max-stall", str(a.max_stall))
        for label, extra in (("prefix", ()), ("no prefix", ("--no-prefix-cache",)),
                             ("no speculation", ("--speculate", "0"))):
            proc, port = start_server(artifact, a.threads, *budget, *extra)
            procs.append(proc)
            servers[label] = (port, artifact_name(artifact))
        genai_run(genai_dir, warm["1"][:1])  # warm-ups (prompts of their own): each genai run
        for server in servers.values():  # also warms up in its process; a server has seen
            served_run(*server, warm["32"])  # every batch size once (ORT's arena, first gathers)
        runs = []
        for i in range(a.repeats):
            print(f"{source}: alternation {i + 1} of {a.repeats} ...", flush=True)
            w = workloads(a.prompt, a.new, a.spread_s, a.system, seed=i)
            runs.append(alternation(genai_dir, servers, w))
            for label, value in ratios(runs[-1]).items():  # as it goes: a cut run keeps these
                print(f"  {label:64s} {value:5.2f}x", flush=True)
        peaks = {label: peak_rss_mb(proc.pid) for label, proc in zip(servers, procs)}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(60)
    print_table(shape, a, f"{source} graph, variant {served}", runs)
    print_memory(runs, peaks)


def _pooled(runs: list[Run]) -> Run:
    """Several runs of one stream as one: tokens and times add, latencies pool."""
    return Run(sum(r.tokens for r in runs), sum(r.wall_s for r in runs),
               tuple(x for r in runs for x in r.ttft_s), tuple(x for r in runs for x in r.itl_s),
               tuple(i for r in runs for i in r.ids))


def print_table(shape: str, a, served: str, runs: list[dict]) -> None:
    dims = SMALL if a.small else FULL
    print(f"\nLlama {shape} ({dims['num_hidden_layers']} layers, h {dims['hidden_size']}, "
          f"{dims['num_attention_heads']} heads, {dims['num_key_value_heads']} kv heads, FFN "
          f"{dims['intermediate_size']}, vocab {VOCAB}), greedy, {a.new} new tokens, "
          f"{a.threads} threads, prompts {a.prompt} (1 stream) or {a.prompt // 2}.."
          f"{a.prompt * 3 // 2}; served: {served} (what `tuner optimize` selected), "
          f"--prefill-tokens {a.prefill_tokens} --max-stall {a.max_stall} --spin; "
          f"median of {len(runs)} alternations [min..max]; {os.cpu_count()} cores, shared")
    head = (f"{'workload':34s} {'tokens/s':>22s} {'TTFT p50 ms':>12s} {'ITL p50':>8s} "
            f"{'ITL p99':>8s} {'load before..after':>19s}")
    print(head)
    print("-" * len(head))
    for label in runs[0]:
        rs = [r[label][0] for r in runs]
        tps = median_range(x.tokens_per_s for x in rs)
        loads = [x for r in runs for x in r[label][1:]]
        print(f"{label:34s} {tps[0]:7.1f} [{tps[1]:6.1f}..{tps[2]:6.1f}] "
              f"{np.median([np.median(x.ttft_s) for x in rs]) * 1e3:12.1f} "
              f"{np.median([x.itl_ms(50) for x in rs]):8.1f} "
              f"{np.median([x.itl_ms(99) for x in rs]):8.1f} "
              f"{min(loads):8.2f}..{max(loads):.2f}")
    print()
    for label in ratios(runs[0]):
        m, lo, hi = median_range(ratios(r)[label] for r in runs)
        print(f"{label:64s} {m:5.2f}x [{lo:.2f}..{hi:.2f}]")


def print_memory(runs: list[dict], servers: dict[str, float | None]) -> None:
    """Peak resident memory: each genai run's process (the model loaded, then that workload;
    median over the alternations), and each server's over all its workloads, warm-up
    included (32 streams at once, the shared prompt's cache)."""
    print("\npeak RSS, MB")
    for label in runs[0]:
        peaks = [r[label][0].peak_mb for r in runs]
        if label.startswith("genai") and all(p is not None for p in peaks):
            print(f"  {label:40s} {np.median(peaks):8.0f}  (its own process, this workload)")
    for label, peak in servers.items():
        shown = f"{peak:8.0f}" if peak is not None else "       ?"
        print(f"  {'tuner serve (' + label + ')':40s} {shown}  (every workload it served)")


if __name__ == "__main__":
    sys.exit(_genai_side() if sys.argv[1:] == ["--genai-side"] else main())
