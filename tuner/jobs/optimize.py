"""`tuner optimize` as a job: check the input and OUT, stage the artifact in a temporary folder
beside OUT, run the pipeline (tuner.jobs.pipeline) into it, and swap it into place.

Everything is built in a temporary folder beside OUT and renamed into place at the end, so
Ctrl-C or a failure leaves no half-written OUT. Timings go to the results cache (outside OUT)
as each shape finishes, so a rerun after an interruption measures only what is missing.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tuner.artifact.records import Manifest
from tuner.errors import BadInput
from tuner.graph.load import folder_hint, load_model
from tuner.graph.rotary_caches import batch_one_rotaries
from tuner.graph.windowed import windowed_cache
from tuner.jobs.pipeline import progress_say, run_pipeline
from tuner.jobs.rotary_batch import describe as describe_rebatched
from tuner.jobs.rotary_batch import rebatch_file
from tuner.jobs.unwindow import describe, unwindow_file
from tuner.util.files import ensure_writable_dir, swap_dir_into_place


@dataclass(frozen=True)
class OptimizeConfig:
    model: Path
    out: Path
    backend: str = "ort-cpu"
    requests: Path | None = None
    max_seq: int | None = None
    max_batch: int = 2
    streams: int = 1  # decoders: streams decoding at once in the server (decode's batch)
    rounds: int = 7
    warmup: int = 2
    bucket_rounds: int = 3
    margin: float = 0.03
    max_variants: int = 4
    max_buckets: int = 4
    fuse: bool = True
    probe: bool = True
    advise: bool = False
    threads: int = 0  # 0: the cores this process may use
    graph_optimization: str = "all"
    atol: float = 1e-4
    rtol: float = 1e-3
    cache_policy: str = "keep"  # head-dim/head-count variants of a KV-cache decoder (docs/design.md)
    cache_dir: Path | None = None  # None: no results cache
    text_dir: Path | None = None  # where the tokenizer and configs are (None: the model's)
    force: bool = False
    progress: bool = True
    plots: bool = True  # the report's matplotlib charts (False: its tables alone)

    def __post_init__(self) -> None:
        checks = [(self.rounds >= 2, "--rounds must be >= 2 (a ratio needs pairs)"),
                  (self.warmup >= 0, "--warmup must be >= 0"),
                  (self.bucket_rounds >= 1, "--bucket-rounds must be >= 1"),
                  (0 <= self.margin < 1, "--margin must be in [0, 1)"),
                  (self.max_variants >= 1, "--max-variants must be >= 1"),
                  (1 <= self.max_buckets <= 16, "--max-buckets must be in 1..16"),
                  (self.max_batch >= 1, "--max-batch must be >= 1"),
                  (self.streams >= 1, "--streams must be >= 1"),
                  (self.max_seq is None or self.max_seq >= 1, "--max-seq must be >= 1"),
                  (self.threads >= 0, "--threads must be >= 0"),
                  (self.atol >= 0 and self.rtol >= 0, "tolerances must be >= 0"),
                  (self.cache_policy in ("keep", "widen"), "--cache-policy must be keep or widen")]
        for ok, msg in checks:
            if not ok:
                raise BadInput(msg)


@dataclass(frozen=True)
class OptimizeResult:
    out: Path
    manifest: Manifest
    notes: tuple[str, ...] = field(default=())

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        sel = m.selected_variant()
        return {
            "out": str(self.out), "selected": m.selected, "selection": m.selection,
            "backend": m.backend, "device": m.device_label,
            "buckets": {"batch": list(m.buckets.batch), "seq": list(m.buckets.seq)},
            "expected_latency_ms": None if m.buckets.expected is None else {
                "chosen": m.buckets.expected.chosen_ms,
                "pad_to_max": m.buckets.expected.pad_to_max_ms,
                "no_buckets": m.buckets.expected.no_buckets_ms},
            "variants": [{"name": v.name, "exact": v.exact, "passed": v.accuracy.passed,
                          "speedup": None if v.speedup is None else
                          [v.speedup.ratio, v.speedup.low, v.speedup.high]} for v in m.variants],
            "path": sel.path, "notes": list(m.notes),
        }


def _check_out(cfg: OptimizeConfig) -> None:
    out = cfg.out
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not cfg.force:
        raise BadInput(f"{out}: exists and is not empty (use --force to replace it)")
    if out.resolve() in (cfg.model.resolve().parent, (cfg.text_dir or cfg.model).resolve()):
        raise BadInput(f"{out}: is the model's own folder; choose another output folder")
    # OUT is staged beside itself and renamed at the end: its parent must take files
    ensure_writable_dir(out.resolve().parent, f"artifact {out.name}/")
    if cfg.cache_dir is not None:
        ensure_writable_dir(cfg.cache_dir, "results cache", " (choose --cache-dir, or --no-cache)")


# Files beside a model that `tuner serve` reads for text (serving/text_config.py): the
# tokenizer (text in and out, its config with the special tokens, and the chat template,
# in its own file or in that config), Hugging Face's config (the model's positions, for
# rotary families), the generation configs of Hugging Face and onnxruntime-genai (the end
# tokens), and sentence-transformers' modules, max length and pooling (how an encoder's
# token outputs become the embeddings of /v1/embeddings, or a SparseEncoder's masked LM
# logits its sparse ones).
TEXT_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "chat_template.json", "config.json", "generation_config.json",
              "genai_config.json", "modules.json", "sentence_bert_config.json",
              "config_sentence_transformers.json", "1_Pooling/config.json",
              "1_SpladePooling/config.json")
_TEXT_FILE_MAX = 64 * 1024 * 1024


def _copy_text_files(model_dir: Path, out: Path) -> None:
    """The tokenizer and configs beside the model; a graph under a repository's onnx/ (the
    hub's layout: sentence-transformers' and transformers.js' copies, model_O2.onnx,
    model_qint8_avx512_vnni.onnx, ...) finds those the folder lacks at the repository's top."""
    dirs = (model_dir, model_dir.parent) if model_dir.name == "onnx" else (model_dir,)
    for name in TEXT_FILES:
        src = next((d / name for d in dirs if (d / name).is_file()), None)
        if src is not None and src.stat().st_size <= _TEXT_FILE_MAX:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, out / name)


