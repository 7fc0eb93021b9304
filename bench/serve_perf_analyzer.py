"""Triton's perf_analyzer driving `tuner serve`: shows that the server speaks enough of
Triton's protocol (ModelMetadata, ModelConfig, ModelStatistics, ModelInfer) for NVIDIA's own
load generator, and prints its report unchanged.

    .venv/bin/python bench/serve_perf_analyzer.py [--perf-analyzer /tmp/pa-venv/bin/perf_analyzer]
        [--model minilm] [--seq 32] [--concurrency 1:8:... e.g. 1:4:1]

perf_analyzer ships in the tritonclient==2.51.0 wheel; it needs Debian's libb64-0d and
libcudart.so.12 (pip's nvidia-cuda-runtime-cu12), even without a GPU. Setup:
    apt-get install libb64-0d
    python3 -m venv /tmp/pa-venv
    /tmp/pa-venv/bin/pip install "tritonclient[all]==2.51.0" nvidia-cuda-runtime-cu12
Skips with a message when the binary is absent. Inputs are real token ids (a JSON data
file), not perf_analyzer's random integers, which would fall outside the vocabulary and be
refused with INVALID_ARGUMENT.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from serve_common import MODEL_NAME, free_port, load_note, make_artifact, start_tuner, stop

MODELS = {"bert": ("bert", "small", 1000), "minilm": ("minilm", "real", 30522)}


def _cuda_runtime_dir(binary: Path) -> str | None:
    venv = binary.resolve().parent.parent
    hits = glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "nvidia" /
                         "cuda_runtime" / "lib"))
    return hits[0] if hits else None


def main() -> int:
    from models.build import cached

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--perf-analyzer", default="/tmp/pa-venv/bin/perf_analyzer")
    ap.add_argument("--model", default="minilm", choices=sorted(MODELS))
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--concurrency", default="1:8:7")
    ap.add_argument("--interval-ms", type=int, default=4000)
    ap.add_argument("--stability", type=int, default=50, help="perf_analyzer's "
                    "--stability-percentage")
    args = ap.parse_args()
    binary = Path(args.perf_analyzer)
    if not binary.exists():
        print(f"skipped: {binary} not found (see this script's docstring to install it)")
        return 0
    family, shape, vocab = MODELS[args.model]
    model = cached(family, shape, "torchscript")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = make_artifact(Path(tmp) / "art", model)
        data = Path(tmp) / "data.json"
        data.write_text(json.dumps({"data": [
            {"input_ids": {"content": rng.integers(1, vocab, args.seq).tolist(),
                           "shape": [args.seq]},
             "attention_mask": {"content": [1] * args.seq, "shape": [args.seq]}}
            for _ in range(16)]}))
        port = free_port()
        proc = start_tuner(out, port, "--max-batch", "32")
        env = dict(os.environ)
        cuda = _cuda_runtime_dir(binary)
        if cuda:
            env["LD_LIBRARY_PATH"] = cuda + os.pathsep + env.get("LD_LIBRARY_PATH", "")
        cmd = [str(binary), "-m", MODEL_NAME, "-u", f"127.0.0.1:{port}", "-i", "grpc",
               "--input-data", str(data), "--concurrency-range", args.concurrency,
               "--measurement-interval", str(args.interval_ms), "-b", "1",
               # a shared 2-core machine rarely holds perf_analyzer's default 10% stability
               "--stability-percentage", str(args.stability), "--max-trials", "20"]
        print(load_note())
        print("$ " + " ".join(cmd), flush=True)
        try:
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        finally:
            stop(proc)
        print(run.stdout)
        if run.stderr.strip():
            print(run.stderr)
        if run.returncode != 0:
            print(f"perf_analyzer exited with {run.returncode}")
        print(load_note())
        return run.returncode


if __name__ == "__main__":
    raise SystemExit(main())
