"""Compose the exact rewrites, verify, write atomically.

    req = PadRequest.from_multiples(shape, ffn_multiple=64, vocab_multiple=64)
    model, transforms = apply(model, shape, req)        # ["vocab 50257->50304", "ffn 600->640"]
    result = pad_file("in.onnx", "out.onnx", req)         # verifies before writing

The hidden size is never padded (LayerNorm/RMSNorm statistics would change); asking for it
is refused with that reason.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import onnx_ir as ir

from tuner.errors import BadInput, RewriteRefused
from tuner.graph.shape import ModelShape
from tuner.rewrite.common import remove_unused, save_atomic
from tuner.rewrite.ffn import pad_ffns
from tuner.rewrite.head_dim import pad_head_dim
from tuner.rewrite.heads import pad_heads
from tuner.rewrite.vocab import pad_vocab
from tuner.verify import Tolerance, VerifyResult

HIDDEN_REFUSAL = ("the hidden size is never padded: LayerNorm/RMSNorm statistics (mean and "
                  "variance over the hidden axis) would change, so the outputs would too")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise BadInput(f"{name} must be a positive integer, not {value!r}")


@dataclass(frozen=True)
class PadRequest:
    """Target sizes (None: leave as is). Each must be >= the model's own size."""

    ffn_size: int | None = None
    vocab_size: int | None = None
    head_dim: int | None = None
    num_heads: int | None = None

    def __post_init__(self) -> None:
        for name in ("ffn_size", "vocab_size", "head_dim", "num_heads"):
            _check_positive(name, getattr(self, name))

    @classmethod
    def from_multiples(cls, shape: ModelShape, ffn_multiple: int | None = None,
                       vocab_multiple: int | None = None, head_dim: int | None = None,
                       heads: int | None = None, hidden_multiple: int | None = None) -> "PadRequest":
        """Round the model's FFN width and vocabulary up to multiples; head dim and head count
        are absolute targets. Sizes already aligned stay None (nothing to do)."""
        for name, v in (("ffn_multiple", ffn_multiple), ("vocab_multiple", vocab_multiple),
                        ("hidden_multiple", hidden_multiple), ("head_dim", head_dim),
                        ("heads", heads)):
            _check_positive(name, v)
        if hidden_multiple is not None and shape.hidden_size % hidden_multiple:
            raise RewriteRefused(f"hidden size {shape.hidden_size}: {HIDDEN_REFUSAL}")
        ffn = round_up(shape.ffn_size, ffn_multiple) if ffn_multiple and shape.ffn_size else None
        vocab = (round_up(shape.vocab_size, vocab_multiple)
                 if vocab_multiple and shape.vocab_size else None)
        if vocab_multiple and not shape.vocab_size:
            raise RewriteRefused("--vocab-multiple: the model has no LM head (an encoder?)")
        return cls(ffn_size=ffn if ffn and ffn != shape.ffn_size else None,
                   vocab_size=vocab if vocab and vocab != shape.vocab_size else None,
                   head_dim=head_dim if head_dim is not None and head_dim != shape.head_dim
                   else None,
                   num_heads=heads if heads is not None and heads != shape.num_heads else None)

    @property
    def empty(self) -> bool:
        return all(v is None for v in (self.ffn_size, self.vocab_size, self.head_dim, self.num_heads))


def apply(model: ir.Model, shape: ModelShape, req: PadRequest) -> tuple[ir.Model, list[str]]:
    """Apply the requested rewrites to `model` (edited in place and returned) and list them.

    Raises RewriteRefused (naming the node) on a pattern a rewrite does not understand."""
    graph = model.graph
    done: list[str] = []
    if req.vocab_size is not None:
        old = pad_vocab(graph, shape.sites, req.vocab_size)
        if old != req.vocab_size:
            done.append(f"vocab {old}->{req.vocab_size}")
    if req.ffn_size is not None:
        ffns = [(i, layer.ffn) for i, layer in enumerate(shape.sites.layers) if layer.ffn]
        if not ffns:
            raise RewriteRefused("no FFN block found to pad")
        olds = sorted(set(pad_ffns(model, ffns, req.ffn_size)))
        if olds != [req.ffn_size]:
            done.append(f"ffn {'/'.join(map(str, olds))}->{req.ffn_size}")
    if req.head_dim is not None:
        old = pad_head_dim(model, shape, req.head_dim)
        if old != req.head_dim:
            done.append(f"head_dim {old}->{req.head_dim}")
        shape = dataclasses.replace(shape, head_dim=req.head_dim)  # node names are unchanged
    if req.num_heads is not None:
        old = pad_heads(model, shape, req.num_heads)
        if old != req.num_heads:
            done.append(f"heads {old}->{req.num_heads}")
    remove_unused(model)
    return model, done


