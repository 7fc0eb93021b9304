"""The model a server serves: read the artifact, load the selected variant and the original
through tuner.runtime, re-run the accuracy gate here, and find the tensors' layout.

No grpc here. Everything reaches the model through tuner.artifact.records (what to load),
tuner.runtime.registry (how to run it) and tuner.gate.entry.prepare (whether it is exact).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import onnx
import onnx_ir as ir

from serving.batcher import Layout, split, stack
from serving.overlap import OverlapRunner, cpu_threads, fit_threads, overlap_wanted
from tuner.artifact.records import Buckets, Latency, Manifest
from tuner.artifact.store import read_manifest, variant_path
from tuner.errors import BadInput
from tuner.gate.feeds import make_feeds
from tuner.gate.entry import prepare
from tuner.gate.verify import Tolerance, VerifyResult
from tuner.graph.dtypes import KSERVE_BY_ONNX, onnx_name
from tuner.graph.cache_record import CacheRecord, find_cache_record
from tuner.graph.inspect import inspect_model
from tuner.graph.io import (embedding_rows, max_positions, model_bytes, model_precision,
                             rotary_positions)
from tuner.graph.load import check_external_data, load_model, read_proto
from tuner.graph.ort_fused import lengths_mask_reader
from tuner.graph.roles import (ATTENTION_MASK, INPUTS_EMBEDS, POSITION_IDS, TOKEN_IDS,
                               TOKEN_TYPE_IDS, InputSpec, batch_limit, input_specs, with_role)
from tuner.runtime.base import Runner, SessionSettings
from tuner.runtime.registry import get_backend

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
    specs: tuple[InputSpec, ...] = ()  # roles and axes, found from the graph's structure
    # every input that indexes a table (token ids, positions, token types) -> its rows
    index_limits: Mapping[str, int] = field(default_factory=dict)
    fixed_batch: int | None = None  # the one batch size the graph takes (1: never batched)
    precision: str = "fp32"
    # a fused Attention that reads the mask as each row's length: only right padding is right
    lengths_mask: str | None = None


def batches(signature: Signature) -> bool:
    """Whether every input's first axis is the batch (Triton's max_batch_size > 0: outputs
    then carry the batch first too)."""
    return all(s.shape and s.shape[0] == -1 for s in signature.inputs)


@dataclass(frozen=True)
class LoadedModel:
    """What the engine serves: the runner of the variant that passed the gate here (or the
    original), the original's runner for shadow checks (None when none are asked for and a
    variant is served: its session is released), and what clients must send."""

    name: str
    served: str  # the variant's name
    note: str  # one line for the log: which variant, and why
    runner: Runner
    original: Runner | None
    signature: Signature
    layout: Layout
    buckets: Buckets
    backend: str
    gate: VerifyResult | None  # None when the original was selected (nothing to compare)
    latency: Mapping[str, Latency] = field(default_factory=dict)  # the served variant's timings
    # A decoder exported with its KV cache: generation (serving.generation) for requests of
    # token ids, a plain forward for requests that bring their own past.
    cache: CacheRecord | None = None
    # the longest sequence its position table takes, when the graph has one (the rows a
    # decoder's position input indexes; an encoder's from the graph, RoBERTa's offset counted)
    max_positions: int | None = None
    folder: Path | None = None  # the artifact (its tokenizer.json, if any)

    @property
    def cache_model(self) -> bool:
        return self.cache is not None


def _spec(value: onnx.ValueInfoProto) -> TensorSpec:
    t = value.type.tensor_type
    datatype = KSERVE_BY_ONNX.get(onnx_name(t.elem_type) or "")
    if datatype is None:
        raise BadInput(f"graph tensor {value.name!r} has element type {t.elem_type}, which "
                       "the KServe v2 protocol cannot carry")
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                 for d in t.shape.dim)
    return TensorSpec(value.name, datatype, dims)


def _checked(path: Path) -> onnx.ModelProto:
    """The graph's structure through the project's safe loader: BadInput (exit 2) for a
    corrupt file or external data that is missing or points outside the artifact."""
    proto = read_proto(path)
    check_external_data(proto, path.parent)
    return proto


def read_signature(path: Path, model: ir.Model | None = None) -> Signature:
    """Inputs, outputs and vocabulary of an ONNX graph (structure only: no weights read);
    `model` is the same graph already loaded, if the caller has it."""
    graph = _checked(path).graph
    inits = {i.name for i in graph.initializer}
    inputs = tuple(_spec(v) for v in graph.input if v.name not in inits)
    outputs = tuple(_spec(v) for v in graph.output)
    model = model if model is not None else load_model(path)
    specs = tuple(input_specs(model))
    limits = {}
    for s in specs:
        if s.role in (TOKEN_IDS, POSITION_IDS, TOKEN_TYPE_IDS):
            rows = embedding_rows(model, s.name)
            if rows is not None:
                limits[s.name] = rows
    token = with_role(specs, TOKEN_IDS)
    name = token.name if token else None
    return Signature(inputs, outputs, name, limits.get(name) if name else None, specs, limits,
                     batch_limit(specs), model_precision(model),
                     lengths_mask_reader(model.graph))


def _position_rows(signature: Signature) -> int | None:
    """Rows of the learned position table that the position ids index (GPT-2's wpe): the
    longest cache the model can serve. None for rotary families (no table to read; a fused
    rotary operator's cos cache bounds them: tuner.graph.io.rotary_positions)."""
    positions = with_role(signature.specs, POSITION_IDS)
    return signature.index_limits.get(positions.name) if positions is not None else None


def _table_positions(model: ir.Model) -> int | None:
    """The longest sequence a model with a learned position table computed inside the graph
    takes (BERT's, RoBERTa's: tuner.graph.io.max_positions); None where inspect finds none."""
    try:
        return max_positions(model, inspect_model(model))
    except Exception:  # noqa: BLE001 - not a transformer inspect reads: no limit known
        return None


def _probe_layout(runner: Runner, path: Path, signature: Signature, vocab: int,
                  tolerance: Tolerance) -> Layout:
    """Which output axes follow the sequence: run batch 2 at two lengths and see which axis
    changes with it (names of symbolic dims differ between exporters; running does not)."""
    roles = {s.name: s for s in signature.specs}
    seq_roles = (TOKEN_IDS, ATTENTION_MASK, POSITION_IDS, TOKEN_TYPE_IDS, INPUTS_EMBEDS)
    seq_inputs = tuple(
        s.name for s in signature.inputs
        if len(s.shape) >= 2 and s.shape[1] == -1 and s.name in roles
        and roles[s.name].role in seq_roles and roles[s.name].batch_axis == 0
        and roles[s.name].seq_axis == 1)
    mask_spec = with_role(signature.specs, ATTENTION_MASK)
    mask = mask_spec.name if mask_spec is not None and mask_spec.name in seq_inputs else None
    axes: dict[str, int | None] = {}
    if seq_inputs:
        a, b = (runner.infer(f) for f in make_feeds(path, vocab, [(2, 3), (2, 5)], seed=1))
        for name in a:
            diff = [i for i, (x, y) in enumerate(zip(a[name].shape, b[name].shape))
                    if i > 0 and (x, y) == (3, 5)]
            axes[name] = diff[0] if diff else None
    layout = Layout(seq_inputs, mask, axes)
    if mask is None:
        return layout  # nothing is padded or joined but requests of equal length
    joins = signature.fixed_batch is None
    return dataclasses.replace(layout, rows_apart=_rows_apart(runner, path, vocab, layout, joins,
                                                              tolerance))


def _rows_apart(runner: Runner, path: Path, vocab: int, layout: Layout, joins: bool,
                tolerance: Tolerance) -> bool:
    """Whether a request's outputs alone are its outputs padded (and, where the batch is not
    fixed, joined with a longer request), as the batcher runs them, within the gate's
    `tolerance`: float graphs differ by rounding; not so where the activations are quantized
    with one range for the whole run (quantize_dynamic: 1e-2 and more)."""
    alone, longer = make_feeds(path, vocab, [(1, 3), (1, 6)], seed=2)  # one read of the graph
    rows = len(next(iter(alone.values())))  # 1, or the graph's fixed batch
    want = runner.infer(alone)
    batch = stack(layout, [alone, longer] if joins else [alone], 6)
    got = split(layout, runner.infer(batch), 0, rows, 3, 6)
    return all(tolerance(name, want[name], got[name]) for name in want)


def _gate_shapes(buckets: Buckets) -> list[tuple[int, int]]:
    top = buckets.seq[-1]
    return sorted({(1, min(7, top)), (2, min(16, top)), (3, top)})


def _with_overlap(runner: Runner, note: str, path: Path, loader, backend: str,
                  settings: SessionSettings, shapes, cache: Path) -> tuple[Runner, str]:
    """`runner`, with a one-thread session of the same graph beside it where it pays. The
    same file on the same provider: only the thread count differs, which the gate's
    tolerances (and the shadow checks) cover."""
    if not overlap_wanted(backend, settings, model_bytes(path)):
        return runner, note
    single = loader.load(path, dataclasses.replace(settings, intra_op_threads=1), shapes, cache)
    threads = cpu_threads(settings)
    return (OverlapRunner(runner, single, workers=threads),
            f"{note}; up to {threads} requests at a time, each beside another on one thread")


def load_artifact(out_dir: str | Path, backend: str | None = None,
                  settings: SessionSettings | None = None, model_name: str | None = None,
                  tolerance: Tolerance = Tolerance(),
                  log: Callable[[str], None] = lambda line: None,
                  overlap: bool = False, shadow: bool = True) -> LoadedModel:
    """Load OUT's selected variant, re-check it against the original on this machine, and
    fall back to the original (saying so through `log`) if it fails here. `overlap`: where
    serving.overlap says it pays, the served graph is loaded a second time on one thread,
    for requests that run beside another (the runner is then an OverlapRunner). `shadow`:
    keep the original's session for shadow checks (without, a served variant's gate is the
    last use of it)."""
    out = Path(out_dir)
    manifest: Manifest = read_manifest(out)
    backend = backend or manifest.backend
    settings = settings or fit_threads(manifest.session_settings(ignore_unknown=True), log)
    name = model_name or Path(manifest.source_path).stem
    loader = get_backend(backend)
    shapes = [(b, s) for b in manifest.buckets.batch for s in manifest.buckets.seq]
    cache = out / "cache" / backend
    original_path = variant_path(out, manifest.variant("original"))
    original_model = load_model(original_path)  # the graph's structure; weights stay lazy
    signature = read_signature(original_path, original_model)
    vocab = signature.vocab_size or manifest.variant("original").shape.get("vocab_size") or 2
    chosen = manifest.selected_variant()
    kv = find_cache_record(original_model)  # None: no KV cache

    def load_original():
        return loader.load(original_path, settings, shapes, cache)

    # the original's session: what is served, or what shadow checks run; else the gate
    # records it and lets it go before the variant loads (one model in memory at a time)
    original = load_original() if chosen.name == "original" or shadow else None
    runner, served, gate = original, "original", None
    note = "serving the original (the artifact selected it)"
    if chosen.name != "original":
        candidate_path = variant_path(out, chosen)
        _checked(candidate_path)
        candidate_model = load_model(candidate_path)
        # greedy rollouts for a cache model (each model fed its own present), else plain
        # feeds at the artifact's buckets; tolerances at the original's precision either way
        check = prepare(original_model, original or load_original, candidate_model,
                        vocab=vocab, shapes=_gate_shapes(manifest.buckets), tolerance=tolerance)
        candidate = loader.load(candidate_path, settings, shapes, cache)
        gate = check.check(candidate)
        if gate:
            runner, served = candidate, chosen.name
            note = f"serving variant {chosen.name}: accuracy gate passed on this machine"
        else:
            note = (f"variant {chosen.name} FAILED the accuracy gate on this machine; serving "
                    "the original instead")
            log(gate.table())
            candidate.close()
            runner = original = original or load_original()
    log(note)
    if kv is not None:
        # requests carry their own past (or generation builds it): nothing is padded along the
        # sequence, and the served graph says what the past must look like (a widened cache is
        # wider)
        layout = Layout((), None, {})
        served_model = original_model
        if served != "original":
            served_path = variant_path(out, manifest.variant(served))
            kv = find_cache_record(candidate_model) or kv
            signature = read_signature(served_path, candidate_model)
            served_model = candidate_model
        known = [n for n in (_position_rows(signature), rotary_positions(served_model)) if n]
        positions = min(known) if known else None
    else:
        layout = _probe_layout(runner, original_path, signature, vocab,
                               tolerance.at_precision(loader.precision))
        positions = _table_positions(original_model)
        if overlap:
            runner, note = _with_overlap(runner, note, variant_path(out, manifest.variant(served)),
                                         loader, backend, settings, shapes, cache)
    return LoadedModel(name, served, note, runner, original, signature, layout,
                       manifest.buckets, backend, gate, manifest.variant(served).latency, kv,
                       positions, out)
