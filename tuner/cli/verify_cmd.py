"""`tuner verify ORIGINAL.onnx VARIANT.onnx [--inputs FILE.npz] [--atol A] [--rtol R]`.

Prints the accuracy table; exit 0 when every output matches, 1 when one does not, 2 on bad
input (unreadable model, inputs that do not fit it). Two export folders (an Optimum
encoder-decoder and its padded copy): each graph of the first against its namesake."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tuner.cli.app import app, roles_option, with_roles, write_out
from tuner.errors import BadInput


@app.command("verify")
@with_roles
def verify_cmd(
    original: Path = typer.Argument(..., help="the reference model (.onnx), or an export "
                                    "folder"),
    variant: Path = typer.Argument(..., help="the model to check against it (.onnx), or the "
                                   "folder of its namesakes"),
    inputs: Optional[Path] = typer.Option(None, "--inputs", help="a .npz of input arrays to "
                                          "use instead of random token ids"),
    atol: float = typer.Option(1e-4, "--atol", help="absolute tolerance"),
    rtol: float = typer.Option(1e-3, "--rtol", help="relative tolerance"),
    fp16: bool = typer.Option(False, "--fp16", help="half-precision defaults (atol=rtol=1e-2)"),
    vocab: Optional[int] = typer.Option(None, "--vocab", help="token ids are drawn below this "
                                        "(default: the model's vocabulary)"),
    seed: int = typer.Option(0, "--seed", help="seed of the random inputs"),
    min_compared: int = typer.Option(1, "--min-compared", help="an output with fewer compared "
                                     "elements than this FAILS (nothing compared)"),
    roles: list[str] = roles_option(),
) -> None:
    """Run both models on the same inputs and compare every output (max abs/rel error, cosine,
    top-1 agreement); positions masked out by the attention mask (found from the graph) are not
    compared, and an output with nothing compared FAILS. A half-precision original is compared
    at its precision's tolerances; a variant that still differs from it is held to its float32
    copy instead (exact in float, and no further from it than the original is). Given two
    folders, every graph of the first (but a merged decoder) is checked against the one of the
    same name in the second."""
    from tuner.gate.verify import Tolerance

    try:
        tol = Tolerance.fp16() if fp16 else Tolerance(atol=atol, rtol=rtol)
    except ValueError as e:
        raise BadInput(str(e)) from None
    if vocab is not None and vocab < 1:
        raise BadInput(f"--vocab must be >= 1, not {vocab}")
    if seed < 0:
        raise BadInput(f"--seed must be >= 0, not {seed}")
    if min_compared < 1:
        raise BadInput(f"--min-compared must be >= 1, not {min_compared}")
    if original.is_dir() or variant.is_dir():
        if inputs is not None:
            raise BadInput("--inputs fits one graph: give two .onnx files with it")
        results = [_identical(a, b) or _pair(a, b, None, tol, vocab, seed, min_compared,
                                             folder=True)
                   for a, b in _namesakes(original, variant)]
        raise SystemExit(0 if all(results) else 1)
    raise SystemExit(0 if _pair(original, variant, inputs, tol, vocab, seed, min_compared)
                     else 1)


def _namesakes(original: Path, variant: Path) -> list[tuple[Path, Path]]:
    """(graph, its namesake) for every graph of folder `original` but a merged decoder."""
    from tuner.graph.load import folder_graphs, graphs_folder

    if not (original.is_dir() and variant.is_dir()):
        raise BadInput(f"give two folders or two .onnx files, not {original} and {variant}")
    graphs = list(folder_graphs(original)[0])
    theirs = graphs_folder(variant)  # (either may hold its graphs in onnx/)
    missing = [g.name for g in graphs if not (theirs / g.name).is_file()]
    if not graphs or missing:
        raise BadInput(f"{variant}: no {', '.join(missing)} to compare" if missing
                       else f"{original}: no .onnx graph (but a merged decoder) to compare")
    return [(g, theirs / g.name) for g in graphs]


def _identical(original: Path, variant: Path) -> bool:
    """The same bytes (a graph `pad FOLDER` kept as it was): the same outputs, not run."""
    import filecmp

    from tuner.graph.io import model_files

    ours, theirs = model_files(original), model_files(variant)
    same = [f.name for f in ours] == [f.name for f in theirs] and all(
        filecmp.cmp(a, b, shallow=False) for a, b in zip(ours, theirs))
    if same:
        write_out(f"{original.name}: the same bytes as {variant} (not run)\n")
    return same


def _pair(original: Path, variant: Path, inputs: Path | None, tol, vocab: int | None,
          seed: int, min_compared: int, folder: bool = False):
    """One graph against its variant: the table printed, the VerifyResult returned."""
    from tuner.gate.entry import prepare
    from tuner.gate.feeds import check_feed, load_npz
    from tuner.gate.rows_alone import reference_for
    from tuner.graph.load import load_model
    from tuner.graph.roles import input_specs
    from tuner.runtime.registry import get_backend

    model = load_model(original)  # read once: the feeds, the reference, the gate
    user_feeds = None
    if inputs is not None:
        user_feeds = [load_npz(inputs)]
        check_feed(user_feeds[0], input_specs(model))
    backend = get_backend("ort-cpu")
    load, one_row = reference_for(model, lambda: backend.load(original))
    if one_row:
        typer.echo(f"{original.name}: its RotaryEmbedding caches hold one row, so ONNX Runtime "
                   "runs it at batch 1 only: it is run on each row of a batch alone", err=True)
    try:
        gate = prepare(model, load, variant, feeds=user_feeds,
                       vocab=vocab, seed=seed, tolerance=tol,
                       min_compared=min_compared)
        if inputs is not None or vocab is not None:  # feeds the user chose: theirs to fix
            _check_reference_runs(gate, f"{inputs}" if inputs is not None
                                  else f"token ids below --vocab {vocab}")
        cand = backend.load(variant)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - ORT's errors on a bad graph are bad input here
        raise BadInput(f"ONNX Runtime cannot load the models: {str(e).splitlines()[0]}") from None
    result = gate.check(cand)
    head = f"{original.name}: " if folder else ""
    write_out(head + result.table() + "\n")  # a reader that goes away: 141, as for inspect
    if result.reference_failed:  # nothing compared, and not the variant's doing
        raise BadInput(f"ONNX Runtime cannot run {original} on the gate's feeds here: "
                       f"{result.errors[0]}")
    # the caller exits by SystemExit, not typer.Exit: with standalone_mode=False click
    # returns (drops) Exit codes
    return result


def _check_reference_runs(gate, what: str) -> None:
    """Inputs the user chose (--inputs, or --vocab past the embedding) must run on the
    original: when they do not, that is bad input, not a failed comparison of the variant."""
    first = gate.reference_failure()
    if first is not None:
        raise BadInput(f"{what}: the original model cannot run these inputs: {first}")
