"""`tuner pad FOLDER -o OUT`: an export folder padded as a whole, the way it is loaded.

Optimum exports an encoder-decoder (T5, BART, Marian, Whisper) as a folder of graphs beside
its config and tokenizer:

    encoder_model.onnx            the encoder (no LM head: its vocabulary is not padded)
    decoder_model.onnx            the decoder's first step (computes the cross keys/values)
    decoder_with_past_model.onnx  every later step (takes them, and its own cache)
    decoder_model_merged.onnx     the two decoders again, inside an If (left out: see below)

Each graph gets the same multiples (each pads what it has) and is gated against its original
on its own (tuner.jobs.pad.pad_file); OUT appears only when every padded graph passed. A
graph no rewrite or gate here takes (a refused rewrite, inputs the gate cannot make: an
audio encoder's raw samples) is kept as it was, with the reason; every other file is copied.
The padded folder loads where the original did (Optimum's ORTModelForSeq2SeqLM, its own
generation loop): the padded logits are sliced back, so every graph keeps its inputs and
outputs. The merged decoder is left out (its layers sit inside an If that no rewrite reads):
without it, Optimum loads the two plain decoders. A decoder-only export folder (model.onnx
beside its tokenizer, and the legacy merged decoder or quantized copies) is padded the same
way. A transformers.js repository's graphs lie in its onnx/ (tuner.graph.load.graphs_folder):
OUT is written flat, graphs beside the configs, as Optimum writes a folder.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir

from tuner.errors import BadInput
from tuner.gate.verify import Tolerance
from tuner.graph.inspect import inspect_model
from tuner.graph.io import model_files, other_files
from tuner.graph.load import folder_graphs
from tuner.graph.shape import ModelShape
from tuner.jobs.pad import PadResult, pad_file
from tuner.rewrite.compose import PadRequest
from tuner.util.files import ensure_writable_dir, swap_dir_into_place


@dataclass(frozen=True)
class Multiples:
    """What `tuner pad` was asked for, applied to each graph of the folder."""

    ffn_multiple: int | None = None
    vocab_multiple: int | None = None
    head_dim: int | None = None
    heads: int | None = None
    hidden_multiple: int | None = None  # refused where the hidden size is not a multiple
    cache_policy: str = "keep"


@dataclass(frozen=True)
class FolderResult:
    """Each graph padded, copied (aligned already) or kept (not paddable), and what was left
    out."""

    src: str
    dst: str
    padded: tuple[PadResult, ...]
    copied: tuple[str, ...]  # file names copied unchanged (graphs already aligned, config)
    kept: tuple[tuple[str, str], ...]  # (graph, why) copied unpadded: it could not be
    left_out: tuple[str, ...]  # graphs not written, each with the reason

    def to_json(self) -> dict:
        return {"src": self.src, "dst": self.dst,
                "padded": [r.to_json() for r in self.padded], "copied": list(self.copied),
                "kept": [{"graph": name, "reason": why} for name, why in self.kept],
                "left_out": list(self.left_out)}


def _request(shape: ModelShape, want: Multiples) -> PadRequest:
    """`want` for one graph: the vocabulary only where it has an LM head (the encoder has
    none), the FFN only where it has one."""
    return PadRequest.from_multiples(
        shape, ffn_multiple=want.ffn_multiple if shape.ffn_size else None,
        vocab_multiple=want.vocab_multiple if shape.vocab_size else None,
        head_dim=want.head_dim, heads=want.heads, hidden_multiple=want.hidden_multiple,
        cache_policy=want.cache_policy)


def _shape(model: ir.Model) -> ModelShape | BadInput:
    try:
        return inspect_model(model)
    except BadInput as e:  # not a transformer inspect reads: kept as it was
        return e


def _graphs(src: Path) -> tuple[dict[Path, ModelShape | BadInput], list[str]]:
    """The folder's graphs to pad, each with its shape (or why it has none), and those left
    out (the merged decoder, with why)."""
    graphs, merged = folder_graphs(src, _shape)
    left_out = [f"{path.name}: its layers sit inside control flow (Optimum's merged decoder); "
                "the plain decoders beside it are padded instead" for path in merged]
    if not graphs:
        raise BadInput(f"{src}: no .onnx graph to pad in the folder"
                       + (f" ({'; '.join(left_out)})" if left_out else ""))
    heads = [s for s in graphs.values() if isinstance(s, ModelShape) and s.vocab_size]
    if left_out and not heads:  # the export's only decoder is the merged one
        raise BadInput(f"{src}: the decoder is only there merged ({left_out[0].split(':')[0]}); "
                       f"`tuner unmerge {src} -o OUT` writes decoder_model.onnx and "
                       "decoder_with_past_model.onnx from it (or export with `optimum-cli "
                       "export onnx --no-post-process`)")
    return graphs, left_out


def pad_folder(src: Path, dst: Path, want: Multiples,
               tolerance: Tolerance = Tolerance()) -> FolderResult:
    """Pad every graph of `src` (see the module's docstring) into `dst`, written whole or not
    at all. NotExact (tuner.jobs.pad) when a padded graph fails its gate; BadInput when no
    graph could be padded (each one's reason said)."""
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise BadInput(f"{dst}: refusing to overwrite the input folder")
    graphs, left_out = _graphs(src)
    ensure_writable_dir(dst.parent, f"padded folder {dst.name}")
    stage = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}."))
    try:
        padded, copied, kept = [], [], []
        for path, shape in graphs.items():
            try:
                if isinstance(shape, BadInput):
                    raise shape
                req = _request(shape, want)
                if not req.empty:
                    padded.append(pad_file(path, stage / path.name, req, tolerance=tolerance))
                    continue
                copied.append(path.name)  # already aligned
            except BadInput as e:  # the graph as it was: exact, and said
                kept.append((path.name, str(e)))
            copy_graph(path, stage)
        if not padded:
            raise BadInput(f"{src}: no graph could be padded"
                           + "".join(f"; {name}: {why}" for name, why in kept) if kept else
                           f"{src}: every graph is aligned already: nothing to pad")
        copied += _copy_others(src, stage)
        swap_dir_into_place(stage, dst)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return FolderResult(str(src), str(dst), tuple(padded), tuple(copied), tuple(kept),
                        tuple(left_out))


def copy_graph(path: Path, stage: Path) -> None:
    """The graph at `path` and its external data, into `stage`."""
    for f in model_files(path):  # the graph and its external data
        shutil.copy2(f, stage / f.name)


def _copy_others(src: Path, stage: Path) -> list[str]:
    """Every file of `src` that is no graph's (config, tokenizer, generation config; the
    merged decoder is a graph too)."""
    others = other_files(src)
    for f in others:
        shutil.copy2(f, stage / f.name)
    return [f.name for f in others]
