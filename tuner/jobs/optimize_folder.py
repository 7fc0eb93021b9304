"""`tuner optimize FOLDER -o OUT`: an encoder-decoder export folder (Optimum's layout, or a
transformers.js repository's with the graphs under onnx/) optimized as it is served.

    original   the folder's three graphs (encoder, first step, with-past) and its other
               files, copied flat into the stage
    plan       candidates from the decoder's dims (tuner.plan.propose: vocabulary, FFN, head
               dim), pruned to --max-variants; not probed (each is measured whole)
    build      each candidate padded as a folder (tuner.jobs.pad_folder: every graph gated
               against its own original), then its cache path checked (the with-past decoder
               against the first-step decoder run whole: tuner.gate.seq2seq_steps)
    compare    one request per variant per round, interleaved in a fresh random order
               (tuner.jobs.seq2seq_timing); paired ratios against the original
    select     the original unless a variant's whole interval lies above 1 + margin and
               above what its unchanged parts (graphs of the original's bytes: the same
               work, timed in the same run) showed in its favour
    write      the selected folder's files at OUT's top (what `tuner serve OUT` loads),
               selection.json, report.md, timings.png

OUT appears whole or not at all (staged beside itself, renamed at the end). On a CPU the
padding seldom pays, and "keep the original" is then the answer.
"""

from __future__ import annotations

import filecmp
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np

from tuner.artifact.folder_report import FolderSelection, FolderVariant, write_folder_report
from tuner.errors import BadInput
from tuner.gate.seq2seq_quantized import check_folder
from tuner.gate.verify import Tolerance, VerifyResult
from tuner.graph.inspect import inspect_model
from tuner.graph.io import model_bytes, other_files
from tuner.graph.load import load_model
from tuner.graph.seq2seq_record import (FILES, FIRST_STEP, find_seq2seq_record, graphs_dir,
                                        is_seq2seq_folder, merged_only)
from tuner.hardware.detect import detect
from tuner.jobs.pad import NotExact
from tuner.jobs.pad_folder import FolderResult, Multiples, copy_graph, pad_folder
from tuner.jobs.pipeline import progress_say
from tuner.jobs.seq2seq_timing import PARTS, RequestTimer, Seq2SeqTraffic, seq2seq_traffic
from tuner.measure.select import select
from tuner.measure.stats import paired_ratio_ci
from tuner.measure.timing import interleave_timed
from tuner.plan.propose import MULTIPLES, Candidate, propose, prune
from tuner.artifact.records import Speedup
from tuner.runtime.base import SessionSettings
from tuner.runtime.memory import load_fitting
from tuner.runtime.registry import resolve
from tuner.util.files import ensure_writable_dir, swap_dir_into_place
from tuner.util.progress import rich_progress


@dataclass(frozen=True)
class Built:
    """A variant folder in the stage, with what its build and its check measured."""

    name: str
    folder: Path
    transforms: tuple[str, ...]
    gate_max_abs: float
    cache_path: VerifyResult | None = None


def is_encoder_decoder(folder: Path) -> bool:
    """Whether `folder` is this job's: an encoder-decoder's, whole or with its decoder
    merged (refused below, naming the command that unmerges it)."""
    return is_seq2seq_folder(folder) or merged_only(folder) is not None


def refuse_unless_seq2seq(folder: Path) -> None:
    """BadInput unless `folder` holds an encoder-decoder's three graphs (the merged-only
    layout named with the command that unmerges it)."""
    hint = merged_only(folder)
    if hint:
        raise BadInput(hint.replace("`tuner serve OUT`", "`tuner optimize OUT`"))
    if not is_seq2seq_folder(folder):
        graphs = sorted(f.name for f in folder.glob("*.onnx"))
        raise BadInput(f"{folder}: not an encoder-decoder export folder (no {', '.join(FILES)})"
                       + (f"; it holds {', '.join(graphs)}: give one of them" if graphs else ""))


