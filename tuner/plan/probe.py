"""The GEMM probe: time a model's real matrix multiplications on a backend.

The paper's own method (Anthony et al. 2024): a transformer's forward cost is dominated by a
handful of GEMMs whose shapes follow from (h, a, d, f, v) and M = batch x seq, so timing those
shapes alone ranks candidate dimensions in seconds, before any model is built.

    shapes = model_gemms(shape, batch=1, seq=128)          # QKV, scores, context, out, FFN, head
    for r in probe(shapes, backend="ort-cpu", rounds=7):
        print(r.shape.label, r.median_ms, r.tflops)

Backends:
- "ort-cpu": one tiny ONNX graph per shape (a single MatMul; the weight of a linear layer is
  an initializer, as in a real export, so ONNX Runtime prepacks it), timed with ORT through
  IO binding so no copy is timed.
- "torch-cuda": torch.matmul in fp16 on the GPU, timed with CUDA events; tile and wave counts
  against the SM count come with each result. torch is imported only here, and a machine
  without a GPU gets a BadInput that says so.

Timing is interleaved: every round times every shape once (in a random order), so a drift in
machine load hits all shapes alike; each result keeps its per-round samples, and round r of
every shape belongs together (tuner.design.measure sums them into whole-model samples).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.hardware.detect import detect
from tuner.hardware.facts import DEVICES, DeviceFacts, WaveCount
from tuner.measure.timing import interleave_timed, reps_for
from tuner.runtime.base import SessionSettings
from tuner.runtime.ort import load_cpu
from tuner.runtime.registry import get_backend
from tuner.util.progress import Progress

BACKENDS = ("ort-cpu", "torch-cuda")
IR_VERSION = 10  # onnxruntime >= 1.20 reads IR 10; newer onnx helpers would write 11+
OPSET = 17


@dataclass(frozen=True)
class GemmShape:
    """One (batch of) GEMM: (batch, m, k) @ (batch, k, n). `linear`: the right operand is a
    weight (an initializer on ORT, x @ W.T on torch); otherwise both operands are activations
    (attention's Q K^T and P V)."""

    m: int
    k: int
    n: int
    batch: int = 1
    label: str = ""
    linear: bool = True

    def __post_init__(self) -> None:
        for name in ("m", "k", "n", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GemmShape.{name} must be a positive integer, not {value!r}")
        if self.linear and self.batch != 1:
            raise ValueError("a linear (weight) GEMM has batch 1: fold the batch into m")

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    @property
    def key(self) -> tuple[int, int, int, int, bool]:
        """Shapes with the same key are the same kernel call: measured once."""
        return (self.batch, self.m, self.k, self.n, self.linear)

    def describe(self) -> str:
        b = f"{self.batch}x" if self.batch != 1 else ""
        return f"{b}{self.m}x{self.k}x{self.n}"


@dataclass(frozen=True)
class GemmResult:
    shape: GemmShape
    backend: str
    device: str
    samples_ms: tuple[float, ...]  # one per round, in round order
    waves: WaveCount | None = None  # tiles and waves on a GPU; None on a CPU

    def __post_init__(self) -> None:
        if not self.samples_ms or any(not (t > 0 and math.isfinite(t)) for t in self.samples_ms):
            raise ValueError(f"samples must be positive and finite, got {self.samples_ms!r}")

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def tflops(self) -> float:
        """Achieved TFLOP/s at the median time."""
        return self.shape.flops / (self.median_ms * 1e-3) / 1e12

    def to_json(self) -> dict[str, Any]:
        s = self.shape
        out = {"label": s.label, "batch": s.batch, "m": s.m, "k": s.k, "n": s.n,
               "linear": s.linear, "backend": self.backend, "device": self.device,
               "median_ms": self.median_ms, "tflops": self.tflops,
               "samples_ms": list(self.samples_ms)}
        if self.waves is not None:
            out.update(tiles=self.waves.tiles, waves=self.waves.waves,
                       wave_efficiency=self.waves.efficiency)
        return out


def model_gemms(shape: Any, batch: int, seq: int, lm_head: bool = True) -> list[GemmShape]:
    """The GEMMs of one decoder layer's forward pass (and the LM head) at (batch, seq).

    `shape` is anything with ModelShape's fields (hidden_size, num_heads, num_kv_heads,
    head_dim, ffn_size, ffn_gated, vocab_size): a tuner.graph.shape.ModelShape or a
    tuner.design.params.DesignShape. Labels: qkv, scores, context, out, up, gate, down,
    lm_head. QKV is one fused GEMM (GPT-NeoX, Megatron); gate and up stay two GEMMs of width f
    each, the shape whose alignment the SwiGLU measurements are about.
    """
    h, a, d = shape.hidden_size, shape.num_heads, shape.head_dim
    kv, f = shape.num_kv_heads, shape.ffn_size
    m = batch * seq
    gemms = [
        GemmShape(m, h, (a + 2 * kv) * d, label="qkv"),
        GemmShape(seq, d, seq, batch=batch * a, label="scores", linear=False),  # (b*a, s, d)@(d, s)
        GemmShape(seq, seq, d, batch=batch * a, label="context", linear=False),  # (b*a, s, s)@(s, d)
        GemmShape(m, a * d, h, label="out"),
    ]
    if f:
        gemms.append(GemmShape(m, h, f, label="up"))
        if shape.ffn_gated:
            gemms.append(GemmShape(m, h, f, label="gate"))
        gemms.append(GemmShape(m, f, h, label="down"))
    else:
        gemms += _expert_gemms(shape, m, h)
    if lm_head and shape.vocab_size:
        gemms.append(GemmShape(m, h, shape.vocab_size, label="lm_head"))
    return gemms


def _expert_gemms(shape: Any, m: int, h: int) -> list[GemmShape]:
    """A mixture of experts (FFN width 0: inspect reports experts, not one width; GPT-OSS,
    Qwen3-MoE), each expert's up and down over every token (the experts' rows folded into
    m): GPT-OSS computes them so, and routed experts, which run fewer tokens each, no more."""
    experts = getattr(getattr(shape, "sites", None), "experts", ()) or ()
    if not experts:
        return []
    e = experts[0]
    return [GemmShape(m * e.count, h, e.width, label="up"),
            GemmShape(m * e.count, e.width, h, label="down")]


def backend_unavailable(backend: str) -> str | None:
    """None when `backend` can run here, else the reason it cannot."""
    if backend == "ort-cpu":
        ok, reason = get_backend("ort-cpu").available()
        return None if ok else reason
    if backend == "torch-cuda":
        try:
            import torch
        except ImportError:
            return "torch is not installed (pip install 'shapetuner[probe]' with a CUDA build)"
        if not torch.cuda.is_available():
            return f"no CUDA GPU visible to torch {torch.__version__}"
        return None
    return f"unknown probe backend {backend!r}; choose one of: {', '.join(BACKENDS)}"


def gpu_facts() -> DeviceFacts:
    """The hardware facts of CUDA device 0, as tuner.hardware.detect reads them from the
    driver (a known part by its name, with the SM count it really has)."""
    info = detect()
    if info.kind != "gpu":
        raise BadInput("the CUDA driver reports no GPU (tuner.hardware.detect)")
    return info.facts()


def batched_waves(shape: GemmShape, dev: DeviceFacts | None) -> WaveCount | None:
    """Output tiles of all `batch` GEMMs together, in waves of one tile per SM."""
    if dev is None or dev.sm_count is None or dev.tile is None:
        return None
    tiles = shape.batch * math.ceil(shape.m / dev.tile[0]) * math.ceil(shape.n / dev.tile[1])
    full = math.ceil(tiles / dev.sm_count)
    return WaveCount(tiles, tiles / dev.sm_count, tiles / (full * dev.sm_count))


# A timer runs the shape's kernel `reps` times and returns the seconds per call.
Timer = Callable[[int], float]


def gemm_model(shape: GemmShape, weight: np.ndarray | None = None):
    """A one-MatMul ONNX model: Y = A @ B, A (batch, m, k) (no batch axis when batch is 1).
    For a linear GEMM `weight` (k, n) is B, stored as an initializer; otherwise B is an
    input. IR version 10 is set explicitly so any onnxruntime >= 1.20 reads it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    lead = [shape.batch] if shape.batch != 1 else []
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, [*lead, shape.m, shape.k])]
    inits = []
    if shape.linear:
        if weight is None or weight.shape != (shape.k, shape.n):
            raise ValueError(f"a linear GEMM needs a ({shape.k}, {shape.n}) weight")
        inits.append(numpy_helper.from_array(weight.astype(np.float32, copy=False), "B"))
    else:
        inputs.append(helper.make_tensor_value_info("B", TensorProto.FLOAT,
                                                    [*lead, shape.k, shape.n]))
    out = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [*lead, shape.m, shape.n])
    graph = helper.make_graph([helper.make_node("MatMul", ["A", "B"], ["Y"])], "gemm",
                              inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _ort_timer(shape: GemmShape, threads: int, rng: np.random.Generator) -> Timer:
    import onnxruntime as ort

    lead = [shape.batch] if shape.batch != 1 else []
    a = rng.random((*lead, shape.m, shape.k), dtype=np.float32)
    b = rng.random((*lead, shape.k, shape.n), dtype=np.float32)
    # a weight is constant, so ORT prepacks it as it would in a real model
    model = gemm_model(shape, b if shape.linear else None)
    # idle sessions must not spin on the cores the timed one needs (many sessions live at
    # once): SessionSettings leaves spinning off
    sess = load_cpu(model.SerializeToString(),
                    SessionSettings(intra_op_threads=threads, inter_op_threads=1))
    del model
    # Bound once, so no copy is timed. The OrtValues wrap the numpy buffers without copying:
    # both must outlive the binding, so the closure holds them (`alive`).
    y = np.empty((*lead, shape.m, shape.n), np.float32)
    alive = {"A": ort.OrtValue.ortvalue_from_numpy(a), "Y": ort.OrtValue.ortvalue_from_numpy(y)}
    if not shape.linear:
        alive["B"] = ort.OrtValue.ortvalue_from_numpy(b)
    binding = sess.io_binding()
    for name, value in alive.items():
        (binding.bind_ortvalue_output if name == "Y" else binding.bind_ortvalue_input)(name, value)
    arrays = (a, y) if shape.linear else (a, b, y)  # a weight lives on in the session only

    def run(reps: int, alive=alive, arrays=arrays) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            sess.run_with_iobinding(binding)
        return (time.perf_counter() - t0) / reps

    return run


TORCH_DTYPES = ("fp16", "bf16", "fp32")


def pool_elements(shapes: Iterable[GemmShape]) -> tuple[int, int]:
    """Elements of the two buffers the GPU probe shares among all shapes: operands (A and B
    side by side, never overlapping) and outputs. Memory is that of the largest GEMM, not
    the sum, so a wide search fits on one GPU."""
    shapes = list(shapes)
    operands = max(s.batch * (s.m * s.k + s.k * s.n) for s in shapes)
    return operands, max(s.batch * s.m * s.n for s in shapes)


def _torch_pools(shapes: Iterable[GemmShape], dtype: str, seed: int):
    import torch

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    n_in, n_out = pool_elements(shapes)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    # random operands: all-zero inputs run faster on GPUs (less switching power, higher clocks)
    return (torch.randn(n_in, device="cuda", dtype=dt, generator=gen),
            torch.empty(n_out, device="cuda", dtype=dt))


def pool_views(shape: GemmShape, src, dst):
    """(A, B, Y) for `shape` as views of the shared buffers: A and B side by side in `src`,
    Y at the start of `dst`. A linear GEMM's B is W.T with W (n, k), nn.Linear's layout."""
    b, m, k, n = shape.batch, shape.m, shape.k, shape.n
    x = src[:b * m * k]
    w = src[b * m * k:b * (m * k + k * n)]
    if shape.linear:
        return x.view(m, k), w.view(n, k).t(), dst[:m * n].view(m, n)
    return x.view(b, m, k), w.view(b, k, n), dst[:b * m * n].view(b, m, n)


def _torch_timer(shape: GemmShape, pools) -> Timer:
    import torch

    x, w, y = pool_views(shape, *pools)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(reps: int) -> float:
        start.record()
        for _ in range(reps):
            torch.matmul(x, w, out=y)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3 / reps

    return run


def _calibrate(timer: Timer, warmup: int, min_sample_s: float) -> int:
    """Run the warm-up calls and pick how many calls one sample takes (tuner.measure.timing
    .reps_for: a tiny attention GEMM takes microseconds)."""
    per_call = timer(1)
    for _ in range(max(0, warmup - 1)):
        per_call = min(per_call, timer(1))
    return reps_for(per_call * 1e3, min_sample_s * 1e3)


def steps(shapes: Iterable[GemmShape], rounds: int) -> int:
    """Progress steps `probe` reports: one per unique shape set up, one per timed sample."""
    unique = len({s.key for s in shapes})
    return unique * (rounds + 1)


def probe(shapes: Sequence[GemmShape], backend: str = "ort-cpu", rounds: int = 7,
          warmup: int = 2, *, threads: int = 0, dtype: str = "fp16",
          min_sample_ms: float | None = None, device: DeviceFacts | None = None,
          progress: Progress | None = None, seed: int = 0) -> list[GemmResult]:
    """Time every shape `rounds` times, interleaved; one result per input shape, in order
    (shapes with the same key share one measurement). `threads` is ORT's intra-op thread
    count (0: its default); `dtype` is torch's (fp16, bf16, fp32). `progress` (a
    tuner.measure.bench.Progress, e.g. rich_progress) is started with `steps(shapes, rounds)` and
    advanced once per step."""
    if rounds < 1 or warmup < 0:
        raise BadInput(f"rounds must be >= 1 and warmup >= 0, got rounds={rounds}, warmup={warmup}")
    if not shapes:
        raise BadInput("no GEMM shapes to probe")
    reason = backend_unavailable(backend)
    if reason is not None:
        raise BadInput(f"probe backend {backend} cannot run here: {reason}")
    if backend == "torch-cuda" and dtype not in TORCH_DTYPES:
        raise BadInput(f"dtype must be fp16, bf16 or fp32, not {dtype!r}")
    unique: dict[tuple, GemmShape] = {}
    for s in shapes:
        unique.setdefault(s.key, s)
    progress = progress or Progress()
    progress.start(steps(shapes, rounds))
    tick = progress.advance
    if backend == "torch-cuda":
        device = device or gpu_facts()
        min_s = (min_sample_ms or 2.0) * 1e-3
    else:
        device = device or DEVICES["cpu"]
        min_s = (min_sample_ms or 5.0) * 1e-3
    rng = np.random.default_rng(seed)
    pools = _torch_pools(unique.values(), dtype, seed) if backend == "torch-cuda" else None
    timers: dict[tuple, tuple[Timer, int]] = {}
    for key, s in unique.items():
        tick(f"setting up {s.label or 'gemm'} {s.describe()}")
        timer = _torch_timer(s, pools) if pools is not None else _ort_timer(s, threads, rng)
        timers[key] = (timer, _calibrate(timer, max(1, warmup), min_s))
    keys = list(unique)

    def step(r: int, i: int) -> None:
        s = unique[keys[i]]
        tick(f"round {r + 1}/{rounds}: {s.label or 'gemm'} {s.describe()}")
    # a fresh random order each round: no shape always runs first (after an idle gap) or
    # always behind the same other shape; each timer gives its own ms per call
    ms = interleave_timed([lambda t=timers[k]: t[0](t[1]) * 1e3 for k in keys], rounds, step,
                          seed=seed + 1)
    samples = {k: tuple(float(x) for x in ms[i]) for i, k in enumerate(keys)}
    return [GemmResult(s, backend, device.name, samples[s.key], batched_waves(s, device))
            for s in shapes]
