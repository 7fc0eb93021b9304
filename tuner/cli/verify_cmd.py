"""`tuner verify ORIGINAL.onnx VARIANT.onnx [--inputs FILE.npz] [--atol A] [--rtol R]`.

Prints the accuracy table; exit 0 when every output matches, 1 when one does not, 2 on bad
input (unreadable model, inputs that do not fit it)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from tuner.cli.app import app, write_out
from tuner.errors import BadInput
from tuner.gate.feeds import check_feed, load_npz, make_feeds
from tuner.graph.cache_record import cache_record
from tuner.gate.kv_gate import CacheFeeds, cache_feeds, check, has_cache
from tuner.gate.verify import Tolerance, record_then_release
from tuner.graph.inspect import inspect_model
from tuner.graph.io import model_precision, vocab_for_feeds
from tuner.graph.kv_cache import widened_cache
from tuner.graph.load import load_model
from tuner.graph.roles import input_specs
from tuner.runtime.registry import get_backend


@app.command("verify")
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
) -> None:
    """Run both models on the same inputs and compare every output (max abs/rel error, cosine,
    top-1 agreement); positions masked out by the attention mask (found from the graph) are not
    compared, and an output with nothing compared FAILS."""

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
    ref_model = load_model(original)
    cand_model = load_model(variant)
    cand_specs = input_specs(cand_model)
    specs = input_specs(ref_model)
    tol = tol.at_precision(model_precision(ref_model))  # an fp16 model at fp16 tolerances
    if [(s.name, s.dtype) for s in specs] != [(s.name, s.dtype) for s in cand_specs]:
        raise BadInput(f"the models take different inputs: {[s.name for s in specs]} vs "
                       f"{[s.name for s in cand_specs]}")
    if inputs is not None:
        feed = load_npz(inputs)
        check_feed(feed, specs)
        feeds = [feed]
    elif has_cache(ref_model):  # greedy rollouts, each model fed its own present
        feeds = cache_feeds(cache_record(ref_model), vocab or _vocab(ref_model), seed=seed)
    else:
        feeds = make_feeds(specs, vocab or _vocab(ref_model), seed=seed)
    backend = get_backend("ort-cpu")
    del ref_model  # lazily loaded weights it read (for _vocab) would stay in memory
    widened = widened_cache(cand_model)
    del cand_model
    try:
        if isinstance(feeds, CacheFeeds):  # a rollout asks the reference as it goes
            ref = backend.load(original)
        else:  # one session at a time: the original's outputs are recorded, then it goes
            ref = record_then_release(lambda: backend.load(original), feeds)
        if inputs is not None or vocab is not None:  # feeds the user chose: theirs to fix
            starts = ([s.arrays for s, _ in feeds.starts] if isinstance(feeds, CacheFeeds)
                      else feeds)
            _check_reference_runs(ref, starts, f"{inputs}" if inputs is not None
                                  else f"token ids below --vocab {vocab}")
        cand = backend.load(variant)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - ORT's errors on a bad graph are bad input here
        raise BadInput(f"ONNX Runtime cannot load the models: {str(e).splitlines()[0]}") from None
    result = check(ref, cand, feeds, tol, widened, specs, min_compared)
    write_out(result.table() + "\n")  # a reader that goes away: 141, as for inspect
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


def _vocab(model) -> int:
    """Token ids must stay inside the embedding: its row count (the smallest 2-D Gather table
    fed by an input would be too clever; inspect knows best, else the biggest Gather table)."""
    try:

        return vocab_for_feeds(model, inspect_model(model))
    except Exception:  # noqa: BLE001 - not a transformer inspect understands: any Gather table
        rows = [n.inputs[0].const_value.shape[0] for n in model.graph
                if n.op_type == "Gather" and n.inputs[0] is not None
                and n.inputs[0].const_value is not None and len(n.inputs[0].const_value.shape) == 2]
        return int(min(rows)) if rows else 2
