"""`tuner pad` as a job: rewrite a model exactly, gate it against the original on ONNX Runtime
(CPU), and only then write it, atomically.

    result = pad_file("in.onnx", "out.onnx", PadRequest(vocab_size=50304))
    result = pad_model(model.clone(), shape, req, dst, check)

`pad_model` is what `tuner optimize` uses for each candidate: the model it already holds (a
copy: the rewrite edits in place), the shape it already inspected, one prepared gate
(tuner.gate.entry.prepare) for all candidates. `pad_file` is the whole command for one file.
"""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from tuner.errors import BadInput
from tuner.gate.feeds import DEFAULT_SHAPES
from tuner.gate.entry import GateCheck, prepare
from tuner.gate.rows_alone import reference_for
from tuner.gate.verify import Tolerance, VerifyResult
from tuner.graph.inspect import inspect_model
from tuner.graph.io import vocab_for_feeds
from tuner.graph.load import load_model, save_model
from tuner.graph.paddable import Transform
from tuner.graph.shape import ModelShape
from tuner.rewrite.compose import PadRequest, apply
from tuner.rewrite.rotary_batch import expand_rotary_caches
from tuner.runtime.base import Runner, SessionSettings
from tuner.runtime.registry import get_backend
from tuner.util.files import ensure_writable_dir

Feeds = Sequence[Mapping[str, np.ndarray]]


class NotExact(RuntimeError):
    """The rewritten graph failed the accuracy gate: nothing was written (exit 1: our bug)."""

    def __init__(self, result: VerifyResult) -> None:
        super().__init__("the rewritten model does not match the original within tolerance; "
                         "nothing was written\n" + result.table())
        self.result = result


@dataclass(frozen=True)
class PadResult:
    src: str
    dst: str
    records: tuple[Transform, ...]
    accuracy: VerifyResult | None  # None when verification was skipped
    rebatched: int = 0  # RotaryEmbedding nodes whose one-row caches now expand to the batch

    @property
    def transforms(self) -> tuple[str, ...]:
        """The rewrites as people read them: "vocab 50257->50304"."""
        return tuple(t.label() for t in self.records)

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "transforms": list(self.transforms),
                "rebatched_rotary_nodes": self.rebatched,
                "accuracy": self.accuracy.to_json() if self.accuracy is not None else None}


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_destination(src: Path, dst: Path, what: str = "padded model") -> None:
    """Fail before the rewrite and the gate, not at the final rename: a folder or a place we
    cannot write is bad input."""
    if dst.resolve() == src.resolve():
        raise BadInput(f"{dst}: refusing to overwrite the input model")
    if dst.is_dir():
        raise BadInput(f"{dst}: is a folder; give the path of the .onnx file to write")
    ensure_writable_dir(dst.parent, f"{what} {dst.name}")


def load_reference(src: Path, settings: SessionSettings = SessionSettings()) -> Runner:
    """The original on ONNX Runtime CPU: what every variant is compared against."""
    try:
        return get_backend("ort-cpu").load(src, settings)
    except BadInput:
        raise
    except Exception as e:  # noqa: BLE001 - the user's graph: bad input, not our bug
        raise BadInput(f"{src}: ONNX Runtime cannot load the original model, so no "
                       f"variant of it can be verified: {_first_line(e)}") from None


def gate(check: GateCheck, staged: Path) -> VerifyResult:
    """The staged variant through `check` (tuner.gate.entry.prepare); NotExact unless it
    passes. A cache model's variant is gated through greedy rollouts, fed a widened past when
    its rewrite widened the cache interface (read from the staged file)."""
    try:
        candidate = get_backend("ort-cpu").load(staged)
    except Exception as e:  # noqa: BLE001 - a graph ORT rejects is our rewrite's bug
        raise NotExact(VerifyResult((), len(check.feeds), "-", (
            f"the rewritten model does not load: {_first_line(e)}",))) from None
    try:
        result = check.check(candidate, staged)
    finally:
        candidate.close()
    if result.reference_failed:  # not the variant's fault: the original does not run here
        raise BadInput(f"ONNX Runtime cannot run the original on the gate's feeds here, so no "
                       f"variant of it can be verified: {result.errors[0]}")
    if not result:
        raise NotExact(result)
    return result


def move_into_place(staged: Path, dst: Path) -> None:
    data = staged.parent / (dst.name + ".data")
    if data.exists():  # the weights first, so the .onnx never points at nothing
        os.replace(data, dst.parent / data.name)
    os.replace(staged, dst)


def write_checked(model: ir.Model, dst: Path,
                  check: Callable[[Path], VerifyResult]) -> VerifyResult:
    """Save `model` (spent: its weights are let go) beside `dst`, run `check` on the staged
    file, and move it into place only when the check passes; NotExact, nothing written,
    otherwise. The caller holds no other copy of the weights while the check runs."""
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.") as tmp:
        staged = save_model(model, Path(tmp) / dst.name)
        let_go_of_weights(model)  # the check's sessions need the memory
        gc.collect()
        result = check(staged)
        if not result:
            raise NotExact(result)
        move_into_place(staged, dst)
    return result


def let_go_of_weights(model: ir.Model) -> None:
    """Drop the saved model's tensors (it is spent: the rewrite edited it in place). The
    source's own tensors are not touched: a clone (optimize's) has its own values."""
    for value in model.graph.initializers.values():
        value.const_value = None


def pad_model(model: ir.Model, shape: ModelShape, req: PadRequest, dst: Path,
              check: GateCheck | None, src: str = "") -> PadResult:
    """Rewrite `model` (edited in place), gate it through `check` (skipped when None), then
    write `dst` atomically. NotExact: nothing was written."""
    model, records = apply(model, shape, req)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.") as tmp:
        staged = save_model(model, Path(tmp) / dst.name)
        # the padded weights live in `model` until it goes: for a 3.5 GB model that is GBs
        # the ONNX Runtime session of the gate needs. A caller holding the model too
        # (pad_file does) would keep them alive through the gate: the saved model lets go.
        let_go_of_weights(model)
        del model
        gc.collect()
        result = gate(check, staged) if check is not None else None
        move_into_place(staged, dst)
    return PadResult(src, str(dst), tuple(records), result)


def pad_file(src: str | os.PathLike, dst: str | os.PathLike, req: PadRequest, verify: bool = True,
             tolerance: Tolerance = Tolerance(), feeds: Feeds | None = None,
             shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES) -> PadResult:
    """Load, rewrite, verify against the original on ONNX Runtime CPU, then write `dst`
    atomically. Raises NotExact (nothing written) when the gate fails. A graph that runs one
    row at a time (tuner.graph.rotary_caches) is made to run batches as well, and gated
    against the original run on each row alone."""
    src, dst = Path(src), Path(dst)
    check_destination(src, dst)
    model = load_model(src)
    shape = inspect_model(model)
    # a graph that runs one row at a time: made to run batches, checked row by row
    load, one_row = reference_for(model, lambda: load_reference(src))
    rebatched = expand_rotary_caches(model) if one_row else 0
    check = (prepare(model, load, feeds=feeds, vocab=vocab_for_feeds(model, shape),
                     shapes=shapes, tolerance=tolerance) if verify else None)
    try:
        return replace(pad_model(model, shape, req, dst, check, src=str(src)),
                       rebatched=rebatched)
    finally:
        if check is not None:
            check.close()
