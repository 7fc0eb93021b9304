"""Encoder-decoder folders as users bring them, beside Optimum's own export:

- a transformers.js repository's (graphs under `onnx/`, the decoder only merged): `tuner
  unmerge FOLDER -o OUT` writes the two plain decoders, its branches, checked against it step
  by step, and OUT generates what the full export generates. A plain decoder that differs
  from the merged file FAILS the check.

ONNX Runtime's quantize_dynamic of each graph, and a transformers.js repository's quantized
copies (`tuner unmerge FOLDER --dtype quantized`): tests/test_seq2seq_quantized.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from models import optimum
from tests.serving_support import scaled_weight, seq2seq_tokens
from tuner.cli import main
from tuner.gate.seq2seq_steps import check_branches
from tuner.graph.merged import FLAG
from tuner.graph.seq2seq_record import find_seq2seq_record
from tuner.jobs.unmerge_folder import unmerge_folder
from tuner.runtime.registry import get_backend

FAMILIES = ("flan_t5", "bart", "whisper")


@pytest.fixture(scope="module")
def exports() -> dict[str, Path]:
    cells = [(f, optimum.FAMILIES[f].tasks[0]) for f in FAMILIES]
    return {f: p.parent for (f, _), p in zip(cells, optimum.export_all(cells))}


def _merged_only(export: Path, dst: Path) -> Path:
    """The export as a transformers.js repository holds it: configs at the top, the encoder
    and the merged decoder under onnx/."""
    (dst / "onnx").mkdir(parents=True)
    for f in export.iterdir():
        if f.suffix != ".onnx":
            shutil.copy(f, dst / f.name)
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx"):
        shutil.copy(export / name, dst / "onnx" / name)
    return dst


@pytest.mark.parametrize("family", FAMILIES)
def test_unmerged_folder_generates_as_the_export(exports, family, tmp_path):
    src = _merged_only(exports[family], tmp_path / "repo")
    out = tmp_path / "out"
    assert main(["unmerge", str(src), "-o", str(out)]) == 0
    assert {"decoder_model.onnx", "decoder_with_past_model.onnx", "encoder_model.onnx",
            "config.json", "generation_config.json"} <= {f.name for f in out.iterdir()}
    assert not (out / "decoder_model_merged.onnx").exists()
    assert (find_seq2seq_record(out).encoder.features is None) == (family != "whisper")
    assert seq2seq_tokens(out) == seq2seq_tokens(exports[family])
    assert main(["unmerge", str(src), "-o", str(out)]) == 2  # exists, without --force


def test_a_decoder_unlike_the_merged_one_fails(exports, tmp_path):
    """The with-past decoder with a self-attention projection scaled: the check against the
    merged file FAILS; the unchanged one passes."""
    src = _merged_only(exports["flan_t5"], tmp_path / "repo")
    out = tmp_path / "out"
    unmerge_folder(src, out)
    changed = scaled_weight(out / "decoder_with_past_model.onnx", tmp_path / "changed.onnx",
                            ("SelfAttention/v",))
    merged = src / "onnx" / "decoder_model_merged.onnx"
    inputs = [i.name for i in onnx.load(str(merged), load_external_data=False).graph.input]
    cpu = get_backend("ort-cpu")
    record = find_seq2seq_record(out)
    for later, passes in ((out / "decoder_with_past_model.onnx", True), (changed, False)):
        runners = [cpu.load(p) for p in (out / "encoder_model.onnx", out / "decoder_model.onnx",
                                         later, merged)]
        try:
            result = check_branches(record, *runners, merged_inputs=inputs,
                                    flag=np.ones(1, np.bool_))
        finally:
            for r in runners:
                r.close()
        assert bool(result) is passes, result.table()
    assert FLAG in inputs

