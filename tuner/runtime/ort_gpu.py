"""`ort-cuda` (and `ort-cuda-fp16`): ONNX Runtime on the CUDA execution provider.

Inputs and outputs go through IO binding. When the loader is given the buckets (the fixed
shapes the server pads every request to), it captures one CUDA graph per bucket
(`enable_cuda_graph` with a `gpu_graph_id` per bucket): each bucket gets device buffers at
fixed addresses, a request's arrays are copied into them in place and the captured kernels
are replayed. ONNX Runtime refuses graphs when any node runs outside the CUDA EP (shape
arithmetic that it places on the CPU, common in TorchScript exports); the runner then falls
back to plain IO binding and says why in `info`.

fp16: the variant is converted (weights and compute in fp16, inputs and outputs kept as they
were) and cached under the artifact's cache dir; the accuracy gate must judge it at fp16
tolerances (the backend is registered with precision "fp16").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.graph.dtypes import NUMPY_BY_ORT
from tuner.graph.roles import (ATTENTION_MASK, POSITION_IDS, InputSpec, input_specs, np_dtype,
                               role_of)
from tuner.runtime.base import SessionSettings
from tuner.runtime.gpu import CUDA_EP, check_buckets, fp16_model, preload_libraries
from tuner.runtime.ort import session_options

WARMUP_RUNS = 3  # ORT runs a bucket normally before it captures; capture by the third run


@dataclass(frozen=True)
class CudaOptions:
    device_id: int = 0
    cuda_graph: bool = True  # one CUDA graph per bucket, when the session allows it
    # TF32 would change fp32 results in the 3rd digit and fail an fp32 accuracy gate; the fp16
    # backend is the tensor-core path the tuner compares.
    use_tf32: bool = False
    gpu_mem_limit: int | None = None  # bytes; None: ONNX Runtime's default (no limit)

    def __post_init__(self) -> None:
        if self.device_id < 0:
            raise ValueError(f"device_id must be >= 0, not {self.device_id}")
        if self.gpu_mem_limit is not None and self.gpu_mem_limit <= 0:
            raise ValueError(f"gpu_mem_limit must be positive, not {self.gpu_mem_limit}")

    def provider_options(self, cuda_graph: bool) -> dict[str, str]:
        """The CUDA EP's options, as the strings ONNX Runtime parses."""
        opts = {"device_id": str(self.device_id), "use_tf32": "1" if self.use_tf32 else "0",
                "enable_cuda_graph": "1" if cuda_graph else "0",
                "arena_extend_strategy": "kSameAsRequested"}
        if self.gpu_mem_limit is not None:
            opts["gpu_mem_limit"] = str(self.gpu_mem_limit)
        return opts


def session_specs(session) -> list[InputSpec]:
    """tuner.graph.roles.InputSpec for every input of an ORT session."""
    return [InputSpec(i.name, NUMPY_BY_ORT.get(i.type, "float32"), tuple(i.shape))
            for i in session.get_inputs()]


def dummy_feed(specs: Sequence[InputSpec], batch: int, seq: int) -> dict[str, np.ndarray]:
    """Valid inputs at one bucket for warm-up and capture: token id 0, a full mask, positions
    0..seq-1, zeros or ones elsewhere. Values do not matter here, shapes do: static dims are
    kept, the batch and sequence axes are the specs' own (found from the graph)."""
    feed = {}
    for s in specs:
        b_axis, s_axis = (s.batch_axis, s.seq_axis) if (s.batch_axis, s.seq_axis) != (None, None) \
            else (0, 1)
        dims = tuple(d if isinstance(d, int) and d > 0 else
                     (batch if i == b_axis else seq if i == s_axis else 1)
                     for i, d in enumerate(s.dims)) or (batch, seq)
        role = s.role if s.role != "other" else role_of(s.name)
        if role == POSITION_IDS and len(dims) == 2:
            arr = np.broadcast_to(np.arange(dims[1]), dims)
        elif role == ATTENTION_MASK:
            arr = np.ones(dims)
        else:
            arr = np.zeros(dims)
        feed[s.name] = np.ascontiguousarray(arr.astype(np_dtype(s.dtype)))
    return feed


def _shape_key(feeds: Mapping[str, np.ndarray]) -> tuple:
    return tuple(sorted((n, tuple(a.shape)) for n, a in feeds.items()))


def make_session(model: Path, settings: SessionSettings, providers: list, expect: str):
    """An InferenceSession that must really run on `expect`: ORT would otherwise fall back to
    the CPU silently, and every timing would be a lie."""
    import onnxruntime as ort

    preload_libraries(expect)
    sess = ort.InferenceSession(str(model), sess_options=session_options(settings),
                                providers=providers)
    if sess.get_providers()[0] != expect:
        raise BadInput(f"onnxruntime did not start {expect} for {model.name} (it runs on "
                       f"{sess.get_providers()}); check the CUDA/cuDNN/TensorRT libraries")
    return sess


class IoBindingRunner:
    """Any GPU session through IO binding: inputs copied in once, outputs back once.
    `device` is ORT's device type for the outputs ("cuda"; "cpu" lets tests run the same code
    on the CPU EP)."""

    def __init__(self, session, name: str, device_id: int = 0,
                 info: dict[str, Any] | None = None, run_options=None,
                 device: str = "cuda") -> None:
        self.session = session
        self.name = name
        self.device_id = device_id
        self.device = device
        self.output_names = [o.name for o in session.get_outputs()]
        self.info = dict(info or {})
        self._run_options = run_options

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        io = self.session.io_binding()
        for name, arr in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(arr))
        for name in self.output_names:
            io.bind_output(name, self.device, self.device_id)
        io.synchronize_inputs()
        self.session.run_with_iobinding(io, self._run_options)
        io.synchronize_outputs()
        return dict(zip(self.output_names, io.copy_outputs_to_cpu()))

    def close(self) -> None:
        self.session = None


