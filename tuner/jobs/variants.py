"""Build the candidate variants into the artifact folder, each through the accuracy gate.

    OUT/variants/original/model.onnx      a copy of the input (and its external data)
    OUT/variants/<name>/model.onnx        padded (tuner.jobs.pad), or fused (repeat_kv regrouped,
                                          tuner.rewrite.grouped_attention; tuner.runtime.ort_fusion)
    OUT/variants/<name>/last-logits.onnx  the selected decoder with its LM head cut to the
                                          positions a step reads (tuner.rewrite.logits_to_keep),
                                          sharing <name>'s weights

The rewrites and the gate are the project's own (tuner.jobs.pad, tuner.gate.verify); this
module only decides where files go and turns their results into manifest records.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from tuner.artifact.records import Accuracy
from tuner.errors import BadInput, RewriteRefused
from tuner.gate.entry import GateCheck
from tuner.gate.verify import VerifyResult
from tuner.graph.load import (check_external_data, external_locations, load_model,
                              read_proto, save_graph, save_model)
from tuner.graph.paddable import Transform
from tuner.graph.shape import ModelShape
from tuner.jobs.pad import NotExact, pad_model
from tuner.plan.propose import Candidate
from tuner.rewrite.compose import PadRequest
from tuner.rewrite.grouped_attention import regroup_attention
from tuner.rewrite.logits_to_keep import add_logits_to_keep
from tuner.rewrite.position_ids import add_position_ids
from tuner.runtime.ort_fusion import fuse_file

MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class Built:
    """A variant graph written inside the artifact, with what the gate said about it."""

    name: str
    path: Path  # absolute
    rel: str  # relative to the artifact folder
    exact: bool
    transforms: tuple[Transform, ...]
    accuracy: Accuracy
    note: str = ""


def accuracy_of(result: VerifyResult) -> Accuracy:
    """A tuner.gate.verify.VerifyResult as the manifest's accuracy record."""
    outs = result.outputs
    worst = max(outs, key=lambda o: o.max_abs, default=None)
    detail = f"{result.feeds} feeds, {result.tolerance}"
    if worst is not None:
        detail += f"; worst output {worst.name}: max abs {worst.max_abs:.3g}, cosine {worst.cosine:.6f}"
    if result.errors:
        detail += "; " + "; ".join(result.errors)
    fin = [o for o in outs if np.isfinite(o.max_abs) and np.isfinite(o.max_rel)]
    return Accuracy(bool(result.passed),
                    max((o.max_abs for o in fin), default=None),
                    max((o.max_rel for o in fin), default=None), detail)


def variant_dir(root: Path, name: str) -> tuple[Path, str]:
    rel = f"variants/{name}/{MODEL_FILE}"
    return root / rel, rel


def copy_original(src: Path, root: Path) -> Built:
    """Copy the input and every external-data file it names, keeping their relative places."""
    dst, rel = variant_dir(root, "original")
    dst.parent.mkdir(parents=True, exist_ok=True)
    proto = read_proto(src)
    check_external_data(proto, src.parent)  # every location stays inside src's folder
    locations = external_locations(proto)
    del proto
    shutil.copyfile(src, dst)
    for loc in locations:
        target = dst.parent / loc
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.parent / loc, target)
    return Built("original", dst, rel, True, (), Accuracy(True, 0.0, 0.0, "the reference itself"))


def build_padded(model: ir.Model, shape: ModelShape, root: Path, cand: Candidate,
                 check: GateCheck, cache_policy: str = "keep") -> Built:
    """Pad a copy of `model` (already loaded and inspected as `shape`) as the candidate asks,
    gated through `check` before it is written. BadInput (a refused rewrite, or a failed
    gate) propagates, with nothing left behind."""
    dst, rel = variant_dir(root, cand.name)
    try:
        res = pad_model(model.clone(), shape, PadRequest.from_pads(cand.pads, cache_policy), dst,
                        check)
    except NotExact as e:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise BadInput(f"{cand.name} failed the accuracy gate: "
                       f"{accuracy_of(e.result).detail}") from None
    except BadInput:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise
    if not res.records:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise BadInput(f"{cand.name}: the rewrite changed nothing")
    return Built(cand.name, dst, rel, True, res.records, accuracy_of(res.accuracy))