class NotExact(RuntimeError):
    """The rewritten graph failed the accuracy gate: nothing was written (exit 1: our bug)."""

    def __init__(self, result: VerifyResult) -> None:
        super().__init__("the padded model does not match the original within tolerance; "
                         "nothing was written\n" + result.table())
        self.result = result


@dataclass(frozen=True)
class PadResult:
    src: str
    dst: str
    transforms: tuple[str, ...]
    accuracy: VerifyResult | None  # None when verification was skipped

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst, "transforms": list(self.transforms),
                "accuracy": self.accuracy.to_json() if self.accuracy is not None else None}


def vocab_for_feeds(model: ir.Model, shape: ModelShape) -> int:
    """How many token ids the model takes: its vocabulary, else its embedding's rows."""
    if shape.vocab_size:
        return shape.vocab_size
    emb = model.graph.initializers.get(shape.sites.embedding or "")
    if emb is not None and emb.const_value is not None and len(emb.const_value.shape) == 2:
        return int(emb.const_value.shape[0])
    return 100


def _check_destination(dst: Path) -> None:
    """Fail before the rewrite and the gate, not at the final rename: a folder or a place we
    cannot write is bad input."""
    if dst.is_dir():
        raise BadInput(f"{dst}: is a folder; give the path of the .onnx file to write")
    from tuner.paths import ensure_writable_dir

    ensure_writable_dir(dst.parent, f"padded model {dst.name}")


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def pad_file(src: str | os.PathLike, dst: str | os.PathLike, req: PadRequest, verify: bool = True,
             tolerance: Tolerance = Tolerance(), feeds: Sequence[dict] | None = None,
             shapes: Sequence[tuple[int, int]] = ((1, 7), (2, 16), (3, 33))) -> PadResult:
    """Load, rewrite, verify against the original on ONNX Runtime CPU, then write `dst`
    atomically. Raises NotExact (nothing written) when the gate fails."""
    from tuner.feeds import make_feeds
    from tuner.graph.inspect import inspect_model
    from tuner.graph.load import load_model

    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise BadInput(f"{dst}: refusing to overwrite the input model")
    _check_destination(dst)
    model = load_model(src)
    shape = inspect_model(model)
    vocab = vocab_for_feeds(model, shape)
    model, transforms = apply(model, shape, req)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".{dst.name}.") as tmp:
        staged = save_atomic(model, Path(tmp) / dst.name)
        # the padded weights live in `model` until it goes: for a 3.5 GB model that is GBs
        # the ONNX Runtime sessions below need
        del model
        gc.collect()
        result = None
        if verify:
            from tuner.runtime.registry import get_backend
            from tuner.verify import record_then_release
            from tuner.verify import verify as run_gate

            backend = get_backend("ort-cpu")
            feeds = list(feeds) if feeds is not None else make_feeds(src, vocab, shapes)
            try:
                # one session at a time: the original's outputs are kept, its session is not
                reference = record_then_release(lambda: backend.load(src), feeds)
            except Exception as e:  # noqa: BLE001 - the user's graph: bad input, not our bug
                raise BadInput(f"{src}: ONNX Runtime cannot load the original model, so no "
                               f"variant of it can be verified: {_first_line(e)}") from None
            try:
                candidate = backend.load(staged)
            except Exception as e:  # noqa: BLE001 - a graph ORT rejects is our rewrite's bug
                raise NotExact(VerifyResult((), len(feeds), "-", (
                    f"the padded model does not load: {_first_line(e)}",))) from None
            result = run_gate(reference, candidate, feeds, tolerance)
            if not result:
                raise NotExact(result)
        data = staged.parent / (dst.name + ".data")
        if data.exists():
            os.replace(data, dst.parent / data.name)
        os.replace(staged, dst)
    return PadResult(str(src), str(dst), tuple(transforms), result)
