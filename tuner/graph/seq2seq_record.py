"""An encoder-decoder export folder as a generation loop runs it (serving.generation.seq2seq).

Optimum exports T5, BART, Marian, Pegasus (and Whisper, whose encoder reads log-mel
features (B, bins, frames) instead of ids, without a mask) as three graphs that run in turn:

    encoder_model.onnx            source ids (B, S), mask (B, S)        -> states (B, S, h)
    decoder_model.onnx            start ids (B, 1), states, mask        -> logits, presents:
                                                                           self (B, H, 1, d) and
                                                                           cross (B, H, S, d)
    decoder_with_past_model.onnx  last ids (B, 1), mask, past self, cross -> logits, self presents

The roles come from the structure (tuner.graph.roles: token ids, encoder states / mask /
cache, the growing cache); which output feeds which past follows Optimum's names, the one
thing a graph does not say: `past_key_values.N.*` is fed `present.N.*` of the run before
(the cross keys/values from the first step, for every later step). One record per folder,
found once; anything a loop could not feed is BadInput naming the graph and the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import onnx_ir as ir

from tuner.errors import BadInput
from tuner.graph.inspect import inspect_model
from tuner.graph.io import max_positions, quantizes_activations
from tuner.graph.load import graphs_folder, load_model
from tuner.graph.role_names import (ATTENTION_MASK, ENCODER_CACHE, ENCODER_MASK, ENCODER_STATES,
                                    KV_CACHE, TOKEN_IDS)
from tuner.graph.roles import InputSpec, input_specs

ENCODER, FIRST_STEP, LATER_STEPS = ("encoder_model.onnx", "decoder_model.onnx",
                                    "decoder_with_past_model.onnx")
FILES = (ENCODER, FIRST_STEP, LATER_STEPS)


MERGED = "decoder_model_merged.onnx"


def graphs_dir(folder: Path) -> Path:
    """Where an encoder-decoder folder's graphs lie: tuner.graph.load.graphs_folder (the
    folder, or its `onnx/` as transformers.js repositories hold them), the one rule every
    command follows."""
    return graphs_folder(Path(folder))


def is_seq2seq_folder(folder: Path) -> bool:
    """An encoder-decoder export folder (its three graphs present, in it or its `onnx/`), as
    Optimum writes it and `tuner pad FOLDER` copies it."""
    graphs = graphs_dir(folder)
    return folder.is_dir() and all((graphs / f).is_file() for f in FILES)


def merged_only(folder: Path) -> str | None:
    """For an encoder-decoder folder that holds Optimum's merged decoder but not the two plain
    ones (which a generation loop runs), the sentence that says so and what to do; else
    None."""
    graphs = graphs_dir(folder)
    if not ((graphs / ENCODER).is_file() and (graphs / MERGED).is_file()) or \
            is_seq2seq_folder(folder):
        return None
    return (f"{folder}: an encoder-decoder folder with {ENCODER} and {MERGED} only; the loop "
            f"here runs the two plain decoders ({FIRST_STEP}, {LATER_STEPS}): `tuner unmerge "
            f"{folder} -o OUT` writes them (checked against the merged one), then `tuner "
            "serve OUT`")


@dataclass(frozen=True)
class EncoderIO:
    source: str  # what it reads: token ids (B, S), or features (B, bins, frames)
    mask: str | None
    output: str  # the states (B, S, h) the decoders read
    source_dtype: str
    mask_dtype: str | None
    max_positions: int | None  # its position table's rows (BART's 1024), None: relative
    features: tuple[int, int] | None = None  # (bins, frames): an audio encoder's one shape


@dataclass(frozen=True)
class DecoderIO:
    """One decoder graph's names: what it takes (beside its past) and its logits."""

    token_ids: str
    states: str | None  # the encoder's output, where this graph takes it
    mask: str | None  # the encoder's mask (Whisper's decoders take none)
    logits: str
    ids_dtype: str
    mask_dtype: str | None
    # (the with-past graph) each past input -> the output of the run before that feeds it:
    # its own cache from the step before, the cross keys/values from the first step
    own_past: Mapping[str, str] = field(default_factory=dict)
    cross_past: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Seq2SeqRecord:
    folder: Path
    encoder: EncoderIO
    first: DecoderIO
    later: DecoderIO
    vocab: int  # the logits' width (a padded vocabulary's slice is already cut in the graph)
    max_positions: int | None  # the decoder's position table's rows (None: relative, T5)
    # the graphs that quantize their activations with one range per run (ONNX Runtime's
    # quantize_dynamic: DynamicQuantizeLinear), so that a row's numbers depend on the run
    quantized_per_run: tuple[str, ...] = ()

    @property
    def activations_quantized(self) -> bool:
        """A decoder's step depends on its run: the cache path cannot be exact as served."""
        return FIRST_STEP in self.quantized_per_run or LATER_STEPS in self.quantized_per_run

    @property
    def rows_coupled(self) -> bool:
        """A row's numbers depend on the other rows of its run (the encoder's or a
        decoder's): streams are generated apart."""
        return bool(self.quantized_per_run)


