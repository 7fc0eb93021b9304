"""`tuner unmerge FOLDER -o OUT`: an encoder-decoder export folder whose decoder is only
there merged (`decoder_model_merged.onnx`, as transformers.js repositories ship Whisper, T5,
BART) made the folder a generation loop runs:

    encoder_model.onnx             copied
    decoder_model_merged.onnx  ->  decoder_model.onnx             its without-cache branch
                               ->  decoder_with_past_model.onnx   its with-cache branch

each branch inlined and pruned to the inputs and outputs it uses (tuner.rewrite.unmerge.
branch), then checked against the merged file step by step on ONNX Runtime
(tuner.gate.seq2seq_steps.check_branches), and the folder written whole or not at all, the
configs and tokenizer beside the graphs (a folder whose graphs lie in its `onnx/` is written
flat). `tuner serve OUT` generates from it; Optimum loads it as it loads its own exports.

`dtype` picks which of a transformers.js repository's precisions (tuner.graph.js_dtypes:
`encoder_model_quantized.onnx` and `decoder_model_merged_quantized.onnx` for q8) is made
so; OUT holds them under the plain names whatever the dtype.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from tuner.errors import BadInput
from tuner.gate.seq2seq_steps import check_branches
from tuner.gate.verify import Tolerance, VerifyResult
from tuner.graph import js_dtypes
from tuner.graph.io import model_files, other_files
from tuner.graph.load import load_model, name_nodes, save_model
from tuner.graph.merged import FLAG, merged_if, with_cache
from tuner.graph.seq2seq_record import (ENCODER, FIRST_STEP, LATER_STEPS, MERGED,
                                        find_seq2seq_record)
from tuner.jobs.pad import NotExact, load_reference
from tuner.rewrite.unmerge import branch
from tuner.util.files import ensure_writable_dir, swap_dir_into_place


def _graphs(src: Path, dtype: str) -> tuple[Path, Path]:
    """(the encoder, the merged decoder) of `dtype`; BadInput naming the dtypes there are."""
    dtype = js_dtypes.dtype_of(dtype)
    files = (ENCODER, MERGED)
    graphs = js_dtypes.graphs_of(src, files, dtype) if src.is_dir() else None
    if graphs is None:
        named = " and ".join(js_dtypes.variant(f, dtype) for f in files)
        there = js_dtypes.present(src, files) if src.is_dir() else []
        raise BadInput(f"{src}: not an encoder-decoder folder with {named}"
                       + (f"; it holds the dtypes {', '.join(there)} (--dtype)" if there
                          else ""))
    return graphs / js_dtypes.variant(ENCODER, dtype), graphs / js_dtypes.variant(MERGED, dtype)


def _write_branches(merged: Path, stage: Path) -> tuple[list[str], object]:
    """The two plain decoders written into `stage`; (the merged file's inputs, its flag)."""
    for with_cache_branch, name in ((False, FIRST_STEP), (True, LATER_STEPS)):
        model = load_model(merged, merged_ok=True)
        if merged_if(model) is None:
            raise BadInput(f"{merged}: not an Optimum merged decoder (no If on an input "
                           f"'{FLAG}' holding the layers)")
        inputs, flag = [v.name for v in model.graph.inputs], with_cache(model)
        name_nodes(branch(model, with_cache_branch))
        save_model(model, stage / name)
    return inputs, flag


def _copy_others(src: Path, encoder: Path, stage: Path) -> None:
    """The encoder as ENCODER (its external data under the names it gives them), then every
    file that is no graph's: configs, tokenizer, generation and preprocessor configs, from
    the folder and its graphs' folder."""
    graph, *data = model_files(encoder)
    shutil.copy2(graph, stage / ENCODER)
    for f in data:
        shutil.copy2(f, stage / f.name)
    for folder in dict.fromkeys((src, encoder.parent)):
        for f in other_files(folder):
            if not (stage / f.name).exists():
                shutil.copy2(f, stage / f.name)


def unmerge_folder(src: str | Path, dst: str | Path, tolerance: Tolerance = Tolerance(),
                   dtype: str = "fp32") -> VerifyResult:
    """`src`'s merged decoder (of `dtype`) as its two plain ones, in `dst` beside a copy of
    its encoder and the rest; BadInput: not such a folder; NotExact: a branch differs from
    the merged file (nothing is written)."""
    from tuner.runtime.registry import get_backend

    src, dst = Path(src), Path(dst)
    encoder, merged = _graphs(src, dtype)
    if dst.resolve() == src.resolve():
        raise BadInput(f"{dst}: refusing to overwrite the input folder")
    ensure_writable_dir(dst.parent, f"unmerged folder {dst.name}")
    stage = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}."))
    runners = []
    try:
        inputs, flag = _write_branches(merged, stage)
        _copy_others(src, encoder, stage)
        record = find_seq2seq_record(stage)
        cpu = get_backend("ort-cpu")
        runners = [cpu.load(stage / f) for f in (ENCODER, FIRST_STEP, LATER_STEPS)]
        runners.append(load_reference(merged))
        result = check_branches(record, *runners, merged_inputs=inputs, flag=flag,
                                tolerance=tolerance)
        for runner in runners:
            runner.close()
        runners = []
        if not result:
            raise NotExact(result)
        swap_dir_into_place(stage, dst)
    except BaseException:
        for runner in runners:
            runner.close()
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return result