def build_fused(base: Built, root: Path, cand: Candidate, shape: ModelShape, check: GateCheck,
                backend, settings) -> Built:
    """An already-built variant (`base`) with its repeat_kv regrouped (exact GQA without
    repeating the cache: tuner.rewrite.grouped_attention) and ONNX Runtime's transformer
    optimizer run on it, then gated through `check`, against the original on the same feeds."""
    dst, rel = variant_dir(root, cand.name)
    work = dst.parent / ".regrouped"
    try:
        src, regrouped = _regrouped(base.path, work, shape)
        stats = fuse_file(src, dst, shape.num_heads, shape.hidden_size, shape.softmax_scale())
        if not stats and not regrouped:
            raise BadInput(f"{cand.name}: ONNX Runtime's optimizer found nothing to fuse")
        if not stats:  # nothing for ORT's optimizer: the regrouped graph is the variant
            for f in work.iterdir():
                os.replace(f, dst.parent / f.name)
        result = check.check(backend.load(dst, settings), dst)
    except BaseException:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    acc = accuracy_of(result)
    if not acc.passed:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise BadInput(f"{cand.name} failed the accuracy gate: {acc.detail}")
    done = [f"{k} x{v}" for k, v in sorted(stats.items())]
    done += [f"repeat_kv regrouped x{regrouped}"] if regrouped else []
    return Built(cand.name, dst, rel, True, (*base.transforms, Transform("fuse")), acc,
                 note=f"fused: {', '.join(done)}")


def kept_name(base: str, kind: str = "last-logits") -> str:
    """The name of `base` made ready to serve (see build_kept): `kind` is the first rewrite
    made, "last-logits" (its LM head cut; then maybe its positions too) or "positions"."""
    return kind if base == "original" else f"{base}+{kind}"


# What build_kept makes of a served decoder, in order: (transform kind, rule, what it does)
_SERVED = (
    ("last-logits", add_logits_to_keep,
     "the LM head on the positions a step reads (logits_to_keep)"),
    ("positions", add_position_ids,
     "its positions, counted from the cache's length, taken as the input position_ids so "
     "that rows may be padded and batched"),
)


def build_kept(base: Built, check: GateCheck, backend, settings) -> Built:
    """`base` (a decoder's variant) as the server should run it: with the input
    `logits_to_keep`, its LM head on the positions a step reads
    (tuner.rewrite.logits_to_keep), and, where the graph counts its positions from its
    cache's length, the input `position_ids` (tuner.rewrite.position_ids); each where its
    rule applies. The graph is written beside the base's own (`last-logits.onnx` or
    `positions.onnx` in its folder: its weights, external data included, are shared, not
    copied) and gated through `check`, its kept logits run as the server runs its prompts,
    its positions fed as its slots. BadInput (no rule applies, or the gate fails) with
    nothing left behind."""
    model = load_model(base.path)
    made, refused = [], []
    for kind, rule, _ in _SERVED:
        try:
            rule(model)
            made.append(kind)
        except RewriteRefused as e:
            refused.append(f"{kind}: {e}")
    if not made:
        raise BadInput(f"{kept_name(base.name)}: {'; '.join(refused)}")
    name = kept_name(base.name, made[0])
    dst = base.path.parent / f"{made[0]}.onnx"
    rel = f"{Path(base.rel).parent.as_posix()}/{dst.name}"
    try:
        save_graph(model, dst)
        del model
        result = check.check(backend.load(dst, settings), dst)
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    acc = accuracy_of(result)
    if not acc.passed:
        dst.unlink(missing_ok=True)
        raise BadInput(f"{name} failed the accuracy gate: {acc.detail}")
    what = [w for kind, _, w in _SERVED if kind in made]
    note = f"{base.name} with {'; '.join(what)}"
    if "last-logits" not in made:  # said: why every position's logits are still computed
        note += f" ({refused[0]})"
    return Built(name, dst, rel, True, (*base.transforms, *(Transform(k) for k in made)), acc,
                 note=note)


def _regrouped(src: Path, work: Path, shape: ModelShape) -> tuple[Path, int]:
    """`src` with its repeat_kv regrouped, written under `work` (and how many), or `src`
    itself and 0 where the graph has no grouped attention to regroup."""
    if not shape.num_kv_heads or shape.num_kv_heads >= shape.num_heads:
        return src, 0
    model = load_model(src)
    count = regroup_attention(model, shape.num_heads, shape.num_kv_heads)
    if not count:
        return src, 0
    return save_model(model, work / src.name), count


def graph_files(built: Built) -> list[Path]:
    """The files that make up a variant (its graph first): what the cache key hashes."""
    folder = built.path.parent
    return [built.path] + sorted(p for p in folder.rglob("*") if p.is_file() and p != built.path)
