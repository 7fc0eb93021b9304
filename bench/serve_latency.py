"""Latency the server adds at batch 1: the same request through `tuner serve` (gRPC over
loopback, server in its own process) against the same ONNX Runtime session settings called
in-process. Goal: at most 1 ms added at the median.

    .venv/bin/python bench/serve_latency.py [--rounds 400] [--models bert,minilm] [--seq 16,64]
                                            [--intra-op N] [--spin] [--server-args "..."]

The artifact records the ONNX Runtime session settings (--intra-op, --spin), so the server
and the in-process baseline run sessions built from the very same SessionSettings.
"--server-args" passes extra `tuner serve` options (e.g. "--threads 8") to compare them.

Calls are interleaved (direct, raw gRPC stub, tritonclient; rotating which goes first) so
that drift in the machine's load hits all three alike. Lengths are bucket sizes, so the
server pads nothing: the difference is the server. "added" is the median of the paired
per-round differences (server - direct), with the 25-75% range of those differences.
"server's ORT call" is the mean time the server itself spent in the model run (from the
ModelStatistics RPC), beside the mean of the in-process call: how much of the gap is the
model running slower inside the server rather than gRPC and Python around it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from serve_common import MODEL_NAME, encoded, free_port, load_note, make_artifact, \
    start_tuner, stop
from serving import protocol
from serving._generated import inference_pb2 as pb
from serving._generated import inference_pb2_grpc as pb_grpc
from tuner.bench import interleave, summarize
from tuner.runtime.base import SessionSettings
from tuner.runtime.registry import get_backend

MODELS = {"bert": ("bert", "small", 1000), "minilm": ("minilm", "real", 30522),
          "gpt2": ("gpt2", "small", 50257)}


def _row(label: str, ms: np.ndarray) -> str:
    s = summarize(ms)
    return (f"  {label:28s} {s.median:8.3f} {s.q1:8.3f} {s.q3:8.3f} {s.p10:8.3f} {s.p90:8.3f}")


def _compute_ns(stub) -> tuple[int, int]:
    """(count, ns) of the server's model runs so far (ModelStatistics' compute_infer)."""
    stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=MODEL_NAME), timeout=10)
    c = stats.model_stats[0].inference_stats.compute_infer
    return c.count, c.ns


def bench_model(key: str, seqs: list[int], rounds: int, settings: SessionSettings,
                server_args: list[str]) -> list[str]:
    import tritonclient.grpc as tg
    from models.build import cached

    family, shape, vocab = MODELS[key]
    model = cached(family, shape, "torchscript")
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        out = make_artifact(Path(tmp) / "art", model, seq=tuple(sorted(set(seqs) | {128})),
                            settings=settings)
        port = free_port()
        proc = start_tuner(out, port, *server_args)
        try:
            direct_runner = get_backend("ort-cpu").load(model, settings)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                            options=[("grpc.max_receive_message_length", -1)])
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            client = tg.InferenceServerClient(f"127.0.0.1:{port}")
            rng = np.random.default_rng(0)
            for seq in seqs:
                request = encoded(seq, vocab, rng)
                feeds = protocol.decode_inputs(request)
                inputs = []
                for name, a in feeds.items():
                    i = tg.InferInput(name, list(a.shape), "INT64")
                    i.set_data_from_numpy(a)
                    inputs.append(i)

                def direct():
                    direct_runner.infer(feeds)

                def raw():
                    protocol.decode_outputs(stub.ModelInfer(request, timeout=30))

                def triton():
                    client.infer(MODEL_NAME, inputs).as_numpy(next(iter(
                        direct_runner.output_names)))

                before = _compute_ns(stub)
                ms = interleave([direct, raw, triton], rounds=rounds, warmup=20)
                after = _compute_ns(stub)
                served_ms = (after[1] - before[1]) / 1e6 / max(1, after[0] - before[0])
                diff_raw, diff_tc = ms[1] - ms[0], ms[2] - ms[0]
                lines.append(f"{key} ({family}-{shape}), batch 1 x seq {seq}, {rounds} rounds, "
                             f"{settings}{' ' + ' '.join(server_args) if server_args else ''}")
                lines.append(f"  {'path':28s} {'median':>8s} {'q1':>8s} {'q3':>8s} "
                             f"{'p10':>8s} {'p90':>8s}   (ms)")
                lines.append(_row("ORT in-process", ms[0]))
                lines.append(_row("server, raw gRPC stub", ms[1]))
                lines.append(_row("server, tritonclient", ms[2]))
                for label, d, i in (("added, raw gRPC", diff_raw, 1),
                                    ("added, tritonclient", diff_tc, 2)):
                    q1, med, q3 = np.percentile(d, [25, 50, 75])
                    verdict = "meets" if med <= 1.0 else "MISSES"
                    ratio = np.median(ms[i]) / np.median(ms[0])
                    lines.append(f"  {label:28s} {med:8.3f} [{q1:.3f}, {q3:.3f}]  "
                                 f"ratio {ratio:.2f}x  -> {verdict} the 1 ms goal")
                lines.append(f"  {'server ORT call, mean':28s} {served_ms:8.3f}   in-process mean "
                             f"{ms[0].mean():.3f}  (+{served_ms - ms[0].mean():.3f})")
                lines.append("")
            client.close()
            channel.close()
        finally:
            stop(proc)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--models", default="bert,minilm")
    ap.add_argument("--seq", default="16,64")
    ap.add_argument("--intra-op", type=int, default=SessionSettings.intra_op_threads,
                    help="ORT intra-op threads, in the server and in-process (0: ORT's default)")
    ap.add_argument("--spin", action="store_true", help="let ORT's thread pools spin-wait")
    ap.add_argument("--server-args", default="", help="extra `tuner serve` options")
    args = ap.parse_args()
    settings = SessionSettings(intra_op_threads=args.intra_op, allow_spinning=args.spin)
    seqs = [int(s) for s in args.seq.split(",")]
    print(load_note())
    for key in args.models.split(","):
        print("\n".join(bench_model(key, seqs, args.rounds, settings,
                                     args.server_args.split())), flush=True)
    print(load_note())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
