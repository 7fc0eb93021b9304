"""The conversions into a graph that every other command reads, each checked against its
input by running before it is written (atomically). Exit 0 written, 1 not exact (nothing
written), 2 bad input (nothing to convert, OUT exists without --force).

    tuner unmerge MERGED.onnx -o OUT.onnx    Optimum's legacy merged decoder, one plain graph
    tuner unmerge FOLDER -o OUT              an encoder-decoder's, its two plain decoders
    tuner unmerge FOLDER -o OUT --dtype q8   ... of its transformers.js quantized copies
    tuner unwindow GENAI.onnx -o OUT.onnx    onnxruntime-genai's windowed caches, full-length
    tuner rebatch DYNAMO23.onnx -o OUT.onnx  torch's one-row rotary caches, expanded to the batch
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import typer

from tuner.cli.app import app, exit_not_exact
from tuner.errors import BadInput

_OUTPUT = typer.Option(..., "-o", "--output", help="where to write the converted graph")
_ATOL = typer.Option(1e-4, "--atol", help="absolute tolerance of the accuracy check")
_RTOL = typer.Option(1e-3, "--rtol", help="relative tolerance of the accuracy check")
_JSON = typer.Option(False, "--json", help="print the result as one JSON object")
_FORCE = typer.Option(False, "--force", help="replace OUT if it exists")


def _convert(job: Callable, verb: str, model: Path, output: Path, atol: float, rtol: float,
             as_json: bool, force: bool) -> None:
    """Run `job(model, output, tolerance=...)` (a VerifyResult, or NotExact) and say so."""
    from tuner.gate.verify import Tolerance
    from tuner.jobs.pad import NotExact

    if output.exists() and not force:
        raise BadInput(f"{output} exists; pass --force to replace it")
    try:
        tol = Tolerance(atol=atol, rtol=rtol)
    except ValueError as e:
        raise BadInput(str(e)) from None
    try:
        result = job(model, output, tolerance=tol)
    except NotExact as e:
        exit_not_exact(e.result, as_json, "converted graph")
    if as_json:
        print(json.dumps({"written": True, "src": str(model), "dst": str(output),
                          "accuracy": result.to_json()}))
        return
    print(result.table())
    typer.echo(f"{verb} {model} -> {output}")


def _check_of(job: Callable) -> Callable:
    """A job that returns (its check, what it found) as one that returns the check alone."""
    return lambda src, dst, tolerance: job(src, dst, tolerance)[0]


@app.command("unmerge")
def unmerge_cmd(
    model: Path = typer.Argument(..., help="the merged decoder (decoder_model_merged.onnx), "
                                           "or an encoder-decoder's export folder that holds "
                                           "it beside encoder_model.onnx"),
    output: Path = typer.Option(..., "-o", "--output", help="where to write the plain graph "
                                "(given a folder: the folder to write)"), atol: float = _ATOL, rtol: float = _RTOL,
    as_json: bool = _JSON, force: bool = _FORCE,
    dtype: str = typer.Option("fp32", "--dtype", help="given a transformers.js folder: which "
                              "of its precisions to unmerge, as transformers.js names them "
                              "(fp32: encoder_model.onnx and decoder_model_merged.onnx; q8 or "
                              "quantized: *_quantized.onnx; fp16, int8, uint8, q4, q4f16, "
                              "bnb4: *_fp16.onnx, ...); OUT holds them under the plain names"),
) -> None:
    """Make Optimum's legacy merged decoder (its layers in an If on `use_cache_branch`) one
    plain graph that every other command reads: the with-cache branch inlined (a past of
    length 0 is the first step), checked against the merged file through greedy rollouts
    on ONNX Runtime, and only then written. Given an encoder-decoder's folder (Whisper, T5,
    BART as transformers.js repositories ship them, graphs in it or in its onnx/), OUT is
    the folder `tuner serve` generates from: decoder_model.onnx (the first step) and
    decoder_with_past_model.onnx (the later ones), each checked against the merged file
    step by step, beside the encoder, configs and tokenizer (--dtype: its quantized or
    half-precision copies instead, e.g. encoder_model_quantized.onnx)."""
    from functools import partial

    from tuner.graph.js_dtypes import dtype_of
    from tuner.jobs.unmerge import unmerge_file
    from tuner.jobs.unmerge_folder import unmerge_folder

    if dtype_of(dtype) != "fp32" and not model.is_dir():
        raise BadInput(f"--dtype {dtype} picks the files of a folder; {model} is one graph")
    job = partial(unmerge_folder, dtype=dtype) if model.is_dir() else unmerge_file
    _convert(job, "unmerged", model, output, atol, rtol, as_json, force)


@app.command("unwindow")
def unwindow_cmd(
    model: Path = typer.Argument(..., help="a graph from onnxruntime-genai's builder whose "
                                           "sliding-window layers keep windowed caches"),
    output: Path = _OUTPUT, atol: float = _ATOL, rtol: float = _RTOL,
    as_json: bool = _JSON, force: bool = _FORCE,
) -> None:
    """Make onnxruntime-genai's windowed caches (Gemma 2 and 3, GPT-OSS: a sliding-window
    layer's cache holds only its window) as long as the other layers', so that one cache
    serves every layer: each layer still attends to its window only. Checked against the
    windowed graph through greedy rollouts that cross the window, then written. `tuner
    optimize` does this itself; the cost is the sliding layers' cache memory."""
    from tuner.jobs.unwindow import unwindow_file

    _convert(_check_of(unwindow_file), "unwindowed", model, output, atol, rtol, as_json, force)


@app.command("rebatch")
def rebatch_cmd(
    model: Path = typer.Argument(..., help="a graph whose RotaryEmbedding nodes take one-row "
                                           "cos/sin caches (`tuner inspect` says so)"),
    output: Path = _OUTPUT, atol: float = _ATOL, rtol: float = _RTOL,
    as_json: bool = _JSON, force: bool = _FORCE,
) -> None:
    """Make torch's opset-23 export of a decoder that computes its own positions (no
    position_ids input) run at any batch in ONNX Runtime: its RotaryEmbedding nodes take
    cos/sin caches of one row, which torch broadcasts and ONNX Runtime refuses at batch > 1.
    The caches are expanded to the batch; checked by running each row of batches of 1 to 3
    (padded masks) against the original on that row alone, then written. `tuner optimize`
    and `tuner pad` do this themselves."""
    from tuner.jobs.rotary_batch import rebatch_file

    _convert(_check_of(rebatch_file), "rebatched", model, output, atol, rtol, as_json, force)
