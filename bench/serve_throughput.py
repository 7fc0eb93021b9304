"""Throughput with 32 concurrent clients: `tuner serve` with its defaults (on a CPU, two
runs at a time when requests overlap, each on one thread: serving.overlap), with batching on
top of that, and one run at a time with dynamic batching on and off, against MLServer 1.7
serving the same ONNX model through a minimal onnxruntime runtime
(bench/mlserver_ort_runtime.py), over gRPC and over REST. Goal: at least 1.5x MLServer on
each protocol.

    .venv/bin/python bench/serve_throughput.py [--model minilm] [--seconds 10] [--rounds 3]
        [--protocol grpc|rest|both] [--mlserver /tmp/mlserver-venv/bin/mlserver] [--quick]

`tuner serve` serves what `tuner optimize` writes for the model (made first, ~30 s for
MiniLM), so "defaults" is what a user of both gets. The line before the table says what the
artifact's batch timings alone would decide (a server that overlaps requests does not batch
them unless told to: serving.engine).

REST rows send the same JSON body to both servers (KServe v2 JSON tensors, what MLServer
reads) and read the whole JSON answer; "binary" rows send Triton's binary-data extension
(what tritonclient.http sends by default), which MLServer does not speak.

Every server runs in its own process; the client (this process) drives each with 32
concurrent gRPC calls (grpc.aio, KServe v2 ModelInfer, raw tensors, batch 1 each) for a
fixed time. Request lengths are log-uniform in [8, 128] tokens (many short requests, a long
tail). Measurement windows are interleaved across servers in rounds (A B C D, B C D A, ...)
so that load from other work on the machine hits them alike; the table gives the median
requests/s over rounds with min-max, the ratio to MLServer per round (median [min-max]),
latency percentiles, and errors.

MLServer runs from its own venv (install: python3 -m venv /tmp/mlserver-venv &&
/tmp/mlserver-venv/bin/pip install "mlserver==1.7.*" onnxruntime "uvloop<0.22"; MLServer 1.7
starts no inference worker with uvloop 0.22 or newer); without it those rows
are skipped with a line that says so. Its adaptive batching is measured too: it stacks
requests along the batch axis, which fails for requests of different lengths (the errors
column shows how often).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from serve_common import (MODEL_NAME, ROOT, encoded, feeds, free_port, lengths, load_note,
                          optimized_artifact, rest_body, start_tuner, stop, wait_ready)

from serving.wire._generated import inference_pb2 as pb
from serving.wire._generated import inference_pb2_grpc as pb_grpc

MODELS = {"bert": ("bert", "small", 1000), "minilm": ("minilm", "real", 30522)}
CONCURRENCY = 32


@dataclass
class Window:
    seconds: float = 0.0
    ok: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    first_error: str = ""


async def _drive_rest(port: int, bodies: list[tuple[bytes, dict]], seconds: float) -> Window:
    import aiohttp

    window = Window()
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL_NAME}/infer"
    connector = aiohttp.TCPConnector(limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        stop_at = start + seconds

        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() < stop_at:
                body, headers = bodies[i % len(bodies)]
                t0 = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as r:
                    answer = await r.read()
                if r.status == 200:
                    window.ok += 1
                    window.latencies_ms.append((time.perf_counter() - t0) * 1e3)
                else:
                    window.errors += 1
                    window.first_error = window.first_error or f"{r.status}: {answer[:150]!r}"
                i += CONCURRENCY

        await asyncio.gather(*(worker(k) for k in range(CONCURRENCY)))
        window.seconds = time.perf_counter() - start
    return window


async def _drive(port: int, requests: list[pb.ModelInferRequest], seconds: float) -> Window:
    window = Window()
    opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        start = time.perf_counter()
        stop_at = start + seconds

        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() < stop_at:
                t0 = time.perf_counter()
                try:
                    await stub.ModelInfer(requests[i % len(requests)], timeout=60)
                    window.ok += 1
                    window.latencies_ms.append((time.perf_counter() - t0) * 1e3)
                except grpc.aio.AioRpcError as e:
                    window.errors += 1
                    if not window.first_error:
                        window.first_error = f"{e.code().name}: {e.details()}"[:160]
                i += CONCURRENCY

        await asyncio.gather(*(worker(k) for k in range(CONCURRENCY)))
        window.seconds = time.perf_counter() - start
    return window


def _start_mlserver(binary: str, model: Path, tmp: Path, batching: bool,
                    workers: int = 1) -> tuple:
    """MLServer with its defaults, or `workers` parallel inference processes (its
    `parallel_workers`) of one intra-op thread each."""
    d = tmp / (f"mlserver-{int(batching)}-{workers}")
    (d / MODEL_NAME).mkdir(parents=True)
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    server = {"debug": False, "grpc_port": grpc_port, "http_port": http_port,
              "metrics_port": metrics_port, "load_models_at_startup": True}
    parameters = {"uri": str(model)}
    if workers > 1:
        server["parallel_workers"] = workers
        parameters["extra"] = {"intra_op_threads": 1}
    (d / "settings.json").write_text(json.dumps(server))
    settings = {"name": MODEL_NAME, "implementation": "mlserver_ort_runtime.OrtRuntime",
                "parameters": parameters}
    if batching:
        settings.update(max_batch_size=CONCURRENCY, max_batch_time=0.002)
    (d / MODEL_NAME / "model-settings.json").write_text(json.dumps(settings))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench")}
    proc = subprocess.Popen([binary, "start", str(d)], env=env, cwd=d,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_ready(grpc_port, proc, timeout=180)
    return proc, grpc_port, http_port


def main() -> int:
    from models.build import cached

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="minilm", choices=sorted(MODELS))
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mlserver", default="/tmp/mlserver-venv/bin/mlserver")
    ap.add_argument("--protocol", default="grpc", choices=("grpc", "rest", "both"))
    ap.add_argument("--servers", default="tuner serve, defaults;tuner serve, batching on;"
                                          "tuner serve, batching off",
                    type=lambda v: v.split(";"),
                    help="which tuner rows, ';'-separated (also: 'tuner serve, overlap + "
                         "batching', 'tuner serve, 2 workers x 1 thread')")
    ap.add_argument("--quick", action="store_true",
                    help="tuner optimize with the fewest timing rounds (smoke runs)")
    ap.add_argument("--no-adaptive", action="store_true",
                    help="leave out MLServer's adaptive batching row")
    args = ap.parse_args()
    family, shape, vocab = MODELS[args.model]
    model = cached(family, shape, "torchscript")
    rng = np.random.default_rng(0)
    sizes = lengths(512, 8, 128)
    requests = [encoded(n, vocab, rng) for n in sizes]
    rng = np.random.default_rng(0)
    raw = [feeds(n, vocab, rng) for n in sizes]
    workloads = {"grpc": requests, "rest": [rest_body(f) for f in raw],
                 "binary": [rest_body(f, binary=True) for f in raw]}
    grpc_on, rest_on = args.protocol in ("grpc", "both"), args.protocol in ("rest", "both")
    print(load_note())
    print(f"model {family}-{shape} ({model.name}), {CONCURRENCY} concurrent clients, batch 1 "
          f"per request, lengths log-uniform in [8, 128], {args.rounds} rounds x "
          f"{args.seconds:g} s per server")
    servers: dict[str, tuple] = {}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        out = optimized_artifact(tmp / "art", model, quick=args.quick)
        print(f"tuner optimize's artifact: {_batch_note(out)}")
        try:
            procs = []
            for label, extra in (("tuner serve, defaults", ()),
                                 # the defaults, and queued requests joined into batches
                                 ("tuner serve, overlap + batching", ("--max-batch", "32")),
                                 # one model run at a time, batched or not
                                 ("tuner serve, batching on", ("--max-batch", "32",
                                                               "--workers", "1")),
                                 ("tuner serve, batching off", ("--max-batch", "1",
                                                                "--workers", "1")),
                                 # two model runs at a time, one intra-op thread each
                                 ("tuner serve, 2 workers x 1 thread",
                                  ("--max-batch", "1", "--workers", "2", "--threads", "1"))):
                if label not in args.servers:
                    continue
                port, http_port = free_port(), free_port()
                procs.append(start_tuner(out, port, *extra, http_port=http_port))
                if grpc_on:
                    servers[label] = ("grpc", port)
                if rest_on:
                    servers[label.replace("tuner serve", "tuner serve REST")] = ("rest", http_port)
                    if label == "tuner serve, defaults":
                        servers["tuner serve REST binary, defaults"] = ("binary", http_port)
            if shutil.which(args.mlserver) or Path(args.mlserver).exists():
                kinds = [(False, 1)] + ([] if args.no_adaptive else [(True, 1)])
                if "tuner serve, 2 workers x 1 thread" in args.servers:
                    kinds.append((False, 2))
                for batching, workers in kinds:
                    label = "MLServer 1.7" + (", adaptive batching" if batching else "") + (
                        ", 2 workers x 1 thread" if workers > 1 else "")
                    proc, port, http_port = _start_mlserver(args.mlserver, model, tmp, batching,
                                                            workers)
                    procs.append(proc)
                    if grpc_on:
                        servers[label] = ("grpc", port)
                    if rest_on:
                        servers[label.replace("MLServer 1.7", "MLServer 1.7 REST")] = (
                            "rest", http_port)
            else:
                print(f"skipped MLServer: {args.mlserver} not found (see this script's "
                      "docstring to install it)")
            results = _measure(servers, workloads, args.seconds, args.rounds)
        finally:
            for proc in procs:
                stop(proc)
    _print(results)
    print(load_note())
    return 0


def _batch_note(artifact: Path) -> str:
    """What `tuner serve` decides from the artifact's timings: how many rows it joins."""
    from serving.engine import batch_limit
    from tuner.artifact.store import read_manifest

    manifest = read_manifest(artifact)
    return batch_limit(manifest.variant(manifest.selected).latency, manifest.buckets.batch)[1]


