"""The steps of `tuner optimize` in order, writing into a (temporary) artifact folder.

    inspect -> plan (+ GEMM probe) -> build variants (rewrite + gate) -> compare variants
    (interleaved, paired CIs) -> select -> time the winner on the bucket grid -> buckets
    -> manifest + report

The model is loaded once (by tuner.jobs.optimize); each padded variant is a rewrite of a copy
of it, and every variant is gated against one reference session of the original.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from tuner.artifact.codec import manifest_to_json
from tuner.artifact.records import (Advice, Buckets, ExpectedLatency, Latency, Manifest, Speedup,
                                    Variant, shape_key)
from tuner.artifact.report import write_report
from tuner.artifact.store import write_manifest
from tuner.errors import BadInput
from tuner.gate.feeds import make_feeds
from tuner.graph.cache_record import cache_record
from tuner.gate.kv_gate import WidenedRunner, cache_feeds, check, has_cache
from tuner.gate.verify import Tolerance, record_then_release
from tuner.graph.inspect import inspect_model, inspect_path
from tuner.graph.io import max_positions, model_bytes, model_precision, vocab_for_feeds
from tuner.graph.kv_cache import widened_cache
from tuner.graph.load import load_model
from tuner.graph.paddable import BY_KIND
from tuner.graph.roles import accepted_shapes, batch_limit, input_specs, seq_limit
from tuner.hardware.detect import detect
from tuner.jobs.decoder import (RULE, cache_section, combined_totals, decode_feeds_for, decode_key,
                                decode_shape, decoder_traffic, phase_rows, prefill_feeds_for,
                                report_section)
from tuner.jobs.pad import load_reference
from tuner.jobs.variants import accuracy_of, build_fused, build_padded, copy_original, graph_files
from tuner.measure import bench
from tuner.measure.buckets import (batch_buckets, bucket_of, choose, default_seq_buckets,
                                   load_requests, seq_grid, uniform_requests)
from tuner.measure.cache import ResultsCache, device_key, entry_key
from tuner.measure.select import select
from tuner.measure.stats import paired_ratio_ci
from tuner.plan import propose as plan
from tuner.plan.advise import measure_advice
from tuner.plan.findings import audited
from tuner.plan.probe import backend_unavailable, probe
from tuner.runtime.base import SessionSettings
from tuner.runtime.memory import load_fitting
from tuner.runtime.registry import get_backend, resolve
from tuner.util.files import sha256_file, sha256_files
from tuner.util.progress import rich_progress

DEFAULT_MAX_SEQ = 256  # without a requests file or --max-seq, and no position table found


def _say(enabled: bool) -> Callable[[str], None]:
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        if enabled:
            print(f"tuner: [{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)
    return say


def _traffic(cfg, positions, specs=()):
    """(requests, seq grid, batch buckets, note), limited to the shapes the model takes: a
    batch-1 export gets batch bucket [1], a fully static one its one length."""
    req, grid, batch, note = _traffic_wanted(cfg, positions)
    b_fix, s_fix = batch_limit(specs), seq_limit(specs)
    notes = [note] if note else []
    if b_fix is not None:
        if tuple(batch) != (b_fix,):
            notes.append(f"the model takes batch {b_fix} only: batch buckets [{b_fix}]")
        batch = (b_fix,)
    if s_fix is not None:
        if tuple(grid) != (s_fix,):
            notes.append(f"the model takes sequence length {s_fix} only: sequence buckets "
                         f"[{s_fix}]")
        grid = (s_fix,)
    if b_fix is not None or s_fix is not None:
        weights: dict = {}
        for (b, s), w in req.weights.items():
            shape = (b_fix or b, s_fix or s)
            weights[shape] = weights.get(shape, 0.0) + w
        req = replace(req, weights=weights)
    return req, grid, batch, "; ".join(notes) or None


def _traffic_wanted(cfg, positions):
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
    by_batch: dict[int, float] = {}
    for (b, _), w in req.weights.items():
        bb = bucket_of(b, batch)
        by_batch[bb] = by_batch.get(bb, 0.0) + w
    b = max(by_batch, key=by_batch.get)
    seqs = sorted({bucket_of(req.seq_quantile(q), grid) for q in (0.5,)})
    return [(b, s) for s in seqs]


def _probe_backend(backend_name: str) -> str:
    """torch-cuda when the variants are timed on a GPU backend and torch sees the GPU."""
    if backend_name != "ort-cpu" and backend_unavailable("torch-cuda") is None:
        return "torch-cuda"
    return "ort-cpu"


def probe_dtype(precision: str) -> str:
    """The GEMM probe's dtype for a backend of `precision`: fp32 backends are ranked on fp32
    timings, never on fp16 ones (which tensor cores make a different story)."""
    return {"fp16": "fp16", "bf16": "bf16"}.get(precision, "fp32")


def _cached_probe(cache, key_parts, threads, backend: str = "ort-cpu", dtype: str = "fp32"):
    """The GEMM probe through the results cache: a rerun plans the same candidates (and so
    finds its variants' timings in the cache) instead of re-probing into other noise."""
    rounds = 5

    def fn(gemms):
        key = entry_key(*key_parts, (0, 0), {"probe": [g.describe() + g.label for g in gemms],
                                              "threads": threads, "samples": "per-round",
                                              "dtype": dtype},
                        rounds, 1)
        hit = cache.get(key)
        if hit is not None and len(hit.samples_ms) == len(gemms) * rounds:
            flat = list(hit.samples_ms)
        else:  # per-round samples, so predictions carry their own noise (plan.predict)
            results = probe(gemms, backend, rounds=rounds, warmup=1, threads=threads,
                            dtype=dtype)
            flat = [t for r in results for t in r.samples_ms]
            cache.put_group({key: tuple(flat)}, "probe")
        return [flat[i * rounds:(i + 1) * rounds] for i in range(len(gemms))]
    return fn


def _plan(cfg, shape, facts, sel_shape, threads, say, probe_fn):
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


def _advise(cfg, shape, sel_shape, threads, say, pb: str = "ort-cpu", dtype: str = "fp32"):
    say("measuring retrain advice (non-exact reshapes, GEMM level, random weights)")
    found = measure_advice(shape, sel_shape[0], sel_shape[1],
                           lambda g, rounds: probe(g, pb, rounds=rounds, warmup=1,
                                                   threads=threads, dtype=dtype),
                           rounds=cfg.rounds)
    return tuple(Advice(a.name, a.transforms, _speed(a.speedup), a.note) for a in found)


def _gate_on_backend(built, targets, reference, feeds, tol, backend, specs=None):
    """Gate every variant again as the measured backend runs it (fp16 conversion, TensorRT
    tactics), against the original on the CPU: a variant exact on the CPU can still be off on
    the backend, and it must then not be selected."""
    tolerance = tol.at_precision("fp16") if backend.precision == "fp16" else tol
    gated, notes = dict(built), []
    for t in targets:
        raw = t.runner.runner if isinstance(t.runner, WidenedRunner) else t.runner
        widened = t.runner.widened if isinstance(t.runner, WidenedRunner) else {}
        acc = accuracy_of(check(reference, raw, feeds, tolerance, widened, specs))
        gated[t.name] = replace(built[t.name], accuracy=acc)
        if not acc.passed:
            notes.append(f"{t.name} failed the accuracy gate on {backend.name}: {acc.detail}")
    return gated, notes


def _load_targets(built, shas, backend, settings, shapes, engine_dir):
    """Every built variant's session, for interleaved timing, while they fit in memory: the
    original always, then in plan order (tuner/runtime/memory.py). A variant left out has its
    folder removed, so the artifact holds only what the manifest lists."""
    items = [(n, b.path, model_bytes(b.path)) for n, b in built.items()]
    loaded, notes = load_fitting(
        items, lambda n, path: backend.load(path, settings, shapes, engine_dir))
    kept = {n for n, _ in loaded}
    for n, b in built.items():
        if n not in kept:
            shutil.rmtree(b.path.parent, ignore_errors=True)
    return [bench.Target(n, runner, shas[n]) for n, runner in loaded], notes


def _build(model, kept, fused, shape, root, built, reference, feeds, tol, settings, say,
           cache_policy="keep", specs=None):
    """Every planned variant beside the original already in `built`: padded ones from copies
    of `model`, fused ones from a built variant; each gated against `reference`."""
    notes: list[str] = []
    for c in kept[1:]:
        say(f"building {c.name} (rewrite + accuracy gate)")
        try:
            built[c.name] = build_padded(model, shape, root, c, reference, feeds, tol,
                                         cache_policy, specs)
        except BadInput as e:
            notes.append(f"skipped {c.name}: {e}")
    if fused:
        cpu = get_backend("ort-cpu")
        for c in fused:
            base_name = c.name.removesuffix("+fuse").removesuffix("fuse").rstrip("+") or "original"
            if base_name not in built:
                continue
            say(f"building {c.name} (ONNX Runtime fusions + accuracy gate)")
            try:
                built[c.name] = build_fused(built[base_name], root, c, shape, reference, feeds,
                                            tol, cpu, settings, specs)
            except BadInput as e:
                notes.append(f"skipped {c.name}: {e}")
    return built, notes


def _variant_shape(b, source_shape) -> tuple[dict, str]:
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


def _speed(ci) -> Speedup:
    return Speedup(ci.ratio, ci.low, ci.high, ci.confidence)


def run_pipeline(cfg, model, root: Path):
    say = _say(cfg.progress)
    info = detect()
    facts = info.facts()
    say(f"inspecting {cfg.model.name}")
    device = info.facts_key or ("h100" if info.kind == "gpu" else "cpu")
    shape = audited(inspect_model(model), device=device)
    vocab, positions = vocab_for_feeds(model, shape), max_positions(model, shape)
    specs = input_specs(model)
    roles = cache_record(model) if has_cache(model) else None  # a decoder with a KV cache
    precision = model_precision(model)
    backends, notes = resolve(cfg.backend)
    backend = next((b for b in backends if b.name != "ort-cpu"), backends[0])
    notes += [f"backend {b.name} usable but not measured (only {backend.name} is)"
              for b in backends if b is not backend]
    threads = cfg.threads or info.cpu_cores
    try:
        settings = SessionSettings(intra_op_threads=threads, inter_op_threads=1,
                                   graph_optimization=cfg.graph_optimization)
        tol = Tolerance(cfg.atol, cfg.rtol).at_precision(precision)
    except ValueError as e:
        raise BadInput(str(e)) from None
    dt = None
    if roles is not None:  # prompts and decode steps (tuner.jobs.decoder)
        dt = decoder_traffic(cfg.requests, cfg.max_seq, cfg.max_batch, positions)
        req, grid, batch, note = dt.prompts, dt.prompt_grid, dt.batch, dt.note
    else:
        req, grid, batch, note = _traffic(cfg, positions, specs)
    notes += [note] if note else []
    sel_shapes = _selection_shapes(req, grid, batch)
    source_sha = sha256_file(cfg.model)
    dev_key = device_key(info, backend.name)
    cache = ResultsCache.in_dir(cfg.cache_dir)
    pb = _probe_backend(backend.name)
    pdtype = probe_dtype(backend.precision)
    probe_fn = _cached_probe(cache, (source_sha, f"probe:{pb}", dev_key), threads, pb, pdtype)
    kept, fused, plan_notes = _plan(cfg, shape, facts, sel_shapes[0], threads, say, probe_fn)
    notes += plan_notes
    advice = _advise(cfg, shape, sel_shapes[0], threads, say, pb, pdtype) if cfg.advise else ()
    top = grid[-1]
    verify_shapes = accepted_shapes(
        specs, sorted({(b, min(s, top)) for b, s in ((1, 7), (2, 16), (3, 33))}))
    feeds = (cache_feeds(roles, vocab) if roles is not None
             else make_feeds(specs, vocab, verify_shapes))
    built = {"original": copy_original(cfg.model, root)}
    # one reference for every gate below; for a plain model its outputs on `feeds` are recorded
    # and its session released, so that a big model's gates hold one session at a time
    original = built["original"].path
    reference = (load_reference(original, settings) if roles is not None else
                 record_then_release(lambda: load_reference(original, settings), feeds))
    built, build_notes = _build(model, kept, fused, shape, root, built, reference, feeds, tol,
                                settings, say, cfg.cache_policy, specs)
    notes += build_notes

    say(f"loading {len(built)} variant(s) on {backend.name}")
    all_shapes = [(b, s) for b in batch for s in grid]
    # hash before loading: a backend may write engines, which must not change the cache key
    shas = {n: sha256_files(graph_files(b)) for n, b in built.items()}
    # engines and timing caches go where `tuner serve` looks for them: OUT/cache/<backend>
    engine_dir = None if backend.name == "ort-cpu" else root / "cache" / backend.name
    targets, fit_notes = _load_targets(built, shas, backend, settings, all_shapes, engine_dir)
    notes += fit_notes
    built = {t.name: built[t.name] for t in targets}  # a variant left out is not reported
    if roles is not None:  # a widened cache interface is fed wider pasts (zeros in the new entries)
        widened = {n: widened_cache(load_model(b.path)) for n, b in built.items()}
        targets = [replace(t, runner=WidenedRunner(t.runner, widened[t.name]))
                   if widened[t.name] else t for t in targets]
    if backend.name != "ort-cpu":
        built, gate_notes = _gate_on_backend(built, targets, reference, feeds, tol, backend,
                                             specs)
        notes += gate_notes
    reference.close()
    feed_cache: dict = {}

    def feeds_for(s):
        if s not in feed_cache:
            feed_cache[s] = (prefill_feeds_for(roles, vocab, s) if roles is not None
                             else make_feeds(specs, vocab, [s], seed=1)[0])
        return feed_cache[s]

    sjson = asdict(settings)
    with rich_progress(cfg.progress, "comparing variants") as p:
        meas = bench.measure(targets, sel_shapes, feeds_for, cfg.rounds, cfg.warmup, cache,
                             backend.name, dev_key, sjson, p)
    weights = {s: 1.0 for s in sel_shapes}
    speedups = {n: meas.speedup(n, weights) for n in built if n != "original"}
    if dt is not None:  # decode measured apart; both phases weighed by tokens (decoder.RULE)
        dec_shapes = [decode_shape(dt, sel_shapes[0])]
        dsettings = {**sjson, "phase": "decode"}

        def dec_feeds(s):
            return decode_feeds_for(roles, vocab, s)
        with rich_progress(cfg.progress, "comparing variants (decode steps)") as p:
            dmeas = bench.measure(targets, dec_shapes, dec_feeds, cfg.rounds, cfg.warmup, cache,
                                  backend.name, dev_key, dsettings, p)

        def per_request(n):
            return combined_totals(meas.by_shape(n), dmeas.by_shape(n), dt.mean_output)
        speedups = {n: paired_ratio_ci(per_request("original"), per_request(n))
                    for n in built if n != "original"}
    sel = select(speedups, cfg.margin,
                 eligible=lambda n: built[n].exact and built[n].accuracy.passed)
    winner = next(t for t in targets if t.name == sel.name)
    targets = [winner]  # release the other sessions before the bucket grid
    with rich_progress(cfg.progress, f"timing {sel.name} on the bucket grid") as p:
        gmeas = bench.measure([winner], all_shapes, feeds_for, cfg.bucket_rounds, 1, cache,
                              backend.name, dev_key, sjson, p)
    # the median of >= 3 rounds shrugs off one hiccup; with fewer, the minimum does (noise on
    # a busy machine only ever adds time)
    grid_lat = {s: (st.median if st.n >= 3 else float(gmeas.samples[(sel.name, s)].min()))
                for s in all_shapes for st in [gmeas.stats(sel.name, s)]}
    choice = choose(req, grid_lat, batch, grid, cfg.max_buckets)
    dec_lat: dict = {}
    past_buckets: tuple[int, ...] = ()
    if dt is not None:
        dec_grid = [(b, s) for b in batch for s in dt.past_grid]
        with rich_progress(cfg.progress, f"timing {sel.name} decode steps on the cache grid") as p:
            dgmeas = bench.measure([winner], dec_grid, dec_feeds, cfg.bucket_rounds, 1, cache,
                                   backend.name, dev_key, dsettings, p)
        dgrid = {s: (st.median if st.n >= 3 else float(dgmeas.samples[(sel.name, s)].min()))
                 for s in dec_grid for st in [dgmeas.stats(sel.name, s)]}
        past_buckets = choose(dt.past, dgrid, batch, dt.past_grid, cfg.max_buckets).seq
        dec_lat = {n: {decode_key(*s): _lat(dmeas.stats(n, s)) for s in dec_shapes}
                   for n in built}
        dec_lat[sel.name].update({decode_key(*s): _lat(dgmeas.stats(sel.name, s))
                                  for s in dec_grid if decode_key(*s) not in dec_lat[sel.name]})
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
            if n != "original" else {}, note=vnote, latency_decode=dec_lat.get(n, {})))
    manifest = Manifest(
        source_path=str(cfg.model.resolve()), source_sha256=source_sha,
        device=info.to_json(), backend=backend.name, settings=sjson, selected=sel.name,
        buckets=Buckets(tuple(choice.batch), tuple(choice.seq),
                        ExpectedLatency(choice.expected_ms, choice.pad_to_max_ms, choice.no_buckets_ms),
                        req.source, req.count, past_buckets),
        variants=tuple(variants), selection=sel.reason, margin=cfg.margin, notes=tuple(notes),
        advice=advice,
        cache=(cache_section(shape.cache, built[sel.name].path, sel.name, cfg.cache_policy)
               if dt is not None else None),
        phases=({"rule": RULE, "mean_output_tokens": dt.mean_output,
                 "prefill": {"shapes": [shape_key(*s) for s in sel_shapes], "weight": 1.0,
                             "per": "request"},
                 "decode": {"shapes": [decode_key(*s) for s in dec_shapes],
                            "weight": dt.mean_output, "per": "generated token"}}
                if dt is not None else None))
    write_manifest(root, manifest)
    write_report(root, manifest, req=req, grid_latency=grid_lat, coverage=choice.coverage,
                 phases=phase_rows(manifest) if dt is not None else None)
    if dt is not None:  # the decoder section: both phases side by side
        with open(root / "report.md", "a", encoding="utf-8") as f:
            f.write(report_section(manifest_to_json(manifest)))
    return manifest, notes
