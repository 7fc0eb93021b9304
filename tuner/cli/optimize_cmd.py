"""`tuner optimize MODEL.onnx -o OUT` (or `--demo gpt2|bert|llama`): parsing and printing only;
the work is tuner.jobs.optimize."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from tuner.cli.app import app, roles_option, with_roles
from tuner.errors import BadInput

DEMOS = {"gpt2": ("gpt2", "awkward"), "bert": ("bert", "awkward"), "llama": ("llama", "awkward")}


def _demo_model(name: str) -> Path:
    if name not in DEMOS:
        raise BadInput(f"--demo must be one of {', '.join(DEMOS)}, not {name!r}")
    try:
        from models.build import cached
    except ImportError as e:  # pragma: no cover - models/ ships with the repository
        raise BadInput(f"--demo needs the reference-model builder (pip install -e '.[models]'): {e}")
    try:
        return cached(*DEMOS[name])
    except ImportError as e:
        raise BadInput(f"--demo builds its model with torch and transformers; install them "
                       f"with pip install -e '.[models]' ({e})") from None


@app.command()
@with_roles
def optimize(
    model: Optional[Path] = typer.Argument(None, help=(
        "the ONNX model to optimize, or an export folder: a decoder-only's (its model.onnx, "
        "in the folder or its onnx/, the tokenizer beside) or an encoder-decoder's (Optimum's "
        "encoder_model.onnx, decoder_model.onnx, decoder_with_past_model.onnx)")),
    out: Path = typer.Option(..., "-o", "--out", help="artifact folder to write"),
    demo: Optional[str] = typer.Option(None, help="optimize a built-in small model: gpt2, bert or llama"),
    backend: str = typer.Option("ort-cpu", help="backend to measure on: a name, or 'auto'"),
    requests: Optional[Path] = typer.Option(None, help=(
        'traffic to choose buckets for: JSONL, one {"batch": 1, "seq": 17} per request; '
        "CSV with a header naming a 'seq' (and optionally 'batch') column; or a JSON "
        'histogram {"seq": {"17": 120, "64": 30}, "batch": {"1": 9, "4": 1}} '
        "(default: lengths up to --max-seq equally likely, batches up to --max-batch)")),
    max_seq: Optional[int] = typer.Option(None, help="longest sequence to serve (default: the model's, capped at 512)"),
    max_batch: int = typer.Option(2, help="largest batch bucket without --requests (powers of two up to it)"),
    streams: int = typer.Option(1, help="decoders: streams the server decodes at once (its "
                                        "in-flight batch); variants' decode steps are compared "
                                        "at that batch, where a step's costs differ from one "
                                        "stream's"),
    rounds: int = typer.Option(7, help="interleaved timing rounds per shape when comparing variants"),
    warmup: int = typer.Option(2, help="untimed runs per variant and shape first"),
    bucket_rounds: int = typer.Option(3, help="timing rounds per shape on the bucket grid"),
    margin: float = typer.Option(0.03, help="a variant wins only if its whole CI is above 1 + margin"),
    max_variants: int = typer.Option(4, help="most variants built and measured, the original included"),
    max_buckets: int = typer.Option(4, help="most sequence buckets"),
    fuse: bool = typer.Option(True, help="also try ONNX Runtime's transformer fusions"),
    probe: bool = typer.Option(True, help="rank candidate dims with a GEMM probe first"),
    advise: bool = typer.Option(False, help="also measure non-exact reshapes (what a retrain would buy)"),
    threads: int = typer.Option(0, help="intra-op threads (0: the cores this process may use)"),
    graph_opt: str = typer.Option("all", help="ORT graph optimisation level: disable|basic|extended|all"),
    cache_policy: str = typer.Option(
        "keep", "--cache-policy", help="decoders with a KV cache, head-dim/head-count variants: "
        "keep (clients see the original cache shape) or widen (a wider cache interface, for a "
        "server that owns the cache; recorded in the manifest)"),
    atol: float = typer.Option(1e-4, help="accuracy gate: absolute tolerance"),
    rtol: float = typer.Option(1e-3, help="accuracy gate: relative tolerance"),
    cache_dir: Optional[Path] = typer.Option(None, help="results cache folder (default ~/.cache/shapetuner)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="measure everything again, store nothing"),
    force: bool = typer.Option(False, help="replace OUT if it exists"),
    as_json: bool = typer.Option(
        False, "--json", help="print the manifest (the same object as OUT/manifest.json) on "
                              "stdout instead of the summary"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
    plots: bool = typer.Option(True, help=(
        "draw the report's charts (report.html; a folder's timings.png) with matplotlib; "
        "--no-plots writes the tables alone, a second or so sooner, for a pipeline that "
        "reads manifest.json")),
    roles: list[str] = roles_option(),
) -> None:
    """Build exact padded variants, verify them, time them against the original in
    interleaved rounds, choose buckets for the traffic, and write the artifact folder.

    Given an encoder-decoder's export folder, each variant is the whole folder padded (every
    graph gated, its cache path checked) and timed on whole requests (encoder, first step,
    later steps; --streams sources at once, --max-seq source tokens, or a JSONL --requests
    with prompt_tokens and output_tokens); OUT is the selected folder, which `tuner serve OUT`
    serves, with selection.json, report.md and timings.png. Buckets, fusion and the GEMM
    probe are single-graph steps."""
    from tuner.artifact.codec import manifest_to_json
    from tuner.jobs.optimize import OptimizeConfig
    from tuner.jobs.optimize import optimize as run
    from tuner.jobs.optimize_folder import is_encoder_decoder
    from tuner.jobs.optimize_folder import optimize_folder as run_folder
    from tuner.measure.cache import default_cache_dir

    if (model is None) == (demo is None):
        raise BadInput("give a MODEL.onnx or --demo gpt2|bert|llama (one of them)")
    path = _demo_model(demo) if demo is not None else model
    cfg = OptimizeConfig(
        model=Path(path), out=out, backend=backend, requests=requests, max_seq=max_seq,
        max_batch=max_batch, streams=streams, rounds=rounds, warmup=warmup, bucket_rounds=bucket_rounds,
        margin=margin, max_variants=max_variants, max_buckets=max_buckets, fuse=fuse,
        probe=probe, advise=advise, threads=threads, graph_optimization=graph_opt, atol=atol, rtol=rtol,
        cache_policy=cache_policy,
        cache_dir=None if no_cache else (cache_dir or default_cache_dir()), force=force,
        progress=not quiet and not as_json, plots=plots)
    if cfg.model.is_dir() and is_encoder_decoder(cfg.model):
        _print_folder(run_folder(cfg), cfg.out, as_json, plots)
        return
    result = run(cfg)
    if as_json:
        # docs/pipeline.md: the same object as OUT/manifest.json, so that a pipeline reads
        # `source`, `device.name`, `variants[].accuracy.passed` without opening the file
        print(json.dumps(manifest_to_json(result.manifest), indent=2, allow_nan=False))
        return
    s = result.summary()
    print(f"selected {s['selected']}: {s['selection']}")
    e = s["expected_latency_ms"]
    print(f"buckets: batch {s['buckets']['batch']}, seq {s['buckets']['seq']}"
          + (f"; expected {e['chosen']:.2f} ms/request (pad to max {e['pad_to_max']:.2f}, "
             f"each at its own length, unbatched {e['no_buckets']:.2f})" if e else ""))
    m = result.manifest
    if m.cache is not None and m.phases is not None:  # a decoder with a KV cache
        sel = m.selected_variant()
        (pk,), (dk,) = m.phases["prefill"]["shapes"], m.phases["decode"]["shapes"]
        p, d = sel.latency.get(pk), sel.latency_decode.get(dk)
        values = m.cache.get("value_head_dim")  # multi-head latent attention's own width
        print(f"decoder: cache {m.cache['served_shape']} per layer x {m.cache['layers']} "
              + (f"(values {values} wide) " if values else "")
              + f"(policy {m.cache['policy']}), cache-length buckets {list(m.buckets.past)}; "
              + (f"prefill {pk} {p.median_ms:.2f} ms, decode {dk} {d.median_ms:.3f} ms/token; "
                 if p and d else "")
              + f"selection weighs decode x {m.phases['mean_output_tokens']:.1f} tokens/request")
    for n in s["notes"]:
        print(f"note: {n}")
    print(f"wrote {result.out}/manifest.json, report.md, report.html")


def _print_folder(s, out: Path, as_json: bool, plots: bool) -> None:
    """`tuner optimize FOLDER`'s answer: the selection and each variant's request time."""
    if as_json:  # the same object as OUT/selection.json
        print(json.dumps(s.to_json(), indent=2, allow_nan=False))
        return
    print(f"selected {s.selected}: {s.reason}")
    for v in s.variants:
        e, f, later = v.parts_ms
        speed = "" if v.speedup is None else (f", {v.speedup.ratio:.3f}x [{v.speedup.low:.3f}, "
                                              f"{v.speedup.high:.3f}]")
        print(f"  {v.name}: {v.request_ms:.2f} ms/request (encoder {e:.2f}, first step "
              f"{f:.2f}, later steps {later:.2f}){speed}"
              + "".join(f"; its {part}, the original's bytes, timed {ratio:.3f}x (noise)"
                        for part, ratio in v.unchanged))
    for n in s.notes:
        print(f"note: {n}")
    print(f"wrote {out}/ (the selected folder: `tuner serve {out}`), selection.json, report.md"
          + (", timings.png" if plots else ""))