def _present_name(past: str) -> str:
    """Optimum's pairing: `past_key_values.N.decoder.key` is fed `present.N.decoder.key`."""
    for old in ("past_key_values", "past"):
        if past.startswith(old):
            return "present" + past[len(old):]
    return past


def _one(specs: list[InputSpec], role: str, file: str, needed: bool = True) -> InputSpec | None:
    found = [s for s in specs if s.role == role]
    if len(found) > 1 or (needed and not found):
        what = "no input" if not found else f"{len(found)} inputs"
        raise BadInput(f"{file}: {what} with the role {role}; generation needs one "
                       "(--roles names it)")
    if found and found[0].batch_axis not in (None, 0):
        raise BadInput(f"{file}: input {found[0].name!r} has its batch on axis "
                       f"{found[0].batch_axis}; generation stacks rows on axis 0")
    return found[0] if found else None


def _logits(model: ir.Model, file: str) -> tuple[str, int]:
    """The decoder's logits: its one output of rank 3 with a fixed last axis (the vocabulary;
    the presents are of rank 4)."""
    found = [(v.name, v.shape[2]) for v in model.graph.outputs
             if v.shape is not None and len(v.shape) == 3 and isinstance(v.shape[2], int)]
    if len(found) != 1:
        raise BadInput(f"{file}: {len(found)} outputs of shape (batch, seq, vocab); "
                       "generation needs the logits as one")
    return found[0]


def _features(specs: list[InputSpec]) -> InputSpec | None:
    """An audio encoder's input: one float input (B, bins, frames), both fixed (Whisper's
    (B, 80, 3000) log-mel features)."""
    found = [s for s in specs if s.dtype.startswith("float") and len(s.dims) == 3
             and all(isinstance(d, int) and d > 0 for d in s.dims[1:])]
    return found[0] if len(found) == 1 and len(specs) == 1 else None


def _encoder(model: ir.Model) -> EncoderIO:
    specs = input_specs(model)
    source = next((s for s in specs if s.role == TOKEN_IDS), None) or _features(specs)
    if source is None:
        takes = ", ".join(f"{s.name} {list(s.dims)}" for s in specs)
        raise BadInput(f"{ENCODER}: its input is neither token ids nor audio features "
                       f"({takes}): generation here takes text, token ids or audio; an image "
                       "encoder's generation loop stays the client's (Optimum's "
                       "ORTModelForVision2Seq)")
    mask = _one(specs, ATTENTION_MASK, ENCODER, needed=False)
    outputs = [v for v in model.graph.outputs if v.shape is not None and len(v.shape) == 3]
    if not outputs:
        raise BadInput(f"{ENCODER}: no output of shape (batch, seq, hidden) for the decoders")
    features = tuple(source.dims[1:]) if source.role != TOKEN_IDS else None
    return EncoderIO(source.name, mask.name if mask else None, outputs[0].name, source.dtype,
                     mask.dtype if mask else None,
                     max_positions(model, inspect_model(model)) if features is None else None,
                     features)


