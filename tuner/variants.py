"""Build the candidate variants into the artifact folder, each through the accuracy gate.

    OUT/variants/original/model.onnx      a copy of the input (and its external data)
    OUT/variants/<name>/model.onnx        padded by tuner.rewrite.compose, fused by tuner.fuse

The rewrites and the gate are the project's own (compose.pad_file, tuner.verify); this
module only decides where files go and turns their results into manifest records.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from tuner.artifact import Accuracy, Transform
from tuner.errors import BadInput
from tuner.plan import Candidate

MODEL_FILE = "model.onnx"
_TRANSFORM = re.compile(r"^(\w+) ([0-9/]+)->([0-9]+)$")


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


def parse_transform(text: str) -> Transform:
    """compose's "vocab 50257->50304" (or "ffn 600/601->640") as a manifest Transform."""
    m = _TRANSFORM.match(text.strip())
    if not m:
        raise ValueError(f"unrecognised transform {text!r}")
    return Transform(m.group(1), int(m.group(2).split("/")[0]), int(m.group(3)))


def accuracy_of(result) -> Accuracy:
    """A tuner.verify.VerifyResult as the manifest's accuracy record."""
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
    from tuner.graph.load import _external_entries, check_external_data, read_proto

    dst, rel = variant_dir(root, "original")
    dst.parent.mkdir(parents=True, exist_ok=True)
    proto = read_proto(src)
    check_external_data(proto, src.parent)  # every location stays inside src's folder
    locations = {dict((e.key, e.value) for e in t.external_data)["location"]
                 for t in _external_entries(proto)}
    del proto
    shutil.copyfile(src, dst)
    for loc in sorted(locations):
        target = dst.parent / loc
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.parent / loc, target)
    return Built("original", dst, rel, True, (), Accuracy(True, 0.0, 0.0, "the reference itself"))


def build_padded(src: Path, root: Path, cand: Candidate, feeds: Sequence[Mapping[str, np.ndarray]],
                 tolerance) -> Built:
    """Pad `src` as the candidate asks, through compose.pad_file (which verifies against the
    original before writing). BadInput (a refused rewrite, or a failed gate) propagates."""
    from tuner.rewrite.compose import NotExact, PadRequest, pad_file

    pads = cand.pads
    req = PadRequest(ffn_size=pads.get("ffn"), vocab_size=pads.get("vocab"),
                     head_dim=pads.get("head_dim"), num_heads=pads.get("heads"))
    dst, rel = variant_dir(root, cand.name)
    try:
        res = pad_file(src, dst, req, verify=True, tolerance=tolerance, feeds=feeds)
    except NotExact as e:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise BadInput(f"{cand.name} failed the accuracy gate: "
                       f"{accuracy_of(e.result).detail}") from None
    except BadInput:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise
    transforms = tuple(parse_transform(t) for t in res.transforms)
    if not transforms:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise BadInput(f"{cand.name}: the rewrite changed nothing")
    return Built(cand.name, dst, rel, True, transforms, accuracy_of(res.accuracy))


def build_fused(base: Built, root: Path, cand: Candidate, shape, reference, feeds, tolerance,
                backend, settings) -> Built:
    """Run ORT's transformer optimizer on an already-built variant, then gate it against the
    original (`reference`, a runner) on the same feeds."""
    from tuner.fuse import fuse_file
    from tuner.verify import verify

    dst, rel = variant_dir(root, cand.name)
    try:
        stats = fuse_file(base.path, dst, shape.num_heads, shape.hidden_size)
        if not stats:
            raise BadInput(f"{cand.name}: ONNX Runtime's optimizer found nothing to fuse")
        result = verify(reference, backend.load(dst, settings), feeds, tolerance)
    except BaseException:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise
    acc = accuracy_of(result)
    if not acc.passed:
        shutil.rmtree(dst.parent, ignore_errors=True)
        raise BadInput(f"{cand.name} failed the accuracy gate: {acc.detail}")
    fused = ", ".join(f"{k} x{v}" for k, v in sorted(stats.items()))
    return Built(cand.name, dst, rel, True, (*base.transforms, Transform("fuse")), acc,
                 note=f"fused: {fused}")


def graph_files(built: Built) -> list[Path]:
    """The files that make up a variant (its graph first): what the cache key hashes."""
    folder = built.path.parent
    return [built.path] + sorted(p for p in folder.rglob("*") if p.is_file() and p != built.path)
