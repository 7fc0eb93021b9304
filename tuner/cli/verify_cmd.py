"""`tuner verify ORIGINAL.onnx VARIANT.onnx [--inputs FILE.npz] [--atol A] [--rtol R]`.

Prints the accuracy table; exit 0 when every output matches, 1 when one does not, 2 on bad
input (unreadable model, inputs that do not fit it)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tuner.cli.app import app, roles_option, with_roles, write_out
from tuner.errors import BadInput


@app.command("verify")
@with_roles
def verify_cmd(
    original: Path = typer.Argument(..., help="the reference model (.onnx)"),
    variant: Path = typer.Argument(..., help="the model to check against it (.onnx)"),
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
    compared, and an output with nothing compared FAILS."""
    from tuner.gate.entry import prepare
    from tuner.gate.feeds import check_feed, load_npz
    from tuner.gate.verify import Tolerance
    from tuner.graph.load import load_model
    from tuner.graph.roles import input_specs
    from tuner.runtime.registry import get_backend

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
    user_feeds = None
    if inputs is not None:
        user_feeds = [load_npz(inputs)]
        check_feed(user_feeds[0], input_specs(load_model(original)))
    backend = get_backend("ort-cpu")
    try:
        gate = prepare(original, lambda: backend.load(original), variant, feeds=user_feeds,
                       vocab=vocab, seed=seed, tolerance=tol,
                       min_compared=min_compared)
        if inputs is not None or vocab is not None:  # feeds the user chose: theirs to fix
            _check_reference_runs(gate.reference, gate.feed_dicts(),
                                  f"{inputs}" if inputs is not None
                                  else f"token ids below --vocab {vocab}")
        cand = backend.load(variant)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - ORT's errors on a bad graph are bad input here
        raise BadInput(f"ONNX Runtime cannot load the models: {str(e).splitlines()[0]}") from None
    result = gate.check(cand)
    write_out(result.table() + "\n")  # a reader that goes away: 141, as for inspect
    if result.reference_failed:  # nothing compared, and not the variant's doing
        raise BadInput(f"ONNX Runtime cannot run {original} on the gate's feeds here: "
                       f"{result.errors[0]}")
    # SystemExit, not typer.Exit: with standalone_mode=False click returns (drops) Exit codes.
    raise SystemExit(0 if result else 1)


def _check_reference_runs(ref, feeds, what: str) -> None:
    """Inputs the user chose (--inputs, or --vocab past the embedding) must run on the
    original: when they do not, that is bad input, not a failed comparison of the variant."""

    for feed in feeds:
        try:
            ref.infer(feed)
        except Exception as e:  # noqa: BLE001 - ORT's message names the node and the bad value
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise BadInput(f"{what}: the original model cannot run these inputs: {first}") from None