def optimize_folder(cfg) -> FolderSelection:
    """The whole job (see the module's docstring) for `cfg` (tuner.jobs.optimize's
    OptimizeConfig); BadInput on unusable input (exit 2)."""
    src, out = Path(cfg.model), Path(cfg.out)
    refuse_unless_seq2seq(src)
    _check_out(src, out, cfg.force)
    say = progress_say(cfg.progress)
    backends, notes = resolve(cfg.backend)
    backend = next((b for b in backends if b.name != "ort-cpu"), backends[0])
    info = detect()
    settings = SessionSettings(intra_op_threads=cfg.threads or info.cpu_cores,
                               inter_op_threads=1, graph_optimization=cfg.graph_optimization)
    stage = Path(tempfile.mkdtemp(dir=out.resolve().parent, prefix=f".{out.name}.tmp-"))
    try:
        original = _flat_copy(src, stage / "variants" / "original")
        record = find_seq2seq_record(original)
        traffic = seq2seq_traffic(cfg.requests, cfg.max_seq, cfg.streams, record)
        notes = [*notes, traffic.note]
        built = [Built("original", original, (), 0.0)]
        for c in _candidates(original, info, notes):  # best first, until the budget is met
            if len(built) >= cfg.max_variants:
                notes.append(f"not built {c.name}: over the limit of {cfg.max_variants} "
                             "variants")
                continue
            say(f"building {c.name} (every graph padded and gated)")
            b = _build(original, stage / "variants" / c.name, c, Tolerance(cfg.atol, cfg.rtol),
                       cfg.cache_policy, notes)
            built += [b] if b is not None else []
        chosen = _compare(built, traffic, backend, settings, cfg, notes, say)
        selected = stage / "variants" / chosen.selected
        for f in selected.iterdir():
            shutil.move(str(f), stage / f.name)
        shutil.rmtree(stage / "variants")
        write_folder_report(stage, chosen, cfg.plots)
        swap_dir_into_place(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return chosen


def _check_out(src: Path, out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a folder")
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise BadInput(f"{out}: is inside the model's own folder; choose another output folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise BadInput(f"{out}: exists and is not empty (use --force to replace it)")
    ensure_writable_dir(out.resolve().parent, f"artifact {out.name}/")


def _flat_copy(src: Path, dst: Path) -> Path:
    """The three graphs (with their external data) and the folder's other files, in one flat
    folder: the original variant, and what the padded ones are made from."""
    dst.mkdir(parents=True)
    graphs = graphs_dir(src)
    for name in FILES:
        copy_graph(graphs / name, dst)
    for f in other_files(src):
        shutil.copy2(f, dst / f.name)
    return dst


def _candidates(folder: Path, info, notes: list[str]) -> list[Candidate]:
    """The padded candidates (the original left out), best first, from the first-step
    decoder's dims, which has every dimension the folder pads (the encoder has no
    vocabulary). All of them: one a folder's graphs refuse (a head dim through quantized
    weights) gives its place in the budget to the next."""
    shape = inspect_model(load_model(folder / FIRST_STEP))
    candidates = propose(shape, info.facts())
    kept, dropped = prune(candidates, len(candidates))
    notes += dropped
    if len(kept) == 1:
        notes.append("every dimension is aligned already: the original is the only variant")
    return kept[1:]


def _multiples(c: Candidate) -> Multiples | None:
    """A candidate's sizes as the multiples `tuner pad FOLDER` takes (each graph rounds its
    own dims up; the head dim is absolute); None where a size is no rounding up of the old
    one (a SwiGLU width searched near 8/3 h)."""
    want = {}
    for t in c.transforms:
        if t.kind == "head_dim":
            want["head_dim"] = t.new
            continue
        fits = [m for m in (*MULTIPLES, 256) if -(-t.old // m) * m == t.new]
        if not fits:
            return None
        want[{"ffn": "ffn_multiple", "vocab": "vocab_multiple"}[t.kind]] = max(fits)
    return Multiples(**want)


def _build(original: Path, dst: Path, c: Candidate, tolerance: Tolerance, cache_policy: str,
           notes: list[str]) -> Built | None:
    """`c` padded into `dst` (None, with a note, when no graph took it or a gate FAILED)."""
    want = _multiples(c)
    if want is None:
        notes.append(f"skipped {c.name}: a folder's graphs are padded to multiples of their "
                     "own sizes, and this size is none")
        return None
    try:
        result = pad_folder(original, dst, replace(want, cache_policy=cache_policy), tolerance)
    except (BadInput, NotExact) as e:  # (its first line, without the stage's path)
        notes.append(f"skipped {c.name}: {str(e).splitlines()[0].replace(f'{original}: ', '')}")
        return None
    notes += [f"{c.name}: {graph} kept unpadded ({why})" for graph, why in result.kept]
    return Built(c.name, dst, _labels(result), max(
        (o.max_abs for r in result.padded if r.accuracy for o in r.accuracy.outputs),
        default=0.0))


def _labels(result: FolderResult) -> tuple[str, ...]:
    return tuple(f"{Path(r.dst).name}: {t}" for r in result.padded for t in r.transforms)


def _compare(built: list[Built], traffic: Seq2SeqTraffic, backend, settings, cfg,
             notes: list[str], say) -> FolderSelection:
    """Every variant loaded and its cache path checked, then timed request by request in
    interleaved rounds; the selection."""
    say(f"loading {len(built)} variant(s) on {backend.name}")
    by_name = {b.name: b for b in built}
    items = [(b.name, b.folder, sum(model_bytes(b.folder / f) for f in FILES)) for b in built]
    # every variant's three sessions stay alive for interleaved timing: only while they fit
    sessions, left_out = load_fitting(
        items, lambda name, folder: [backend.load(folder / f, settings) for f in FILES])
    notes += left_out
    loaded, timers = [], []
    try:
        for name, runners in sessions:
            b = by_name[name]
            record = find_seq2seq_record(b.folder)
            check = check_folder(record, *runners, Tolerance(cfg.atol, cfg.rtol)
                                 .at_precision(backend.precision))
            if not check:
                if b.name == "original":
                    raise BadInput(f"{cfg.model}: its with-past decoder does not agree with "
                                   f"the first-step decoder run whole:\n{check.table()}")
                notes.append(f"skipped {b.name}: its cache path FAILED\n{check.table()}")
                continue
            loaded.append(Built(b.name, b.folder, b.transforms, b.gate_max_abs, check))
            timers.append(RequestTimer(record, runners, traffic))
        times = _time(timers, [b.name for b in loaded], cfg)
    finally:
        for _, runners in sessions:
            for r in runners:
                r.close()
    return _selection(loaded, times, traffic, backend, settings, cfg, notes)


def _time(timers: list[RequestTimer], names: list[str], cfg) -> dict[str, tuple]:
    """{name: (request ms per round, parts ms per round)} after cfg.warmup untimed
    requests of each."""
    for _ in range(cfg.warmup):
        for t in timers:
            t()
    for t in timers:
        t.parts.clear()
    with rich_progress(cfg.progress, "timing requests") as bar:
        bar.start(cfg.rounds * len(timers))
        ms = interleave_timed(timers, cfg.rounds,
                              lambda r, i: bar.advance(f"round {r + 1}, {names[i]}"))
    return {n: (ms[i], np.asarray(t.parts)) for i, (n, t) in enumerate(zip(names, timers))}


def _selection(loaded: list[Built], times: dict[str, tuple], traffic: Seq2SeqTraffic, backend,
               settings: SessionSettings, cfg, notes: list[str]) -> FolderSelection:
    base = times["original"][0]
    speedups = {b.name: paired_ratio_ci(base, times[b.name][0]) for b in loaded}
    unchanged = {b.name: _unchanged(loaded[0], b, times) for b in loaded[1:]}
    clears = clears_noise(speedups, unchanged)
    chosen = select(speedups, cfg.margin, eligible=clears)
    notes += [_vetoed(n, speedups[n], unchanged[n]) for n in unchanged
              if speedups[n].above(1 + cfg.margin) and not clears(n)]
    variants = []
    for b in loaded:
        ms, parts = times[b.name]
        q1, median, q3 = np.percentile(ms, [25, 50, 75])
        ci = speedups[b.name]
        variants.append(FolderVariant(
            b.name, b.transforms, b.gate_max_abs, b.cache_path.outputs[0].max_abs,
            float(median), float(q1), float(q3),
            tuple(float(x) for x in np.median(parts, axis=0)),
            None if b.name == "original" else Speedup(ci.ratio, ci.low, ci.high, ci.confidence),
            unchanged.get(b.name, ())))
    workload = {"batch": traffic.batch, "source_tokens": traffic.source,
                "output_tokens": traffic.output, "note": traffic.note}
    return FolderSelection(str(cfg.model), detect().label, backend.name,
                           dict(settings.__dict__), workload, cfg.rounds, cfg.margin,
                           tuple(variants), chosen.name, chosen.reason, tuple(notes))


def _unchanged(original: Built, variant: Built, times: dict[str, tuple]
               ) -> tuple[tuple[str, float], ...]:
    """Each part of `variant` whose graph is the original's, byte for byte (a vocabulary
    padding leaves the encoder), with its time ratio to the original's: the same work timed
    twice in one run, what the run's noise alone makes of it."""
    mine = np.median(times["original"][1], axis=0)
    theirs = np.median(times[variant.name][1], axis=0)
    return tuple((part, float(mine[i] / theirs[i]))
                 for i, (part, name) in enumerate(zip(PARTS, FILES))
                 if filecmp.cmp(original.folder / name, variant.folder / name, shallow=False)
                 and theirs[i] > 0)


def clears_noise(speedups: dict, unchanged: dict) -> Callable[[str], bool]:
    """The selection's second rule (beside the margin): a variant's speedup interval must lie
    above the largest ratio its unchanged parts (the same work) showed in its favour in the
    same run."""
    return lambda name: speedups[name].low > max((r for _, r in unchanged[name]), default=0.0)


def _vetoed(name: str, ci, unchanged: tuple[tuple[str, float], ...]) -> str:
    part, ratio = max(unchanged, key=lambda pr: pr[1])
    return (f"{name}: {ci.ratio:.3f}x [{ci.low:.3f}, {ci.high:.3f}] is not a win: its {part}, "
            f"the original's bytes, timed {ratio:.3f}x the original's in the same run, and "
            "the interval must lie above what the same work shows")
