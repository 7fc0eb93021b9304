"""Helpers for the serving tests: real artifacts from the cached reference exports, free
ports, in-process servers. Not a test module (no test_ prefix)."""

from __future__ import annotations

import hashlib
import queue
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from tuner.artifact.records import Accuracy, Buckets, Manifest, Variant
from tuner.artifact.store import write_manifest

BUCKETS = Buckets(batch=(1, 4, 8), seq=(8, 16, 32))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(out: Path, port: int, name: str, *args: str,
                  timeout_s: float = 90) -> subprocess.Popen:
    """`tuner serve OUT` as a real subprocess on `port`, returned once model `name` is ready
    (killed, with its stderr in the error, if it exits or is not ready within `timeout_s`)."""
    import tritonclient.grpc as tg
    from tritonclient.utils import InferenceServerException

    http = () if "--http-port" in args else ("--http-port", "-1")  # no fixed port 8000
    proc = subprocess.Popen([sys.executable, "-m", "tuner", "serve", str(out), "--port",
                             str(port), "--metrics-port", "-1", "--model-name", name, *http,
                             *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.is_model_ready(name):
                return proc
        except InferenceServerException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server did not get ready: {proc.communicate()[1]}")
        time.sleep(0.1)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _variant(name: str, rel: str) -> Variant:
    return Variant(name=name, path=rel, exact=True, transforms=(), shape={},
                   accuracy=Accuracy(passed=True, max_abs_error=0.0, max_rel_error=0.0))


def make_artifact(out: Path, model: Path, buckets: Buckets = BUCKETS,
                  variant: Path | None = None, variant_name: str = "padded",
                  settings: dict | None = None) -> Path:
    """OUT with the original (and optionally one more variant, selected) and manifest.json,
    written through tuner.artifact.records as `tuner optimize` does."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "variants" / "original").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model, out / "variants" / "original" / "model.onnx")
    variants = [_variant("original", "variants/original/model.onnx")]
    selected = "original"
    if variant is not None:
        if variant.resolve().is_relative_to(out.resolve()):  # written in place (with its data)
            rel = variant.resolve().relative_to(out.resolve()).as_posix()
        else:
            (out / "variants" / variant_name).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(variant, out / "variants" / variant_name / "model.onnx")
            rel = f"variants/{variant_name}/model.onnx"
        variants.append(_variant(variant_name, rel))
        selected = variant_name
    manifest = Manifest(source_path=str(model), source_sha256=_sha(model),
                        device={"name": "cpu", "kind": "cpu"},
                        backend="ort-cpu", settings=settings or {}, selected=selected,
                        buckets=buckets,
                        variants=tuple(variants))
    write_manifest(out, manifest)
    return out


def perturbed_copy(model: Path, dst: Path) -> Path:
    """A copy of `model` whose last 1-D float (or half) initializer (a bias or a norm weight)
    gets noise of std 0.5: a real graph that is NOT exact, for the server's own gate to catch.
    (Not one constant shift: a LayerNorm right after a bias takes a constant shift out again.)"""
    proto = onnx.load(str(model))
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)  # fp16: a half-precision build
    for init in reversed(proto.graph.initializer):
        if init.data_type in floats and len(init.dims) == 1 and init.dims[0] > 1:
            noise = np.random.default_rng(0).standard_normal(init.dims[0]) * 0.5
            arr = onnx.numpy_helper.to_array(init)
            arr = arr + noise.astype(arr.dtype)
            init.CopyFrom(onnx.numpy_helper.from_array(arr, init.name))
            break
    else:
        raise AssertionError("no 1-D float initializer to perturb")
    onnx.save(proto, str(dst))
    return dst


def scaled_weight(src: Path, dst: Path, names: tuple[str, ...], factor: float = 1.5) -> Path:
    """A copy of `src` whose first MatMul named with one of `names` has its weight scaled:
    one projection changed, everything else the graph does untouched."""
    proto = onnx.load(str(src))
    node = next(n for n in proto.graph.node if n.op_type in ("MatMul", "Gemm")
                and any(k in n.name for k in names))
    init = next(i for i in proto.graph.initializer if i.name in node.input)
    arr = onnx.numpy_helper.to_array(init)
    init.CopyFrom(onnx.numpy_helper.from_array((arr * factor).astype(arr.dtype), init.name))
    onnx.save(proto, str(dst))
    return dst


def feeds_for(length: int, rows: int = 1, vocab: int = 1000, seed: int = 0,
              pad_right: int = 0) -> dict[str, np.ndarray]:
    """input_ids / attention_mask of `rows` x `length` (the last `pad_right` masked out)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(rows, length)).astype(np.int64)
    mask = np.ones((rows, length), dtype=np.int64)
    if pad_right:
        mask[:, length - pad_right:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def assert_close_where_valid(got: np.ndarray, want: np.ndarray, mask: np.ndarray,
                             atol: float = 1e-4, rtol: float = 1e-4, what: str = "") -> None:
    """Equal shapes, and equal values at every position the request's own attention mask
    keeps. Positions the client masked out itself are not compared: their values depend on
    what else is masked (a fully masked row attends uniformly to whatever is there), and
    no one may read them."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    keep = mask.astype(bool)  # (B, S): outputs are (B, S, ...)
    assert keep.any(), what
    np.testing.assert_allclose(got[keep], want[keep], atol=atol, rtol=rtol, err_msg=what)


def infer_inputs(feeds: dict[str, np.ndarray], datatype: str = "INT64") -> list:
    """tritonclient InferInputs for a feed dict."""
    import tritonclient.grpc as tg

    out = []
    for name, array in feeds.items():
        i = tg.InferInput(name, list(array.shape), datatype)
        i.set_data_from_numpy(array)
        out.append(i)
    return out


class Answers:
    """Collects tritonclient async_infer callbacks: `answers.callback(i)` for request i, then
    `answers.wait(n, timeout)` until n have come back (results or errors, by request index)."""

    def __init__(self) -> None:
        import threading

        self.results: dict[int, object] = {}
        self._done = threading.Semaphore(0)

    def callback(self, i: int):
        def on_result(result, error):
            self.results[i] = error if error is not None else result
            self._done.release()
        return on_result

    def wait(self, n: int, timeout: float) -> None:
        for _ in range(n):
            assert self._done.acquire(timeout=timeout), f"only {len(self.results)} of {n} answered"


class SlowRunner:
    """A runner that takes at least `seconds` per model run: decode steps slow enough for a
    test to act between them on a tiny model."""

    def __init__(self, runner, seconds: float) -> None:
        self.runner, self.seconds = runner, seconds

    def infer(self, feeds):
        time.sleep(self.seconds)
        return self.runner.infer(feeds)


def slowed(server, seconds: float):
    """Slow a decoder server's model runs down; (its generator, the runner to put back)."""
    generator = server.slot.engine.generator
    fast = generator.runner
    generator.runner = SlowRunner(fast, seconds)
    return generator, fast


def scraped_metrics(server) -> dict[tuple[str, tuple], float]:
    """/metrics as a Prometheus reader parses it (AIPerf and Grafana's agents use this parser):
    (sample name, its labels but the model's) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=10).read().decode()
    return {(x.name, tuple(sorted((k, v) for k, v in x.labels.items()
                                  if k not in ("model", "model_name", "version")))): x.value
            for family in text_string_to_metric_families(text) for x in family.samples}


def collect(gen, requests) -> list[list]:
    """Submit every request to `gen` (a serving.generation.Generator) at once (taken into
    one step); every stream's chunks, in the order of `requests`."""
    got = [queue.Queue() for _ in requests]
    gen.submit_all([(r, q.put) for q, r in zip(got, requests)])
    out = []
    for q in got:
        chunks = []
        while not chunks or not chunks[-1].final:
            chunks.append(q.get(timeout=120))
        out.append(chunks)
    return out


def quantize_dynamic_copy(src: Path, dst: Path, **extra_options) -> Path:
    """ONNX Runtime's quantize_dynamic (int8 weights) of `src` into `dst`, run on a private
    copy of `src`: the quantizer writes its shape-inferred `<name>-inferred.onnx` beside the
    model it reads and deletes it after, so two test workers quantizing one cached export
    race on that file."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    private = dst.parent / f".{dst.stem}-source"
    private.mkdir(parents=True)
    try:
        proto = onnx.load(str(src))  # (its external data, if any, read in)
        onnx.save(proto, str(private / src.name))
        quantize_dynamic(str(private / src.name), str(dst), weight_type=QuantType.QInt8,
                         extra_options=extra_options)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return dst


def seq2seq_tokens(folder: Path, n: int = 10) -> list[list[int]]:
    """An encoder-decoder folder's greedy tokens for two sources (ids of 5 and 11 tokens, or
    random features where its encoder reads audio), `n` each, through the server's loop."""
    from serving.generation import GenerateOptions
    from serving.generation.seq2seq import Seq2SeqGenerator
    from serving.sampling import GenerationRequest, Sampling
    from serving.seq2seq import load_seq2seq

    model = load_seq2seq(folder)
    features = model.record.encoder.features
    generator = Seq2SeqGenerator(model.runners, model.record, model.decoder, GenerateOptions(),
                                 max_target=model.max_target)
    rng = np.random.default_rng(0)
    try:
        out = []
        for length in (5, 11):
            source = rng.standard_normal(features).astype(np.float32) if features else None
            prompt = (model.decoder.start,) if features else tuple(rng.integers(4, 900, length))
            request = GenerationRequest(prompt=prompt, max_tokens=n, min_tokens=n,
                                        sampling=Sampling(), encoder_input=source)
            out.append([t for c in generator.generate(request) for t in c.ids])
        return out
    finally:
        generator.close()
