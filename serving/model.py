"""The model a server serves: read the artifact, load the selected variant and the original
through tuner.runtime, re-run the accuracy gate here, and find the tensors' layout.

No grpc here. Everything reaches the model through tuner.artifact (what to load),
tuner.runtime.registry (how to run it) and tuner.verify / tuner.feeds (whether it is exact).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import onnx

from serving.batcher import Layout
from tuner.artifact import Buckets, Latency, Manifest, read_manifest, variant_path
from tuner.errors import BadInput
from tuner.feeds import make_feeds
from tuner.graph.load import check_external_data, read_proto
from tuner.runtime.base import Runner, SessionSettings
from tuner.runtime.registry import get_backend
from tuner.verify import Tolerance, VerifyResult, verify

# ONNX element types -> KServe v2 datatype names.
_ONNX_DATATYPES = {
    onnx.TensorProto.BOOL: "BOOL", onnx.TensorProto.UINT8: "UINT8",
    onnx.TensorProto.UINT16: "UINT16", onnx.TensorProto.UINT32: "UINT32",
    onnx.TensorProto.UINT64: "UINT64", onnx.TensorProto.INT8: "INT8",
    onnx.TensorProto.INT16: "INT16", onnx.TensorProto.INT32: "INT32",
    onnx.TensorProto.INT64: "INT64", onnx.TensorProto.FLOAT16: "FP16",
    onnx.TensorProto.FLOAT: "FP32", onnx.TensorProto.DOUBLE: "FP64",
    onnx.TensorProto.STRING: "BYTES",
}
_PAST = "past_key_values."
# Ops a token id passes through unchanged on its way to the embedding Gather.
_PASS_THROUGH = {"Reshape", "Cast", "Identity", "Flatten", "Squeeze", "Unsqueeze"}


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output as clients see it: KServe datatype, -1 for dynamic axes."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tensor needs a name")
        if any(d < -1 or d == 0 for d in self.shape):
            raise ValueError(f"tensor {self.name!r}: dims must be positive or -1, not "
                             f"{list(self.shape)}")


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    token_input: str | None  # the input whose values index the embedding table
    vocab_size: int | None  # rows of that table: valid token ids are [0, vocab_size)


@dataclass(frozen=True)
class LoadedModel:
    """What the engine serves: the runner of the variant that passed the gate here (or the
    original), the original's runner for shadow checks, and what clients must send."""

    name: str
    served: str  # the variant's name
    note: str  # one line for the log: which variant, and why
    runner: Runner
    original: Runner
    signature: Signature
    layout: Layout
    buckets: Buckets
    backend: str
    gate: VerifyResult | None  # None when the original was selected (nothing to compare)
    latency: Mapping[str, Latency] = field(default_factory=dict)  # the served variant's timings
    # A decoder exported with its KV cache (past_key_values.* inputs) is served by generation
    # (serving.generate), not by one forward pass per request.
    cache_model: bool = False
    max_positions: int | None = None  # rows of the position table, when the graph has one
    folder: Path | None = None  # the artifact (its tokenizer.json, if any)


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    t = value.type.tensor_type
    datatype = _ONNX_DATATYPES.get(t.elem_type)
    if datatype is None:
        raise BadInput(f"graph tensor {value.name!r} has element type {t.elem_type}, which "
                       "the KServe v2 protocol cannot carry")
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                 for d in t.shape.dim)
    return TensorSpec(value.name, datatype, dims)


def _vocab(graph: onnx.GraphProto, token_input: str) -> int | None:
    """Rows of the embedding table that `token_input` indexes (Gather on an initializer),
    following the input through reshapes and casts. None when no such Gather is found."""
    tables = {i.name: list(i.dims) for i in graph.initializer}
    frontier, seen = [token_input], set()
    while frontier:
        name = frontier.pop()
        seen.add(name)
        for node in graph.node:
            if name not in node.input:
                continue
            if node.op_type == "Gather" and node.input[1] == name and node.input[0] in tables:
                dims = tables[node.input[0]]
                if len(dims) == 2:
                    return int(dims[0])
            elif node.op_type in _PASS_THROUGH and node.input[0] == name:
                frontier.extend(o for o in node.output if o not in seen)
    return None


def _checked(path: Path) -> onnx.ModelProto:
    """The graph's structure through the project's safe loader: BadInput (exit 2) for a
    corrupt file or external data that is missing or points outside the artifact."""
    proto = read_proto(path)
    check_external_data(proto, path.parent)
    return proto


def read_signature(path: Path) -> Signature:
    """Inputs, outputs and vocabulary of an ONNX graph (structure only: no weights read)."""
    graph = _checked(path).graph
    inits = {i.name for i in graph.initializer}
    inputs = tuple(_spec(v) for v in graph.input if v.name not in inits)
    outputs = tuple(_spec(v) for v in graph.output)
    token = next((s.name for s in inputs if "input_ids" in s.name.lower()), None)
    return Signature(inputs, outputs, token, _vocab(graph, token) if token else None)


def is_cache_model(signature: Signature) -> bool:
    return any(s.name.startswith(_PAST) for s in signature.inputs)


def _position_rows(path: Path) -> int | None:
    """Rows of the learned position table that `position_ids` indexes (GPT-2's wpe): the
    longest cache the model can serve. None for rotary families (no table to read)."""
    graph = _checked(path).graph
    if not any(v.name == "position_ids" for v in graph.input):
        return None
    return _vocab(graph, "position_ids")


