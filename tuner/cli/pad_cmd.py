"""`tuner pad MODEL.onnx -o OUT.onnx [--ffn-multiple N] [--vocab-multiple N] [--head-dim N]
[--heads N]`: a deterministic exact padding, verified before it is written (atomically).
`tuner pad FOLDER -o OUT_FOLDER ...`: every graph of an export folder (Optimum's
encoder-decoder: encoder and decoders) padded alike, written as a whole (tuner.jobs.pad_folder)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from tuner.cli.app import app, exit_not_exact, roles_option, with_roles
from tuner.errors import BadInput


@app.command("pad")
@with_roles
def pad_cmd(
    model: Path = typer.Argument(..., help="the model to pad (.onnx), or an export folder "
                                 "(Optimum's encoder-decoder: every graph in it)"),
    output: Path = typer.Option(..., "-o", "--output", help="where to write the padded model "
                                "(a folder for a folder)"),
    ffn_multiple: Optional[int] = typer.Option(
        None, "--ffn-multiple", help="round the FFN width up to a multiple of N"),
    vocab_multiple: Optional[int] = typer.Option(
        None, "--vocab-multiple", help="round the vocabulary up to a multiple of N"),
    head_dim: Optional[int] = typer.Option(
        None, "--head-dim", help="pad the attention head dim to N"),
    heads: Optional[int] = typer.Option(
        None, "--heads", help="pad the number of attention heads to N"),
    hidden_multiple: Optional[int] = typer.Option(
        None, "--hidden-multiple", help="refused: the hidden size is never padded (says why)"),
    cache_policy: str = typer.Option(
        "keep", "--cache-policy", help="a decoder's KV cache under --head-dim/--heads: keep "
        "(clients see the original cache shape: past padded inside, present sliced back) or "
        "widen (the cache inputs/outputs become wider; zeros go in the new entries)"),
    atol: float = typer.Option(1e-4, "--atol", help="absolute tolerance of the accuracy gate"),
    rtol: float = typer.Option(1e-3, "--rtol", help="relative tolerance of the accuracy gate"),
    as_json: bool = typer.Option(False, "--json", help="print the result as one JSON object"),
    force: bool = typer.Option(False, "--force", help="replace OUT if it exists"),
    roles: list[str] = roles_option(),
) -> None:
    """Pad the model's GEMM dimensions with zeros so that outputs stay the same, check that on
    ONNX Runtime (several batch/sequence shapes with padded masks), and only then write OUT.

    Given a folder (an Optimum export of T5, BART, Whisper...: encoder_model.onnx,
    decoder_model.onnx, decoder_with_past_model.onnx), every graph in it is padded with the
    same multiples and gated on its own; OUT is a copy of the folder (config, tokenizer) with
    the padded graphs, written only when all of them passed, and loads where the original
    did (Optimum's ORTModelForSeq2SeqLM). A graph that cannot be padded is copied as it was,
    and the output says why."""
    from tuner.gate.verify import Tolerance
    from tuner.graph.inspect import inspect_model
    from tuner.graph.load import load_model
    from tuner.jobs.pad import pad_file
    from tuner.rewrite.compose import PadRequest

    taken = output.exists() if model.is_dir() else output.is_file()
    if taken and not force and output.resolve() != model.resolve():
        # a padded model is minutes of work to redo and may be the one being served
        raise BadInput(f"{output} exists; pass --force to replace it")
    try:
        tol = Tolerance(atol=atol, rtol=rtol)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if model.is_dir():
        from tuner.jobs.pad_folder import Multiples

        _nothing_to_pad(ffn_multiple, vocab_multiple, head_dim, heads)
        _pad_folder(model, output, Multiples(ffn_multiple, vocab_multiple, head_dim, heads,
                                             hidden_multiple, cache_policy), tol, as_json)
        return
    shape = inspect_model(load_model(model))
    req = PadRequest.from_multiples(shape, ffn_multiple=ffn_multiple,
                                    vocab_multiple=vocab_multiple, head_dim=head_dim,
                                    heads=heads, hidden_multiple=hidden_multiple,
                                    cache_policy=cache_policy)
    _nothing_to_pad(ffn_multiple, vocab_multiple, head_dim, heads)
    result = _gated(lambda: pad_file(model, output, req, tolerance=tol), "padded model", as_json)
    if result is None:
        return
    if result.accuracy is not None:
        print(result.accuracy.table())
    done = ", ".join(result.transforms) or "nothing (already aligned)"
    if result.rebatched:
        done += (f"; {result.rebatched} RotaryEmbedding node(s)' one-row cos/sin caches "
                 "expanded to the batch (the original ran at batch 1 only)")
    typer.echo(f"padded {model} -> {output}: {done}")


def _gated(job, what: str, as_json: bool):
    """`job()`'s result; a failed gate exits 1 (tables, nothing written); --json prints the
    result and gives None (nothing more to print)."""
    from tuner.jobs.pad import NotExact

    try:
        result = job()
    except NotExact as e:
        exit_not_exact(e.result, as_json, what)
    if as_json:
        print(json.dumps({"written": True, **result.to_json()}))
        return None
    return result


def _pad_folder(src: Path, dst: Path, want, tol, as_json: bool) -> None:
    from tuner.jobs.pad_folder import pad_folder

    result = _gated(lambda: pad_folder(src, dst, want, tolerance=tol), "padded folder", as_json)
    if result is None:
        return
    for r in result.padded:
        acc = r.accuracy
        gated = (f"gate passed over {acc.feeds} feed(s), max abs "
                 f"{max((o.max_abs for o in acc.outputs), default=0.0):.3g}" if acc else "")
        typer.echo(f"  {Path(r.src).name}: {', '.join(r.transforms) or 'nothing'} ({gated})")
    for name, why in result.kept:
        typer.echo(f"  {name}: kept as it was ({why})")
    for name in result.copied:
        typer.echo(f"  {name}: copied")
    for why in result.left_out:
        typer.echo(f"  left out {why}")
    typer.echo(f"padded {src} -> {dst}: {len(result.padded)} graph(s) padded and verified")


def _nothing_to_pad(*targets: int | None) -> None:
    if all(v is None for v in targets):
        raise BadInput("nothing to pad: give --ffn-multiple, --vocab-multiple, --head-dim "
                       "or --heads")
