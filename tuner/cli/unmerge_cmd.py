"""`tuner unmerge MERGED.onnx -o OUT.onnx`: Optimum's legacy merged decoder
(`decoder_model_merged.onnx`) as one plain graph with its KV cache, verified against the
merged file before it is written (atomically). Exit 0 written, 1 not exact (nothing
written), 2 bad input (not a merged decoder, OUT exists without --force)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from tuner.cli.app import app, exit_not_exact
from tuner.errors import BadInput


@app.command("unmerge")
def unmerge_cmd(
    model: Path = typer.Argument(..., help="the merged decoder (decoder_model_merged.onnx)"),
    output: Path = typer.Option(..., "-o", "--output", help="where to write the plain graph"),
    atol: float = typer.Option(1e-4, "--atol", help="absolute tolerance of the accuracy gate"),
    rtol: float = typer.Option(1e-3, "--rtol", help="relative tolerance of the accuracy gate"),
    as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object"),
    force: bool = typer.Option(False, "--force", help="replace OUT if it exists"),
) -> None:
    """Make Optimum's legacy merged decoder (its layers in an If on `use_cache_branch`) one
    plain graph that every other command reads: the with-cache branch inlined (a past of
    length 0 is the first step), checked against the merged file through greedy rollouts
    on ONNX Runtime, and only then written."""
    from tuner.gate.verify import Tolerance
    from tuner.jobs.pad import NotExact
    from tuner.jobs.unmerge import unmerge_file

    if output.is_file() and not force:
        raise BadInput(f"{output} exists; pass --force to replace it")
    try:
        tol = Tolerance(atol=atol, rtol=rtol)
    except ValueError as e:
        raise BadInput(str(e)) from None
    try:
        result = unmerge_file(model, output, tolerance=tol)
    except NotExact as e:
        exit_not_exact(e.result, as_json, "plain graph")
    if as_json:
        print(json.dumps({"written": True, "src": str(model), "dst": str(output),
                          "accuracy": result.to_json()}))
        return
    print(result.table())
    typer.echo(f"unmerged {model} -> {output}")
