"""The encoder's side of an encoder-decoder's decoder (T5, BART, Marian, Whisper as Optimum
exports them: `decoder_model.onnx` and `decoder_with_past_model.onnx`).

Such a decoder attends twice per layer: to its own tokens (causal, its cache grows) and to the
encoder's output (cross-attention). What it takes from the encoder runs along the encoder's
length, a symbol the decoder's tokens do not carry:

    decoder_model            encoder_hidden_states (B, E, h)     encoder_attention_mask (B, E)
    decoder_with_past_model  past_key_values.N.encoder.key/value (B, heads, E, d)   ditto mask

The with-past file's cross keys/values are a cache that never grows: no Concat appends to
them (tuner.graph.kv_cache does not pair them with a present: the caller's `pasts`). A GPT-2
decoder under an image encoder (VisionEncoderDecoder) takes encoder_hidden_states at every
step instead. Found by shapes and symbols only: a float input of rank 3 along a length
other than the tokens', or a past of rank 4 that no Concat appends to, along a length other
than the growing cache's; the mask is the 2-D input along that same length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import onnx_ir as ir

_FLOATS = ("FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE")


@dataclass(frozen=True)
class EncoderSide:
    """The inputs a decoder takes from its encoder, and the encoder's length symbol."""

    length: str  # the encoder's sequence symbol, e.g. "encoder_sequence_length"
    states: str | None  # the encoder's output (decoder_model), None in the with-past file
    mask: str | None  # the encoder's attention mask (Whisper's decoder takes none)
    cache: tuple[str, ...] = ()  # cross-attention keys and values (the with-past file)


def _dims(v: ir.Value) -> tuple:
    return tuple(v.shape.dims) if v.shape is not None else ()


def _symbols(v: ir.Value) -> list[str]:
    return [str(d) for d in _dims(v) if not isinstance(d, int) and d is not None]


def _dtype(v: ir.Value) -> str:
    return v.dtype.name if v.dtype is not None else "FLOAT"


def find_encoder_side(graph: ir.Graph, token_ids: ir.Value | None,
                      pasts: Collection[str]) -> EncoderSide | None:
    """The encoder's side of `graph` (see the module's docstring), None for a decoder-only or
    an encoder: `token_ids` is the decoder's token input (its axis 1 is the tokens' length),
    `pasts` the past inputs its growing cache appends to (tuner.graph.kv_cache)."""
    if token_ids is None or len(_dims(token_ids)) != 2:
        return None
    batch, tokens = (str(d) for d in _dims(token_ids))
    initializers = set(graph.initializers)
    inputs = [v for v in graph.inputs if v.name not in initializers]
    growing = {s for v in inputs if v.name in pasts for s in _symbols(v)} - {batch}
    states = [v for v in inputs if _dtype(v) in _FLOATS and len(_dims(v)) == 3
              and _symbols(v)[:1] == [batch] and len(_symbols(v)) == 2
              and _symbols(v)[1] != tokens]
    crossed = [v for v in inputs if _dtype(v) in _FLOATS and len(_dims(v)) == 4
               and v.name not in pasts and _symbols(v)[:1] == [batch]
               and len(_symbols(v)) == 2 and _symbols(v)[1] not in growing | {tokens}]
    lengths = {_symbols(v)[1] for v in (*states, *crossed)}
    if len(lengths) != 1 or len(states) > 1:
        return None  # none, or several lengths: not one encoder's
    length = lengths.pop()
    masks = [v for v in inputs if len(_dims(v)) == 2 and _symbols(v) == [batch, length]]
    return EncoderSide(length=length, states=states[0].name if states else None,
                       mask=masks[0].name if len(masks) == 1 else None,
                       cache=tuple(v.name for v in crossed))


# what may stand between the encoder's output and a projection reading it: GPT-2's Conv1D
# flattens its input to 2-D for a Gemm (VisionEncoderDecoder's GPT-2 decoder)
_PASS_THROUGH = ("Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze")


def reads_encoder(projection: ir.Node, side: EncoderSide) -> bool:
    """True when a projection (a cross-attention's K or V MatMul) reads the encoder's output,
    through casts and reshapes at most."""
    v = projection.inputs[0] if projection.inputs else None
    for _ in range(4):
        if v is None:
            return False
        if v.is_graph_input():
            return v.name == side.states
        producer = v.producer()
        if producer is None or producer.op_type not in _PASS_THROUGH:
            return False
        v = producer.inputs[0]
    return False


def cross_attention_count(found: int, side: EncoderSide | None) -> int:
    """Blocks attending to the encoder: those found reading its output (decoder_model), else
    one per key/value pair of the cross cache (the with-past file computes none of them)."""
    if side is None:
        return 0
    return found or len(side.cache) // 2
