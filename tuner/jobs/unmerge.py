"""`tuner unmerge` as a job: Optimum's legacy merged decoder made one plain graph
(tuner.rewrite.unmerge), gated against the merged file itself, and only then written,
atomically, as `tuner pad` writes.

    result = unmerge_file("decoder_model_merged.onnx", "model.onnx")

The gate is the usual one for a decoder with its cache (greedy rollouts, each model fed its
own present, past length 0 first): the reference is the merged file on ONNX Runtime, fed
use_cache_branch = True beside every input, the branch the plain graph is made of.
"""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path
from typing import Mapping

import numpy as np
import onnx_ir as ir

from tuner.gate.entry import GateCheck, prepare
from tuner.gate.verify import Tolerance, VerifyResult
from tuner.graph.load import load_model, name_nodes, save_model
from tuner.errors import BadInput
from tuner.graph.merged import FLAG, merged_if, with_cache
from tuner.graph.role_names import ENCODER_ROLES
from tuner.graph.roles import input_specs
from tuner.jobs.pad import check_destination, gate, let_go_of_weights, load_reference, \
    move_into_place
from tuner.rewrite.unmerge import unmerge
from tuner.runtime.base import Runner


class _WithCacheBranch:
    """The merged file's runner, fed the flag that picks the with-cache branch."""

    def __init__(self, runner: Runner, flag: np.ndarray) -> None:
        self.runner, self.flag, self.name = runner, flag, runner.name

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.runner.infer({**feeds, FLAG: self.flag})

    def close(self) -> None:
        self.runner.close()


def prepared(merged: Path, plain: ir.Model, flag: np.ndarray,
             tolerance: Tolerance = Tolerance()) -> GateCheck:
    """The gate of a plain graph made from `merged`: feeds built for `plain` (the graph
    without the flag), the merged file as the reference, fed `flag` beside them."""
    return prepare(plain, lambda: _WithCacheBranch(load_reference(merged), flag),
                   tolerance=tolerance)


def unmerge_file(src: str | os.PathLike, dst: str | os.PathLike,
                 tolerance: Tolerance = Tolerance()) -> VerifyResult:
    """Load the merged decoder, inline its with-cache branch, gate it against the merged
    file, then write `dst` atomically. BadInput: not a merged decoder; NotExact: the gate
    failed and nothing was written."""
    src, dst = Path(src), Path(dst)
    check_destination(src, dst, "plain graph")
    model = load_model(src, merged_ok=True)
    if merged_if(model) is None:
        raise BadInput(f"{src}: not an Optimum merged decoder (no If on an input '{FLAG}' "
                       "holding the layers): nothing to unmerge")
    flag = with_cache(model)
    unmerge(model)
    name_nodes(model)
    crossing = [s.name for s in input_specs(model) if s.role in ENCODER_ROLES]
    if crossing:  # its without-cache branch computes what the with-cache one is fed
        raise BadInput(f"{src}: an encoder-decoder's merged decoder (it takes "
                       f"{', '.join(crossing[:2])}... from its encoder): its two branches are "
                       "the export's decoder_model.onnx and decoder_with_past_model.onnx; "
                       "`tuner pad FOLDER` pads the whole export")
    check = prepared(src, model, flag, tolerance)
    try:
        with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.") as tmp:
            staged = save_model(model, Path(tmp) / dst.name)
            let_go_of_weights(model)  # the session of the gate needs the memory
            del model
            gc.collect()
            result = gate(check, staged)
            move_into_place(staged, dst)
    finally:
        check.close()
    return result