def _window(server: tuple, workloads: dict, seconds: float) -> Window:
    kind, port = server
    if kind == "grpc":
        return asyncio.run(_drive(port, workloads["grpc"], seconds))
    return asyncio.run(_drive_rest(port, workloads[kind], seconds))


def _measure(servers: dict, workloads: dict, seconds: float, rounds: int) -> dict:
    labels = list(servers)
    for label in labels:  # warm-up: sessions, thread pools, connections
        _window(servers[label], workloads, 1.0)
    results: dict[str, list[Window]] = {label: [] for label in labels}
    for r in range(rounds):
        for j in range(len(labels)):
            label = labels[(r + j) % len(labels)]
            w = _window(servers[label], workloads, seconds)
            results[label].append(w)
            print(f"  round {r + 1} {label}: {w.ok / w.seconds:.1f} req/s, {w.errors} errors",
                  flush=True)
    return results


def _print(results: dict) -> None:
    print(f"\n{'server':38s} {'req/s':>8s} {'min-max':>15s} {'vs MLServer':>20s} "
          f"{'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} {'errors':>8s}")
    for label, windows in results.items():
        # the baseline: MLServer on the same protocol (REST rows against MLServer's REST)
        base = "MLServer 1.7 REST" if "REST" in label else "MLServer 1.7"
        base_rps = [w.ok / w.seconds for w in results[base]] if base in results else None
        rps = [w.ok / w.seconds for w in windows]
        # per round (the same minutes of machine load): this server / MLServer
        paired = [a / b for a, b in zip(rps, base_rps)] if base_rps else []
        lat = np.concatenate([w.latencies_ms for w in windows]) if any(
            w.latencies_ms for w in windows) else np.array([np.nan])
        total = sum(w.ok + w.errors for w in windows)
        errors = sum(w.errors for w in windows)
        ratio = (f"{np.median(paired):.2f}x [{min(paired):.2f}-{max(paired):.2f}]"
                 if paired else "-")
        p50, p90, p99 = np.percentile(lat, [50, 90, 99])
        print(f"{label:38s} {np.median(rps):8.1f} {min(rps):7.1f}-{max(rps):<7.1f} {ratio:>20s} "
              f"{p50:8.1f} {p90:8.1f} {p99:8.1f} {errors / max(total, 1):8.1%}")
        first = next((w.first_error for w in windows if w.first_error), "")
        if first:
            print(f"{'':38s} first error: {first}")


if __name__ == "__main__":
    raise SystemExit(main())