def optimize(cfg: OptimizeConfig) -> OptimizeResult:
    """Run the whole job; BadInput on unusable input (exit 2)."""
    if cfg.model.is_dir():
        cfg = replace(cfg, model=folder_model(cfg.model), text_dir=cfg.model)
    if not cfg.model.is_file():
        raise BadInput(f"{cfg.model}: {folder_hint(cfg.model) or 'no such model file'}")
    _check_out(cfg)
    model = load_model(cfg.model)  # BadInput on anything that is not a readable ONNX model
    cfg.out.resolve().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.out.name}.tmp-", dir=cfg.out.resolve().parent))
    work = tmp.with_name(tmp.name.replace(".tmp-", ".first-"))  # the first steps' copies
    try:
        source, first = cfg.model, []
        if windowed_cache(model.graph) is not None:  # one cache length first (the engine's)
            del model
            source, first = _unwindowed(cfg, work)
            model = load_model(source)
        if batch_one_rotaries(model):  # a graph that runs batches before anything is timed
            del model
            source, note = _rebatched(cfg, source, work)
            first.append(note)
            model = load_model(source)
        manifest, notes = run_pipeline(cfg, model, tmp, source, first)
        del model
        _copy_text_files(cfg.text_dir or cfg.model.parent, tmp)
        swap_dir_into_place(tmp, cfg.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return OptimizeResult(cfg.out, manifest, tuple(notes))


def folder_model(folder: Path) -> Path:
    """A decoder-only export folder's one graph, `model.onnx`, as Optimum writes it (or
    under onnx/, as transformers.js repositories hold it, its quantized copies beside it);
    BadInput naming what the folder holds otherwise."""
    for path in (folder / "model.onnx", folder / "onnx" / "model.onnx"):
        if path.is_file():
            return path
    graphs = sorted(p.relative_to(folder).as_posix()
                    for p in (*folder.glob("*.onnx"), *folder.glob("onnx/*.onnx")))
    raise BadInput(f"{folder}: no model.onnx (a decoder-only export's graph) nor an "
                   "encoder-decoder's three graphs in the folder"
                   + (f"; it holds {', '.join(graphs)}: give one of them" if graphs else ""))


def _unwindowed(cfg: OptimizeConfig, work: Path) -> tuple[Path, list[str]]:
    """The input with its windowed caches made full-length (tuner.jobs.unwindow), written
    under `work`, which the caller removes; its note. Not exact: bad input, with the table."""
    from tuner.gate.verify import Tolerance
    from tuner.jobs.pad import NotExact

    work.mkdir(exist_ok=True)
    say = progress_say(cfg.progress)
    say(f"making {cfg.model.name}'s windowed caches full-length (checked by running)")
    try:
        result, found = unwindow_file(cfg.model, work / cfg.model.name,
                                      Tolerance(cfg.atol, cfg.rtol))
    except NotExact as e:
        raise BadInput(f"{cfg.model}: its windowed caches made full-length did not match "
                       f"it:\n{e.result.table()}") from None
    return work / cfg.model.name, [f"{cfg.model.name}: {describe(found, result)}"]


def _rebatched(cfg: OptimizeConfig, source: Path, work: Path) -> tuple[Path, str]:
    """`source` with its one-row rotary caches expanded to the batch (tuner.jobs.rotary_batch),
    written under `work` (which the caller removes); its note. Not exact: bad input."""
    from tuner.gate.verify import Tolerance
    from tuner.jobs.pad import NotExact

    (work / "rebatched").mkdir(parents=True, exist_ok=True)
    dst = work / "rebatched" / cfg.model.name
    progress_say(cfg.progress)(f"making {cfg.model.name} run at any batch: its rotary caches "
                               "hold one row (checked by running, row by row)")
    try:
        result, count = rebatch_file(source, dst, Tolerance(cfg.atol, cfg.rtol))
    except NotExact as e:
        raise BadInput(f"{cfg.model}: its rotary caches expanded to the batch did not match "
                       f"it row by row:\n{e.result.table()}") from None
    return dst, f"{cfg.model.name}: {describe_rebatched(count, result)}"
