"""The steps of `tuner optimize` in order, writing into a (temporary) artifact folder.

    inspect -> plan (+ GEMM probe) -> build variants (rewrite + gate) -> compare variants
    (interleaved, paired CIs) -> select -> time the winner on the bucket grid -> buckets
    -> manifest + report
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from tuner.artifact import (Buckets, ExpectedLatency, Latency, Manifest, Speedup, Variant,
                            shape_key, write_manifest)
from tuner.errors import BadInput


def _say(enabled: bool) -> Callable[[str], None]:
    import time

    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if enabled:
            print(f"tuner: [{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)
    return say


def _traffic(cfg, positions):
    """(requests, seq grid, batch buckets, note)."""
    from tuner.buckets import (batch_buckets, default_seq_buckets, load_requests, seq_grid,
                               uniform_requests)
    from tuner.optimize import DEFAULT_MAX_SEQ

    if cfg.requests is not None:
        req = load_requests(cfg.requests)
        limit = cfg.max_seq or positions
        return req, seq_grid(req, limit), batch_buckets(max(req.max_batch, 1)), None
    note = None
    if cfg.max_seq:
        top = cfg.max_seq
        if positions and top > positions:
            raise BadInput(f"--max-seq {top} is longer than the model's {positions} positions")
    elif positions:
        top = min(positions, 512)
        if positions > 512:
            note = f"sequence buckets capped at 512 of the model's {positions} positions (--max-seq)"
    else:
        top = DEFAULT_MAX_SEQ
        note = f"no position table found: sequence buckets up to {top} (--max-seq to change)"
    grid = default_seq_buckets(top)
    if len(grid) > 8:
        grid = tuple(grid[i] for i in sorted({round(k * (len(grid) - 1) / 7) for k in range(8)}))
    return uniform_requests(top), grid, batch_buckets(cfg.max_batch), note


def _selection_shapes(req, grid, batch) -> list[tuple[int, int]]:
    """Where variants are compared: the most common batch bucket at the bucket of the median
    length (one shape keeps a 12-layer model's comparison within a minute on 2 cores; the
    winner is then timed on the whole bucket grid)."""
    from tuner.buckets import _bucket_of

    by_batch: dict[int, float] = {}
    for (b, _), w in req.weights.items():
        bb = _bucket_of(b, batch)
        by_batch[bb] = by_batch.get(bb, 0.0) + w
    b = max(by_batch, key=by_batch.get)
    seqs = sorted({_bucket_of(req.seq_quantile(q), grid) for q in (0.5,)})
    return [(b, s) for s in seqs]


def _probe_backend(backend_name: str) -> str:
    """torch-cuda when the variants are timed on a GPU backend and torch sees the GPU."""
    from tuner.probe import backend_unavailable

    if backend_name != "ort-cpu" and backend_unavailable("torch-cuda") is None:
        return "torch-cuda"
    return "ort-cpu"


def _cached_probe(cache, key_parts, threads, backend: str = "ort-cpu"):
    """The GEMM probe through the results cache: a rerun plans the same candidates (and so
    finds its variants' timings in the cache) instead of re-probing into other noise."""
    from tuner.cache import entry_key
    from tuner.probe import probe

    rounds = 5

    def fn(gemms):
        key = entry_key(*key_parts, (0, 0), {"probe": [g.describe() + g.label for g in gemms],
                                              "threads": threads, "samples": "per-round"},
                        rounds, 1)
        hit = cache.get(key)
        if hit is not None and len(hit.samples_ms) == len(gemms) * rounds:
            flat = list(hit.samples_ms)
        else:  # per-round samples, so predictions carry their own noise (plan.predict)
            results = probe(gemms, backend, rounds=rounds, warmup=1, threads=threads)
            flat = [t for r in results for t in r.samples_ms]
            cache.put_group({key: tuple(flat)}, "probe")
        return [flat[i * rounds:(i + 1) * rounds] for i in range(len(gemms))]
    return fn


def _plan(cfg, shape, facts, sel_shape, threads, say, probe_fn):
    from tuner import plan

    cands = plan.propose(shape, facts)
    notes: list[str] = []
    if len(cands) > 1 and cfg.probe:
        say(f"probing {len(cands) - 1} candidate dims with the model's GEMMs at "
            f"M = {sel_shape[0]}x{sel_shape[1]}")
        cands = plan.predict(shape, cands, sel_shape[0], sel_shape[1], probe_fn)
    elif len(cands) > 1:
        notes.append("GEMM probe skipped (--no-probe): candidates kept unranked")
    pad_room = cfg.max_variants - (2 if cfg.fuse and cfg.max_variants >= 3 else 1)
    kept, dropped = plan.prune(cands, pad_room + 1)
    notes += dropped
    fused = []
    if cfg.fuse and cfg.max_variants >= 2:
        fused.append(plan.with_fusion(kept[0]))
        if len(kept) > 1 and len(kept) + 2 <= cfg.max_variants:
            fused.append(plan.with_fusion(kept[1]))
    return kept, fused, notes


def _advise(cfg, shape, sel_shape, threads, say, pb: str = "ort-cpu"):
    from tuner.advise import measure_advice
    from tuner.artifact import Advice
    from tuner.probe import probe

    say("measuring retrain advice (non-exact reshapes, GEMM level, random weights)")
    found = measure_advice(shape, sel_shape[0], sel_shape[1],
                           lambda g, rounds: probe(g, pb, rounds=rounds, warmup=1,
                                                   threads=threads), rounds=cfg.rounds)
    return tuple(Advice(a.name, a.transforms, a.speedup, a.note) for a in found)


def _gate_on_backend(built, targets, feeds, tol, backend, settings):
    """Gate every variant again as the measured backend runs it (fp16 conversion, TensorRT
    tactics), against the original on the CPU: a variant exact on the CPU can still be off on
    the backend, and it must then not be selected."""
    from dataclasses import replace

    from tuner.runtime.registry import get_backend
    from tuner.variants import accuracy_of
    from tuner.verify import Tolerance, verify

    reference = get_backend("ort-cpu").load(built["original"].path, settings)
    tolerance = Tolerance.fp16() if backend.precision == "fp16" else tol
    gated, notes = dict(built), []
    for t in targets:
        acc = accuracy_of(verify(reference, t.runner, feeds, tolerance))
        gated[t.name] = replace(built[t.name], accuracy=acc)
        if not acc.passed:
            notes.append(f"{t.name} failed the accuracy gate on {backend.name}: {acc.detail}")
    return gated, notes


def _load_targets(built, shas, backend, settings, shapes, engine_dir):
    """Every built variant's session, for interleaved timing, while they fit in memory: the
    original always, then in plan order (tuner/session_memory.py). A variant left out has its
    folder removed, so the artifact holds only what the manifest lists."""
    import shutil

    from tuner import bench
    from tuner.graph.size import model_bytes
    from tuner.session_memory import load_fitting

    items = [(n, b.path, model_bytes(b.path)) for n, b in built.items()]
    loaded, notes = load_fitting(
        items, lambda n, path: backend.load(path, settings, shapes, engine_dir))
    kept = {n for n, _ in loaded}
    for n, b in built.items():
        if n not in kept:
            shutil.rmtree(b.path.parent, ignore_errors=True)
    return [bench.Target(n, runner, shas[n]) for n, runner in loaded], notes


def _build(cfg, kept, fused, shape, root, feeds, tol, backend, settings, say):
    from tuner.variants import build_fused, build_padded, copy_original

    notes: list[str] = []
    built = {"original": copy_original(cfg.model, root)}
    for c in kept[1:]:
        say(f"building {c.name} (rewrite + accuracy gate)")
        try:
            built[c.name] = build_padded(cfg.model, root, c, feeds, tol)
        except BadInput as e:
            notes.append(f"skipped {c.name}: {e}")
    if fused:
        from tuner.runtime.registry import get_backend
        from tuner.verify import record_then_release

        cpu = get_backend("ort-cpu")
        # recorded, not kept loaded: the fused candidate's session is the only one while
        # it is gated (build_fused passes these same feeds to verify)
        reference = record_then_release(lambda: cpu.load(built["original"].path, settings), feeds)
        for c in fused:
            base_name = c.name.removesuffix("+fuse").removesuffix("fuse").rstrip("+") or "original"
            if base_name not in built:
                continue
            say(f"building {c.name} (ONNX Runtime fusions + accuracy gate)")
            try:
                built[c.name] = build_fused(built[base_name], root, c, shape, reference, feeds,
                                            tol, cpu, settings)
            except BadInput as e:
                notes.append(f"skipped {c.name}: {e}")
    return built, notes


def _variant_shape(b, source_shape) -> tuple[dict, str]:
    """`tuner inspect` of a built variant; if inspect cannot read it (fused graphs are the
    likely case), the source's shape with the pads applied, and a note saying so."""
    from dataclasses import replace

    from tuner.graph.inspect import inspect_path

    try:
        return inspect_path(b.path).to_json(), b.note
    except Exception as e:  # noqa: BLE001 - a variant that inspect misreads is still measured
        fields = {"ffn": "ffn_size", "vocab": "vocab_size", "head_dim": "head_dim", "heads": "num_heads"}
        pads = {fields[t.kind]: t.new for t in b.transforms if t.kind in fields}
        note = f"inspect failed on this variant ({type(e).__name__}); shape derived from the source"
        return replace(source_shape, **pads).to_json(), "; ".join(x for x in (b.note, note) if x)


def _lat(stats) -> Latency:
    return Latency(stats.median, stats.p10, stats.p90, stats.q1, stats.q3, stats.n)


def _speed(ci) -> Speedup:
    return Speedup(ci.ratio, ci.low, ci.high, ci.confidence)


def run_pipeline(cfg, model, root: Path):
    from tuner import bench
    from tuner.buckets import choose
    from tuner.cache import ResultsCache, file_sha256
    from tuner.device import detect
    from tuner.feeds import input_specs, make_feeds
    from tuner.graph.inspect import inspect_model
    from tuner.optimize import max_positions, sha256_file
    from tuner.rewrite.compose import vocab_for_feeds
    from tuner.runtime.base import SessionSettings
    from tuner.runtime.registry import resolve
    from tuner.variants import graph_files
    from tuner.verify import Tolerance

    say = _say(cfg.progress)
    info = detect()
    facts = info.facts()
    say(f"inspecting {cfg.model.name}")
    shape = inspect_model(model, device=info.facts_key or ("h100" if info.kind == "gpu" else "cpu"))
    vocab, positions, specs = vocab_for_feeds(model, shape), max_positions(model, shape), input_specs(model)
    backends, notes = resolve(cfg.backend)
    backend = next((b for b in backends if b.name != "ort-cpu"), backends[0])
    notes += [f"backend {b.name} usable but not measured (only {backend.name} is)"
              for b in backends if b is not backend]
    threads = cfg.threads or info.cpu_cores
    try:
        settings = SessionSettings(intra_op_threads=threads, inter_op_threads=1,
                                   graph_optimization=cfg.graph_optimization)
        tol = Tolerance(cfg.atol, cfg.rtol)
    except ValueError as e:
        raise BadInput(str(e)) from None
    req, grid, batch, note = _traffic(cfg, positions)
    notes += [note] if note else []
    sel_shapes = _selection_shapes(req, grid, batch)
    source_sha = sha256_file(cfg.model)
    dev_key = f"{info.label}|{backend.name}"
    cache = ResultsCache.in_dir(cfg.cache_dir)
    pb = _probe_backend(backend.name)
    probe_fn = _cached_probe(cache, (source_sha, f"probe:{pb}", dev_key), threads, pb)
    kept, fused, plan_notes = _plan(cfg, shape, facts, sel_shapes[0], threads, say, probe_fn)
    notes += plan_notes
    advice = _advise(cfg, shape, sel_shapes[0], threads, say, pb) if cfg.advise else ()
    top = grid[-1]
    verify_shapes = sorted({(b, min(s, top)) for b, s in ((1, 7), (2, 16), (3, 33))})
    feeds = make_feeds(specs, vocab, verify_shapes)
    built, build_notes = _build(cfg, kept, fused, shape, root, feeds, tol, backend, settings, say)
    notes += build_notes

    say(f"loading {len(built)} variant(s) on {backend.name}")
    all_shapes = [(b, s) for b in batch for s in grid]
    # hash before loading: a backend may write engines, which must not change the cache key
    shas = {n: file_sha256(graph_files(b)) for n, b in built.items()}
    # engines and timing caches go where `tuner serve` looks for them: OUT/cache/<backend>
    engine_dir = None if backend.name == "ort-cpu" else root / "cache" / backend.name
    targets, fit_notes = _load_targets(built, shas, backend, settings, all_shapes, engine_dir)
    notes += fit_notes
    built = {t.name: built[t.name] for t in targets}  # a variant left out is not reported
    if backend.name != "ort-cpu":
        built, gate_notes = _gate_on_backend(built, targets, feeds, tol, backend, settings)
        notes += gate_notes
    feed_cache: dict = {}

    def feeds_for(s):
        if s not in feed_cache:
            feed_cache[s] = make_feeds(specs, vocab, [s], seed=1)[0]
        return feed_cache[s]

    sjson = asdict(settings)
    with bench.rich_progress(cfg.progress, "comparing variants") as p:
        meas = bench.measure(targets, sel_shapes, feeds_for, cfg.rounds, cfg.warmup, cache,
                             backend.name, dev_key, sjson, p)
    weights = {s: 1.0 for s in sel_shapes}
    speedups = {n: meas.speedup(n, weights) for n in built if n != "original"}
    sel = bench.select(speedups, cfg.margin,
                       eligible=lambda n: built[n].exact and built[n].accuracy.passed)
    winner = next(t for t in targets if t.name == sel.name)
    targets = [winner]  # release the other sessions before the bucket grid
    with bench.rich_progress(cfg.progress, f"timing {sel.name} on the bucket grid") as p:
        gmeas = bench.measure([winner], all_shapes, feeds_for, cfg.bucket_rounds, 1, cache,
                              backend.name, dev_key, sjson, p)
    # the median of >= 3 rounds shrugs off one hiccup; with fewer, the minimum does (noise on
    # a busy machine only ever adds time)
    grid_lat = {s: (st.median if st.n >= 3 else float(gmeas.samples[(sel.name, s)].min()))
                for s in all_shapes for st in [gmeas.stats(sel.name, s)]}
    choice = choose(req, grid_lat, batch, grid, cfg.max_buckets)
    notes += [f"{len(meas.cached_shapes) + len(gmeas.cached_shapes)} shape(s) taken from the "
              "results cache"] if meas.cached_shapes or gmeas.cached_shapes else []

    variants = []
    for n, b in built.items():
        lat = {shape_key(*s): _lat(meas.stats(n, s)) for s in sel_shapes}
        if n == sel.name:
            lat.update({shape_key(*s): _lat(gmeas.stats(n, s)) for s in all_shapes
                        if shape_key(*s) not in lat})
        vshape, vnote = _variant_shape(b, shape) if n != "original" else (shape.to_json(), b.note)
        variants.append(Variant(
            name=n, path=b.rel, exact=b.exact, transforms=b.transforms, shape=vshape,
            accuracy=b.accuracy, latency=lat,
            speedup=_speed(speedups[n]) if n in speedups else None,
            speedup_by_shape={shape_key(*s): _speed(meas.speedup_at(n, s)) for s in sel_shapes}
            if n != "original" else {}, note=vnote))
    manifest = Manifest(
        source_path=str(cfg.model.resolve()), source_sha256=source_sha,
        device=info.to_json(), backend=backend.name, settings=sjson, selected=sel.name,
        buckets=Buckets(tuple(choice.batch), tuple(choice.seq),
                        ExpectedLatency(choice.expected_ms, choice.pad_to_max_ms, choice.no_buckets_ms),
                        req.source, req.count),
        variants=tuple(variants), selection=sel.reason, margin=cfg.margin, notes=tuple(notes),
        advice=advice)
    write_manifest(root, manifest)
    from tuner.report import write_report

    write_report(root, manifest, req=req, grid_latency=grid_lat, coverage=choice.coverage)
    return manifest, notes