def _decoder(model: ir.Model, file: str) -> tuple[DecoderIO, list[InputSpec], int]:
    specs = input_specs(model)
    ids = _one(specs, TOKEN_IDS, file)
    states = _one(specs, ENCODER_STATES, file, needed=False)
    mask = _one(specs, ENCODER_MASK, file, needed=False)
    logits, vocab = _logits(model, file)
    known = {ids.name, *(s.name for s in (states, mask) if s is not None)}
    odd = [s.name for s in specs if s.name not in known
           and s.role not in (KV_CACHE, ENCODER_CACHE)]
    if odd:
        raise BadInput(f"{file}: input {odd[0]!r} is none generation feeds (token ids, the "
                       "encoder's states and mask, the caches)")
    return (DecoderIO(ids.name, states.name if states else None, mask.name if mask else None,
                      logits, ids.dtype, mask.dtype if mask else None), specs, vocab)


def _pairs(specs: list[InputSpec], role: str, sources: set[str], file: str, source: str
           ) -> dict[str, str]:
    out = {}
    for s in specs:
        if s.role != role:
            continue
        name = _present_name(s.name)
        if name not in sources:
            raise BadInput(f"{file}: nothing feeds its input {s.name!r}: {source} has no "
                           f"output {name!r}")
        out[s.name] = name
    return out


def find_seq2seq_record(folder: Path) -> Seq2SeqRecord:
    """The record of an encoder-decoder export folder (is_seq2seq_folder); BadInput saying
    what a generation loop could not feed."""
    try:
        return _record(folder)
    except BadInput as e:
        raise BadInput(f"{folder}: {e}") from None


def _record(folder: Path) -> Seq2SeqRecord:
    graphs = graphs_dir(folder)
    encoder_model = load_model(graphs / ENCODER)
    encoder = _encoder(encoder_model)
    first_model, later_model = load_model(graphs / FIRST_STEP), load_model(graphs / LATER_STEPS)
    first, first_specs, vocab = _decoder(first_model, FIRST_STEP)
    later, later_specs, later_vocab = _decoder(later_model, LATER_STEPS)
    if first.states is None:
        raise BadInput(f"{FIRST_STEP}: no input takes the encoder's states")
    if any(s.role in (KV_CACHE, ENCODER_CACHE) for s in first_specs):
        raise BadInput(f"{FIRST_STEP}: takes a past; the first step starts without one")
    if later_vocab != vocab:
        raise BadInput(f"{LATER_STEPS}: logits of width {later_vocab}, {FIRST_STEP}'s "
                       f"{vocab}: not one model's decoders")
    first_out = {v.name for v in first_model.graph.outputs}
    later_out = {v.name for v in later_model.graph.outputs}
    own = _pairs(later_specs, KV_CACHE, first_out & later_out, LATER_STEPS,
                 f"{FIRST_STEP} or {LATER_STEPS}")
    if not own:
        raise BadInput(f"{LATER_STEPS}: no growing cache input found")
    cross = _pairs(later_specs, ENCODER_CACHE, first_out, LATER_STEPS, FIRST_STEP)
    if not cross and later.states is None:
        raise BadInput(f"{LATER_STEPS}: reads nothing of the encoder (no cross keys/values, "
                       "no states)")
    later = DecoderIO(later.token_ids, later.states, later.mask, later.logits, later.ids_dtype,
                      later.mask_dtype, own, cross)
    quantized = tuple(f for f, m in zip(FILES, (encoder_model, first_model, later_model))
                      if quantizes_activations(m))
    return Seq2SeqRecord(folder, encoder, first, later, vocab,
                         max_positions(first_model, inspect_model(first_model)), quantized)
