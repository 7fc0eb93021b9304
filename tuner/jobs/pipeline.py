"""The stages of `tuner optimize` in order, writing into a (temporary) artifact folder:

    setup    inspect, backend, tolerances, the workload (plain or decoder) and its traffic
    plan     candidates, ranked by the GEMM probe (tuner.jobs.planning)
    build    every candidate rewritten and gated (one tuner.gate.entry.prepare for all)
    load     sessions on the measured backend, gated again as that backend runs them
    compare  the variants interleaved, phase by phase, and the workload's selection rule
    grid     the winner timed on the bucket grid, buckets chosen per phase
    keep     a generating decoder's winner cut to the logits a step reads, gated, selected
    write    manifest.json and the report

The model is loaded once (tuner.jobs.optimize); each padded variant rewrites a copy of it,
and every variant is gated against one reference. What differs between an encoder and a
decoder with a KV cache lives in the workload (tuner.jobs.workload, tuner.jobs.decoder).
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import onnx_ir as ir

from tuner.artifact.records import Buckets, ExpectedLatency, Latency, Manifest, Variant
from tuner.artifact.report import write_report
from tuner.artifact.store import write_manifest
from tuner.errors import BadInput, one_line
from tuner.gate.entry import GateCheck, prepare
from tuner.gate.kv_gate import WidenedRunner, has_cache
from tuner.gate.verify import Tolerance
from tuner.graph.cache_record import cache_record
from tuner.graph.inspect import inspect_model, inspect_path
from tuner.graph.io import max_positions, model_bytes, vocab_for_feeds
from tuner.graph.paddable import BY_KIND
from tuner.graph.role_overrides import role_overrides
from tuner.graph.roles import accepted_shapes, input_specs
from tuner.graph.shape import ModelShape
from tuner.hardware.detect import DeviceInfo, detect
from tuner.jobs.decoder import DecoderWorkload
from tuner.jobs.pad import load_reference
from tuner.jobs.planning import Planned, Probe, plan_variants, probe_backend, probe_dtype, speed
from tuner.jobs.variants import Built, accuracy_of, build_fused, build_kept, build_padded, \
    copy_original, graph_files
from tuner.jobs.workload import Phase, PlainWorkload, Workload, selection_shapes
from tuner.measure import bench
from tuner.measure.bench import Measurements, Target
from tuner.measure.buckets import BucketChoice, choose
from tuner.measure.cache import ResultsCache, device_key
from tuner.measure.select import Selection, select
from tuner.plan.findings import audited
from tuner.runtime.base import SessionSettings
from tuner.runtime.memory import load_fitting
from tuner.runtime.registry import get_backend, resolve
from tuner.util.files import sha256_file, sha256_files
from tuner.util.progress import rich_progress

Shape = tuple[int, int]


def progress_say(enabled: bool) -> Callable[[str], None]:
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if enabled:
            print(f"tuner: [{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)
    return say


@dataclass(frozen=True)
class Setup:
    """What every stage reads: the job, the model and its shape, where it is measured."""

    cfg: Any  # tuner.jobs.optimize.OptimizeConfig
    model: ir.Model
    source: Path  # the graph `model` was read from: cfg.model, or its full-cache copy
    root: Path
    info: DeviceInfo
    shape: ModelShape
    vocab: int
    workload: Workload
    selection: tuple[Shape, ...]  # where variants are compared (the first phase's shapes)
    backend: Any  # the measured backend (tuner.runtime.registry)
    settings: SessionSettings
    tolerance: Tolerance
    results: ResultsCache  # timings by key, outside OUT (not the KV cache)
    device: str  # the results-cache key of this device and backend
    say: Callable[[str], None]

    @property
    def probe(self) -> Probe:
        return Probe(probe_backend(self.backend.name), probe_dtype(self.backend.precision),
                     self.settings.intra_op_threads)

    def measure(self, targets, shapes, feeds, rounds: int, warmup: int, extra: Mapping,
                what: str) -> Measurements:
        settings = {**asdict(self.settings), **extra}
        with rich_progress(self.cfg.progress, what) as p:
            return bench.measure(targets, shapes, feeds, rounds, warmup, self.results,
                                 self.backend.name, self.device, settings, p)


def workload_for(cfg, model: ir.Model, shape: ModelShape, vocab: int) -> Workload:
    """The one place the kind of model is asked: a decoder exported with its KV cache is
    measured by prefill and decode, anything else (an encoder-decoder's too) by its forward."""
    positions = max_positions(model, shape)
    if has_cache(model):  # an encoder-decoder's with-past file: refused by cache_record
        return DecoderWorkload(cfg, cache_record(model), shape.cache, vocab, positions)
    return PlainWorkload(cfg, input_specs(model), vocab, positions)


def setup(cfg, model: ir.Model, root: Path, notes: list[str], source: Path) -> Setup:
    say = progress_say(cfg.progress)
    info = detect()
    say(f"inspecting {cfg.model.name}")
    device = info.facts_key or ("h100" if info.kind == "gpu" else "cpu")
    shape = audited(inspect_model(model), device=device)
    vocab = vocab_for_feeds(model, shape)
    backends, resolved = resolve(cfg.backend)
    backend = next((b for b in backends if b.name != "ort-cpu"), backends[0])
    notes += resolved + [f"backend {b.name} usable but not measured (only {backend.name} is)"
                         for b in backends if b is not backend]
    try:
        settings = SessionSettings(intra_op_threads=cfg.threads or info.cpu_cores,
                                   inter_op_threads=1, graph_optimization=cfg.graph_optimization)
        tol = Tolerance(cfg.atol, cfg.rtol)  # at the model's precision: tuner.gate.entry
    except ValueError as e:
        raise BadInput(str(e)) from None
    workload = workload_for(cfg, model, shape, vocab)
    t = workload.traffic
    notes += [t.note] if t.note else []
    return Setup(cfg, model, source, root, info, shape, vocab, workload,
                 tuple(selection_shapes(t.requests, t.seq_grid, t.batch)), backend, settings,
                 tol, ResultsCache.in_dir(cfg.cache_dir), device_key(info, backend.name), say)


def plan_stage(s: Setup, source_sha: str) -> Planned:
    how = s.probe
    return plan_variants(s.cfg, s.shape, s.info.facts(), s.selection[0], how, s.results,
                         (source_sha, f"probe:{how.backend}", s.device), s.say)


def build_stage(s: Setup, planned: Planned) -> tuple[dict[str, Built], GateCheck, list[str]]:
    """The original's copy, every padded candidate from a copy of the model, every fused one
    from the variant it names as its base; each through one prepared gate."""
    built = {"original": copy_original(s.source, s.root)}
    top = s.workload.traffic.seq_grid[-1]
    shapes = accepted_shapes(input_specs(s.model),
                             sorted({(b, min(q, top)) for b, q in ((1, 7), (2, 16), (3, 33))}))
    original = built["original"].path
    # one reference for every gate below (a plain model's outputs recorded, its session let go)
    try:
        gate = prepare(s.model, lambda: load_reference(original, s.settings), vocab=s.vocab,
                       shapes=shapes, tolerance=s.tolerance)
        failure = gate.reference_failure()  # on a feed: no variant could be checked
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - the user's graph fails on its own: bad input
        failure = one_line(e)
    if failure is not None:
        raise BadInput(f"{s.cfg.model}: ONNX Runtime cannot run the original on the gate's "
                       f"feeds (batches of 1 to 3, padded masks): {failure}")
    notes: list[str] = []
    for c in planned.kept[1:]:
        s.say(f"building {c.name} (rewrite + accuracy gate)")
        try:
            built[c.name] = build_padded(s.model, s.shape, s.root, c, gate, s.cfg.cache_policy)
        except Exception as e:  # noqa: BLE001 - a failure inside one variant is its refusal
            notes.append(f"skipped {c.name}: {one_line(e)}")
    cpu = get_backend("ort-cpu")
    for c in planned.fused:
        if c.base not in built:
            continue
        s.say(f"building {c.name} (ONNX Runtime fusions + accuracy gate)")
        try:
            built[c.name] = build_fused(built[c.base], s.root, c, s.shape, gate, cpu, s.settings)
        except Exception as e:  # noqa: BLE001 - a failure inside one variant is its refusal
            notes.append(f"skipped {c.name}: {one_line(e)}")
    return built, gate, notes


def load_stage(s: Setup, built: dict[str, Built], gate: GateCheck, shas: Mapping[str, str]
               ) -> tuple[dict[str, Built], list[Target], list[str]]:
    """Every built variant's session, for interleaved timing, while they fit in memory: the
    original always, then in plan order (tuner/runtime/memory.py). A variant left out has its
    folder removed, so the artifact holds only what the manifest lists. On a GPU backend each
    is gated again as that backend runs it."""
    say, backend = s.say, s.backend
    say(f"loading {len(built)} variant(s) on {backend.name}")
    # engines and timing caches go where `tuner serve` looks for them: OUT/cache/<backend>
    engine_dir = None if backend.name == "ort-cpu" else s.root / "cache" / backend.name
    grid = _grid(s, s.workload.traffic.seq_grid)
    items = [(n, b.path, model_bytes(b.path)) for n, b in built.items()]
    loaded, notes = load_fitting(
        items, lambda n, path: backend.load(path, s.settings, grid, engine_dir))
    kept = {n for n, _ in loaded}
    for n, b in built.items():
        if n not in kept:
            shutil.rmtree(b.path.parent, ignore_errors=True)
    built = {n: built[n] for n, _ in loaded}  # a variant left out is not reported
    targets = s.workload.wrap([Target(n, runner, shas[n]) for n, runner in loaded],
                              {n: b.path for n, b in built.items()})
    if backend.name != "ort-cpu":
        built, gate_notes = _gate_on_backend(built, targets, gate.at_precision(backend.precision),
                                             backend.name)
        notes += gate_notes
    return built, targets, notes


def _gate_on_backend(built, targets, gate: GateCheck, backend: str):
    """Gate every variant again as the measured backend runs it (fp16 conversion, TensorRT
    tactics), against the original on the CPU: a variant exact on the CPU can still be off on
    the backend, and it must then not be selected."""
    gated, notes = dict(built), []
    for t in targets:
        raw = t.runner.runner if isinstance(t.runner, WidenedRunner) else t.runner
        # the graph, not the widened map alone: a half-precision original's float check
        # runs the variant's float copy (tuner.gate.float_reference)
        acc = accuracy_of(gate.check(raw, built[t.name].path))
        gated[t.name] = replace(built[t.name], accuracy=acc)
        if not acc.passed:
            notes.append(f"{t.name} failed the accuracy gate on {backend}: {acc.detail}")
    return gated, notes


def _grid(s: Setup, lengths) -> list[Shape]:
    return [(b, q) for b in s.workload.traffic.batch for q in lengths]


@dataclass(frozen=True)
class Compared:
    phases: tuple[Phase, ...]
    measured: Mapping[str, Measurements]  # by phase name
    speedups: Mapping[str, Any]  # variant -> RatioCI (the workload's rule)
    selection: Selection


def compare_stage(s: Setup, built: Mapping[str, Built], targets: list[Target]) -> Compared:
    phases = s.workload.phases(s.selection)
    measured = {}
    for i, ph in enumerate(phases):
        what = "comparing variants" + (f" ({ph.name} steps)" if i else "")
        measured[ph.name] = s.measure(targets, list(ph.compare_at), ph.feeds, s.cfg.rounds,
                                      s.cfg.warmup, ph.settings, what)
    speedups = s.workload.speedups(measured, list(built), phases)
    sel = select(speedups, s.cfg.margin,
                 eligible=lambda n: built[n].exact and built[n].accuracy.passed)
    return Compared(phases, measured, speedups, sel)


@dataclass(frozen=True)
class Timed:
    measured: Mapping[str, Measurements]  # the winner on each phase's grid, by phase name
    latency: Mapping[str, Mapping[Shape, float]]  # by phase: grid shape -> ms
    choices: Mapping[str, BucketChoice]  # by phase


def grid_stage(s: Setup, winner: Target, phases: tuple[Phase, ...]) -> Timed:
    """The winner on every phase's bucket grid; the buckets chosen for each phase's requests."""
    measured, latency, choices = {}, {}, {}
    batch = s.workload.traffic.batch
    for i, ph in enumerate(phases):
        grid = _grid(s, ph.grid)
        what = f"timing {winner.name} " + ("on the bucket grid" if i == 0
                                           else f"{ph.name} steps on the cache grid")
        m = s.measure([winner], grid, ph.feeds, s.cfg.bucket_rounds, 1, ph.settings, what)
        # the median of >= 3 rounds shrugs off one hiccup; with fewer, the minimum does
        # (noise on a busy machine only ever adds time)
        lat = {g: (st.median if st.n >= 3 else float(m.samples[(winner.name, g)].min()))
               for g in grid for st in [m.stats(winner.name, g)]}
        measured[ph.name], latency[ph.name] = m, lat
        choices[ph.name] = choose(ph.requests, lat, batch, ph.grid, s.cfg.max_buckets)
    return Timed(measured, latency, choices)


def keep_stage(s: Setup, built: Mapping[str, Built], winner: str) -> tuple[Built | None, list[str]]:
    """A generating decoder's winner as the server should run it (variants.build_kept: its LM
    head cut, its own positions), or None and why; on ort-cpu only (its gate's backend)."""
    why = f"serving {winner} as it is"
    if not s.workload.generates:
        return None, []
    if s.backend.name != "ort-cpu":
        return None, [f"{why}: the LM head cut is made on ort-cpu only, not {s.backend.name}"]
    s.say(f"cutting {winner}'s LM head to the positions a step reads (accuracy gate)")
    gate = prepare(s.model, lambda: load_reference(built["original"].path, s.settings),
                   vocab=s.vocab, tolerance=s.tolerance)
    try:
        return build_kept(built[winner], gate, get_backend("ort-cpu"), s.settings), []
    except Exception as e:  # noqa: BLE001 - the winner is served as it is, with the reason
        return None, [f"{why}: {one_line(e)}"]
    finally:
        gate.close()


def _variant_shape(b: Built, source_shape: ModelShape) -> tuple[dict, str]:
    """`tuner inspect` of a built variant; if inspect cannot read it (fused graphs are the
    likely case), the source's shape with the pads applied, and a note saying so."""
    try:
        return inspect_path(b.path).to_json(), b.note
    except Exception as e:  # noqa: BLE001 - a variant that inspect misreads is still measured
        pads = {BY_KIND[t.kind].field: t.new for t in b.transforms if t.kind in BY_KIND}
        note = f"inspect failed on this variant ({type(e).__name__}); shape derived from the source"
        return replace(source_shape, **pads).to_json(), "; ".join(x for x in (b.note, note) if x)


def _lat(stats) -> Latency:
    return Latency(stats.median, stats.p10, stats.p90, stats.q1, stats.q3, stats.n)


def _variants(s: Setup, built: Mapping[str, Built], c: Compared, t: Timed,
              kept: Built | None) -> list[Variant]:
    """Each variant's record: latencies of every phase where variants were compared, and the
    winner's on the whole grid too (its cut, `kept`, carries them: measured before the cut)."""
    first, winner = c.phases[0], c.selection.name
    out = []
    for n, b in built.items():
        lat: dict[str, dict[str, Latency]] = {}
        for ph in c.phases:
            field = lat.setdefault(ph.latency_field, {})
            field.update({ph.key(*g): _lat(c.measured[ph.name].stats(n, g)) for g in ph.compare_at})
            if n == winner:
                grid = t.measured[ph.name]
                field.update({ph.key(*g): _lat(grid.stats(n, g)) for g in _grid(s, ph.grid)
                              if ph.key(*g) not in field})
        vshape, vnote = _variant_shape(b, s.shape) if n != "original" else (s.shape.to_json(), b.note)
        out.append(Variant(
            name=n, path=b.rel, exact=b.exact, transforms=b.transforms, shape=vshape,
            accuracy=b.accuracy, speedup=speed(c.speedups[n]) if n in c.speedups else None,
            speedup_by_shape={ph: speed(c.measured[first.name].speedup_at(n, g))
                              for g in first.compare_at for ph in [first.key(*g)]}
            if n != "original" else {}, note=vnote, **lat))
    if kept is not None:
        base = next(v for v in out if v.name == winner)
        out.append(replace(base, name=kept.name, path=kept.rel, transforms=kept.transforms,
                           accuracy=kept.accuracy, note=f"{kept.note}; timed as {winner}"))
    return out


def write_stage(s: Setup, built, c: Compared, t: Timed, advice, notes: list[str],
                source_sha: str, kept: Built | None = None) -> Manifest:
    first = c.phases[0]
    main = t.choices[first.name]
    req = first.requests
    by_field = {ph.bucket_field: t.choices[ph.name].seq for ph in c.phases[1:]}
    sel, reason = (c.selection.name, c.selection.reason) if kept is None else (
        kept.name, f"{c.selection.reason}; served as {kept.name}: {kept.note}, exact (gate)")
    manifest = Manifest(
        source_path=str(s.cfg.model.resolve()), source_sha256=source_sha,
        device=s.info.to_json(), backend=s.backend.name, settings=asdict(s.settings),
        selected=sel,
        buckets=Buckets(tuple(main.batch), tuple(main.seq),
                        ExpectedLatency(main.expected_ms, main.pad_to_max_ms, main.no_buckets_ms),
                        req.source, req.count, tuple(by_field.get("past", ()))),
        variants=tuple(_variants(s, built, c, t, kept)), selection=reason,
        margin=s.cfg.margin, notes=tuple(notes), advice=advice, roles=role_overrides() or None,
        **s.workload.manifest_parts((kept or built[sel]).path, sel, s.cfg.cache_policy, c.phases))
    write_manifest(s.root, manifest)
    write_report(s.root, manifest, req=req, grid_latency=t.latency[first.name],
                 coverage=main.coverage, phases=s.workload.phase_rows(manifest),
                 with_plots=s.cfg.plots)
    section = s.workload.report_section(manifest)
    if section:  # the workload's own part (a decoder's: both phases side by side)
        with open(s.root / "report.md", "a", encoding="utf-8") as f:
            f.write(section)
    return manifest


def run_pipeline(cfg, model: ir.Model, root: Path, source: Path | None = None,
                 notes: tuple[str, ...] = ()) -> tuple[Manifest, list[str]]:
    notes = list(notes)  # what came before: the note of a full-cache copy (jobs.optimize)
    s = setup(cfg, model, root, notes, source or cfg.model)
    source_sha = sha256_file(cfg.model)
    planned = plan_stage(s, source_sha)
    notes += planned.notes
    built, gate, build_notes = build_stage(s, planned)
    notes += build_notes
    # hash before loading: a backend may write engines, which must not change the cache key
    shas = {n: sha256_files(graph_files(b)) for n, b in built.items()}
    built, targets, load_notes = load_stage(s, built, gate, shas)
    notes += load_notes
    gate.close()
    compared = compare_stage(s, built, targets)
    winner = next(t for t in targets if t.name == compared.selection.name)
    del targets  # release the other sessions before the bucket grid
    timed = grid_stage(s, winner, compared.phases)
    cached = sum(len(m.cached_shapes) for ms in (compared.measured, timed.measured)
                 for m in ms.values())
    notes += [f"{cached} shape(s) taken from the results cache"] if cached else []
    del winner  # its session: the cut is gated on sessions of its own
    kept, keep_notes = keep_stage(s, built, compared.selection.name)
    notes += keep_notes
    manifest = write_stage(s, built, compared, timed, planned.advice, notes, source_sha, kept)
    return manifest, notes
