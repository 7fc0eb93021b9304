"""What Triton's system shared memory saves a client on the same host: one request through
`tuner serve` (gRPC, the server in its own process) with its tensors in the messages,
against the same request with its inputs and its output in shared memory regions registered
once (tritonclient.utils.shared_memory, as Triton's own shm examples use it).

    .venv/bin/python bench/serve_shared_memory.py [--model minilm] [--shapes 1x128,8x128]
                                                  [--rounds 200] [--repeats 3]

Both paths use tritonclient.grpc, so the difference is where the bytes travel: the message
(the client serializes the inputs, the server the output of rows x seq x hidden floats,
and both copy them through the loopback) or the regions (the server reads and writes them
with pread/pwrite; the client reads its output region). The two calls alternate in a fresh
random order every round; "speedup" is the median of the per-round ratios message / shm
with its bootstrap 95% interval. The whole alternation is repeated `--repeats` times, each
reported apart with the load average before and after it. The first call of each path is
checked for equality of the two outputs (max abs), so a path that answered something else
would show.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from serve_common import (MODEL_NAME, feeds, free_port, make_artifact,  # noqa: E402
                          start_tuner, stop)

from tuner.measure.stats import paired_ratio_ci, summarize  # noqa: E402

MODELS = {"bert": ("bert", "small", 1000, 64), "minilm": ("minilm", "real", 30522, 384)}
OUTPUT = "last_hidden_state"


class Paths:
    """The two ways to send one request of `shape`, on one tritonclient.grpc client."""

    def __init__(self, client, tensors: dict[str, np.ndarray], hidden: int) -> None:
        import tritonclient.grpc as tg
        import tritonclient.utils.shared_memory as shm

        self.client, self.shm, self.tensors = client, shm, tensors
        rows, length = tensors["input_ids"].shape
        self.out_bytes = rows * length * hidden * 4  # float32
        tag = uuid.uuid4().hex[:10]
        in_bytes = sum(a.nbytes for a in tensors.values())
        self.handles = [shm.create_shared_memory_region(f"in{tag}", f"/in{tag}", in_bytes),
                        shm.create_shared_memory_region(f"out{tag}", f"/out{tag}",
                                                        self.out_bytes)]
        shm.set_shared_memory_region(self.handles[0], list(tensors.values()))
        client.register_system_shared_memory(f"in{tag}", f"/in{tag}", in_bytes)
        client.register_system_shared_memory(f"out{tag}", f"/out{tag}", self.out_bytes)
        self.in_message, self.in_shared, offset = [], [], 0
        for name, array in tensors.items():
            self.in_message.append(tg.InferInput(name, list(array.shape), "INT64"))
            self.in_message[-1].set_data_from_numpy(array)
            self.in_shared.append(tg.InferInput(name, list(array.shape), "INT64")
                                  .set_shared_memory(f"in{tag}", array.nbytes, offset))
            offset += array.nbytes
        self.out_message = [tg.InferRequestedOutput(OUTPUT)]
        self.out_shared = [tg.InferRequestedOutput(OUTPUT)]
        self.out_shared[0].set_shared_memory(f"out{tag}", self.out_bytes)
        self.shape = (rows, length, hidden)

    def message(self) -> np.ndarray:
        result = self.client.infer(MODEL_NAME, self.in_message, outputs=self.out_message)
        return result.as_numpy(OUTPUT)

    def shared(self) -> np.ndarray:
        self.client.infer(MODEL_NAME, self.in_shared, outputs=self.out_shared)
        return self.shm.get_contents_as_numpy(self.handles[1], np.float32, self.shape)

    def close(self) -> None:
        self.client.unregister_system_shared_memory()
        for handle in self.handles:
            self.shm.destroy_shared_memory_region(handle)


def _timed(call) -> tuple[float, np.ndarray]:
    began = time.perf_counter()
    out = call()
    return (time.perf_counter() - began) * 1e3, out


def alternate(paths: Paths, rounds: int, seed: int) -> dict:
    """Both paths `rounds` times in a fresh random order each round (a warm-up first)."""
    _, want = _timed(paths.message)
    _, got = _timed(paths.shared)
    rng, times = random.Random(seed), {"message": [], "shared": []}
    for _ in range(rounds):
        order = ["message", "shared"]
        rng.shuffle(order)
        for name in order:
            times[name].append(_timed(getattr(paths, name))[0])
    return {"times": times, "max_abs": float(np.max(np.abs(np.asarray(want) - got)))}


def _line(label: str, ms: list[float]) -> str:
    s = summarize(ms)
    return f"  {label:<28} {s.median:8.3f} ms  [IQR {s.q1:.3f}-{s.q3:.3f}]"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="minilm", choices=sorted(MODELS))
    ap.add_argument("--shapes", default="1x128,8x128", help="rows x seq, comma-separated")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3, help="whole alternations, each apart")
    args = ap.parse_args(argv)
    import tritonclient.grpc as tg

    from models.build import cached

    family, size, vocab, hidden = MODELS[args.model]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-shm-") as tmp:
        out = make_artifact(Path(tmp) / "art", cached(family, size, "torchscript"),
                            batch=(1, 8), seq=(16, 128))
        port = free_port()
        proc = start_tuner(out, port)
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            for rows, length in shapes:
                tensors = feeds(length, vocab, np.random.default_rng(rows * 1000 + length), rows)
                paths = Paths(client, tensors, hidden)
                print(f"{args.model}, {rows}x{length} (output {paths.out_bytes / 1e3:.0f} kB), "
                      f"{args.rounds} rounds per run:")
                try:
                    for run in range(args.repeats):
                        before = os.getloadavg()[0]
                        got = alternate(paths, args.rounds, seed=run)
                        t = got["times"]
                        ci = paired_ratio_ci(t["message"], t["shared"])
                        print(f" run {run + 1} (load average {before:.2f} -> "
                              f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores)")
                        print(_line("tensors in the messages", t["message"]))
                        print(_line("tensors in shared memory", t["shared"]))
                        print(f"  speedup (message / shm)      {ci.ratio:.3f}x "
                              f"[{ci.low:.3f}, {ci.high:.3f}]  outputs max abs "
                              f"{got['max_abs']:.1e}")
                finally:
                    paths.close()
        finally:
            client.close()
            stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