class _Graph:
    """One captured bucket: device buffers at fixed addresses and the graph id replaying them."""

    def __init__(self, session, graph_id: int, feed: Mapping[str, np.ndarray],
                 outputs: Mapping[str, tuple[tuple[int, ...], np.dtype]], device_id: int,
                 device: str = "cuda") -> None:
        import onnxruntime as ort

        self.session = session
        self.device = device
        self.dtypes = {n: a.dtype for n, a in feed.items()}
        self.inputs = {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a), device,
                                                           device_id)
                       for n, a in feed.items()}
        self.outputs = {n: ort.OrtValue.ortvalue_from_shape_and_type(list(shape), dtype.type,
                                                                     device, device_id)
                        for n, (shape, dtype) in outputs.items()}
        self.io = session.io_binding()
        for n, v in self.inputs.items():
            self.io.bind_ortvalue_input(n, v)
        for n, v in self.outputs.items():
            self.io.bind_ortvalue_output(n, v)
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        self.lock = threading.Lock()  # one set of buffers: one request at a time

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        with self.lock:
            # copied into the captured addresses; the buffers keep their shape and dtype
            for n, v in self.inputs.items():
                v.update_inplace(np.ascontiguousarray(feeds[n], dtype=self.dtypes[n]))
            self.io.synchronize_inputs()
            self.session.run_with_iobinding(self.io, self.run_options)
            self.io.synchronize_outputs()
            # on the CPU, numpy() views the bound buffer, which the next run overwrites
            copy = self.device == "cpu"
            return {n: np.array(v.numpy(), copy=copy) for n, v in self.outputs.items()}


class CudaGraphRunner:
    """Replays one CUDA graph per bucket; other shapes run uncaptured (gpu_graph_id -1)."""

    def __init__(self, session, name: str, buckets: Sequence[tuple[int, int]],
                 device_id: int = 0, info: dict[str, Any] | None = None,
                 device: str = "cuda", specs: Sequence[InputSpec] | None = None) -> None:
        import onnxruntime as ort

        self.session = session
        self.name = name
        self.output_names = [o.name for o in session.get_outputs()]
        no_graph = ort.RunOptions()
        no_graph.add_run_config_entry("gpu_graph_id", "-1")  # -1: this run neither captures nor replays
        self._plain = IoBindingRunner(session, name, device_id, run_options=no_graph,
                                      device=device)
        specs = list(specs) if specs is not None else session_specs(session)
        self._graphs: dict[tuple, _Graph] = {}
        # ids from 1: ONNX Runtime reserves 0 for its own single-graph mode
        for graph_id, (b, s) in enumerate(buckets, start=1):
            feed = dummy_feed(specs, b, s)
            first = self._plain.infer(feed)  # output shapes and dtypes, uncaptured
            outs = {n: (tuple(a.shape), a.dtype) for n, a in first.items()}
            graph = _Graph(session, graph_id, feed, outs, device_id, device)
            for _ in range(WARMUP_RUNS):
                graph.run(feed)
            self._graphs[_shape_key(feed)] = graph
        self.info = dict(info or {}, cuda_graph=True, graphs=len(self._graphs))

    def close(self) -> None:
        self._graphs.clear()
        self._plain.close()
        self.session = None

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        graph = self._graphs.get(_shape_key(feeds))
        if graph is None:
            return self._plain.infer(feeds)
        out = graph.run(feeds)
        return {n: out[n] for n in self.output_names}


def load_ort_cuda(model_path: Path, settings: SessionSettings,
                  shapes: Sequence[tuple[int, int]] | None, cache_dir: Path | None, *,
                  fp16: bool = False, options: CudaOptions = CudaOptions()):
    """The `ort-cuda` / `ort-cuda-fp16` loader (tuner.runtime.backend.Loader signature)."""
    name = "ort-cuda-fp16" if fp16 else "ort-cuda"
    model = fp16_model(Path(model_path), cache_dir) if fp16 else Path(model_path)
    buckets = check_buckets(shapes)
    info: dict[str, Any] = {"provider": CUDA_EP, "precision": "fp16" if fp16 else "fp32",
                            "model": str(model), "use_tf32": options.use_tf32}
    if options.cuda_graph and buckets:
        try:
            sess = make_session(model, settings, [(CUDA_EP, options.provider_options(True)),
                                                  "CPUExecutionProvider"], CUDA_EP)
            return CudaGraphRunner(sess, name, buckets, options.device_id, info,
                                   specs=input_specs(model))
        except Exception as e:  # noqa: BLE001 - ORT refuses graphs in several ways; all mean "off"
            info["cuda_graph_off"] = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    else:
        info["cuda_graph_off"] = "disabled" if not options.cuda_graph else "no fixed bucket shapes"
    sess = make_session(model, settings, [(CUDA_EP, options.provider_options(False)),
                                          "CPUExecutionProvider"], CUDA_EP)
    return IoBindingRunner(sess, name, options.device_id, dict(info, cuda_graph=False))