def _decoder_gate_feeds(original: Runner, signature: Signature, vocab: int, steps: int = 3
                        ) -> list[dict[str, np.ndarray]]:
    """Feeds for a cache model's gate: a prefill (batch 2, 7 tokens) and `steps` greedy
    decode steps, each step's past the original's own present, so that the variant is
    compared on the shapes generation runs (past 0, then a growing cache)."""
    rng = np.random.default_rng(0)
    names = [s.name for s in signature.inputs]
    past = {s.name: np.zeros((2, s.shape[1], 0, s.shape[3]), np.float32)
            for s in signature.inputs if s.name.startswith(_PAST)}
    ids = rng.integers(0, vocab, (2, 7)).astype(np.int64)  # (B, S)
    feeds_list, length = [], 0
    for _ in range(steps + 1):
        s = ids.shape[1]
        feeds = {"input_ids": ids, "attention_mask": np.ones((2, length + s), np.int64), **past}
        if "position_ids" in names:
            feeds["position_ids"] = np.tile(np.arange(length, length + s, dtype=np.int64), (2, 1))
        feeds_list.append(feeds)
        out = original.infer(feeds)
        ids = out["logits"][:, -1:, :vocab].argmax(-1).astype(np.int64)  # (B, 1)
        past = {n: out["present." + n[len(_PAST):]] for n in past}
        length += s
    return feeds_list


def _probe_layout(runner: Runner, path: Path, signature: Signature, vocab: int) -> Layout:
    """Which output axes follow the sequence: run batch 2 at two lengths and see which axis
    changes with it (names of symbolic dims differ between exporters; running does not)."""
    seq_inputs = tuple(s.name for s in signature.inputs
                       if len(s.shape) >= 2 and s.shape[0] == -1 and s.shape[1] == -1)
    mask = next((n for n in seq_inputs if "attention_mask" in n.lower()), None)
    axes: dict[str, int | None] = {}
    if seq_inputs:
        a, b = (runner.infer(f) for f in make_feeds(path, vocab, [(2, 3), (2, 5)], seed=1))
        for name in a:
            diff = [i for i, (x, y) in enumerate(zip(a[name].shape, b[name].shape))
                    if i > 0 and (x, y) == (3, 5)]
            axes[name] = diff[0] if diff else None
    return Layout(seq_inputs, mask, axes)


def _gate_feeds(path: Path, vocab: int, buckets: Buckets) -> list[dict[str, np.ndarray]]:
    top = buckets.seq[-1]
    shapes = sorted({(1, min(7, top)), (2, min(16, top)), (3, top)})
    return make_feeds(path, vocab, shapes, seed=0)


def _recorded_settings(manifest: Manifest) -> SessionSettings:
    """The session settings the artifact was timed with (unknown keys ignored)."""
    known = {f.name for f in fields(SessionSettings)}
    try:
        return SessionSettings(**{k: v for k, v in manifest.settings.items() if k in known})
    except (TypeError, ValueError) as e:
        raise BadInput(f"manifest: settings: {e}") from None


def load_artifact(out_dir: str | Path, backend: str | None = None,
                  settings: SessionSettings | None = None, model_name: str | None = None,
                  tolerance: Tolerance = Tolerance(),
                  log: Callable[[str], None] = lambda line: None) -> LoadedModel:
    """Load OUT's selected variant, re-check it against the original on this machine, and
    fall back to the original (saying so through `log`) if it fails here."""
    out = Path(out_dir)
    manifest: Manifest = read_manifest(out)
    backend = backend or manifest.backend
    settings = settings or _recorded_settings(manifest)
    name = model_name or Path(manifest.source_path).stem
    loader = get_backend(backend)
    shapes = [(b, s) for b in manifest.buckets.batch for s in manifest.buckets.seq]
    cache = out / "cache" / backend
    original_path = variant_path(out, manifest.variant("original"))
    signature = read_signature(original_path)
    original = loader.load(original_path, settings, shapes, cache)
    vocab = signature.vocab_size or manifest.variant("original").shape.get("vocab_size") or 2
    cache_model = is_cache_model(signature)
    chosen = manifest.selected_variant()
    runner, served, gate = original, "original", None
    note = "serving the original (the artifact selected it)"
    if chosen.name != "original":
        candidate_path = variant_path(out, chosen)
        _checked(candidate_path)
        candidate = loader.load(candidate_path, settings, shapes, cache)
        feeds = (_decoder_gate_feeds(original, signature, vocab) if cache_model
                 else _gate_feeds(original_path, vocab, manifest.buckets))
        gate = verify(original, candidate, feeds, tolerance)
        if gate:
            runner, served = candidate, chosen.name
            note = f"serving variant {chosen.name}: accuracy gate passed on this machine"
        else:
            note = (f"variant {chosen.name} FAILED the accuracy gate on this machine; serving "
                    "the original instead")
            log(gate.table())
    log(note)
    if cache_model:  # generation finds its own tensors: there is no batcher layout to probe
        layout, positions = Layout((), None, {}), _position_rows(original_path)
    else:
        layout, positions = _probe_layout(runner, original_path, signature, vocab), None
    return LoadedModel(name, served, note, runner, original, signature, layout,
                       manifest.buckets, backend, gate, manifest.variant(served).latency,
                       cache_model, positions, out)
