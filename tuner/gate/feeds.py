"""Realistic inputs for a transformer graph: random token ids inside the vocabulary, attention
masks with right and left padding, several (batch, seq) shapes; or the user's own .npz.

Used by the accuracy gate (`tuner verify`, `tuner pad`), the benchmark and the server's
self-check. Inputs are recognised by their role (tuner.graph.roles.input_specs: found from the
graph's structure): token ids below `vocab_size`, the attention mask (1 = real token),
token types (zeros), positions (past..past+seq-1), past keys/values (length `past`); what an
encoder-decoder's decoder takes from its encoder runs along the encoder's length
(`encoder_length`), its mask padded as the attention mask is; other integer inputs get zeros,
float inputs small normal noise. Every static dim is kept, every
dtype is the declared one (int32 ids, bool masks, fp16, bf16), and a (batch, seq) shape the
model cannot take is mapped onto one it can (a batch-1 export is fed batch 1).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.graph.role_names import ENCODER_MASK, ENCODER_ROLES
from tuner.graph.roles import (ATTENTION_MASK, KV_CACHE, POSITION_IDS, TOKEN_IDS, InputSpec,
                               accepted_shapes, input_specs, np_dtype)

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((1, 7), (2, 16), (3, 33))


def padded_mask(batch: int, seq: int, rng: np.random.Generator) -> np.ndarray:
    """A (batch, seq) int64 mask: row 0 full, then right-padded and left-padded rows in turn,
    each keeping at least one real token."""
    mask = np.ones((batch, seq), dtype=np.int64)
    for row in range(1, batch):
        keep = int(rng.integers(1, seq + 1)) if seq > 1 else 1
        if row % 2 == 1:
            mask[row, keep:] = 0  # right padding
        else:
            mask[row, : seq - keep] = 0  # left padding
    return mask


def encoder_length(seq: int) -> int:
    """The encoder's length fed beside `seq` decoder tokens: never the decoder's own (no axis
    can pass for the other) and longer, as a source to translate or summarize is."""
    return 2 * seq + 3


def concrete_dims(spec: InputSpec, batch: int, seq: int, past: int = 0,
                  has_cache: bool = False) -> tuple[int, ...]:
    """The shape of `spec` at (batch, seq): static dims kept, the batch axis gets `batch`, the
    sequence axis `seq` (`past` for a cache input, past + seq for a mask beside a cache, the
    encoder's length for what comes from an encoder), any other dynamic axis 1."""
    if not spec.dims:
        return (batch, seq) if spec.role in (TOKEN_IDS, ATTENTION_MASK, POSITION_IDS) else ()
    length = past if spec.role == KV_CACHE else (
        past + seq if spec.role == ATTENTION_MASK and has_cache else seq)
    if spec.role in ENCODER_ROLES:
        length = encoder_length(seq)
    out = []
    for i, d in enumerate(spec.dims):
        if isinstance(d, int) and d >= 0 and not (d == 0 and i in (spec.batch_axis, spec.seq_axis)):
            out.append(d)
        elif i == spec.batch_axis:
            out.append(batch)
        elif i == spec.seq_axis:
            out.append(length)
        else:
            out.append(1)
    return tuple(out)


def make_feed(specs: Sequence[InputSpec], vocab_size: int, batch: int, seq: int,
              rng: np.random.Generator, past: int = 0) -> dict[str, np.ndarray]:
    """One feed at (batch, seq) (which the model must accept: see make_feeds)."""
    has_cache = any(s.role == KV_CACHE for s in specs)
    feed = {}
    for s in specs:
        dims = concrete_dims(s, batch, seq, past, has_cache)
        dtype = np_dtype(s.dtype)
        if s.role in (ATTENTION_MASK, ENCODER_MASK) and len(dims) == 2:
            arr = padded_mask(dims[0], dims[1], rng)
        elif s.role == TOKEN_IDS:
            arr = rng.integers(0, vocab_size, size=dims)
        elif s.role == POSITION_IDS and len(dims) >= 1:
            arr = np.broadcast_to(np.arange(past, past + dims[-1]), dims)
        elif dtype.kind in "iub":
            arr = np.zeros(dims, dtype=np.int64)
        else:
            arr = rng.standard_normal(dims).astype(np.float32)
        feed[s.name] = np.ascontiguousarray(arr.astype(dtype))
    return feed


def make_feeds(model, vocab_size: int, shapes: Iterable[tuple[int, int]] = DEFAULT_SHAPES,
               seed: int = 0, past: int = 0) -> list[dict[str, np.ndarray]]:
    """Feeds for `model` (an onnx_ir.Model, a path or specs) at `shapes`, each mapped onto a
    shape the model takes (a fixed batch or sequence replaces the asked one; repeats are
    dropped), so that no feed is ever one the model cannot run."""
    if vocab_size < 1:
        raise BadInput(f"vocab_size must be >= 1, not {vocab_size}")
    shapes = [tuple(s) for s in shapes]
    for b, s in shapes:
        if b < 1 or s < 1:
            raise BadInput(f"batch and sequence must be >= 1, not ({b}, {s})")
    specs = input_specs(model)
    rng = np.random.default_rng(seed)
    return [make_feed(specs, vocab_size, b, s, rng, past)
            for b, s in accepted_shapes(specs, shapes)]


def load_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The arrays of a user's .npz (one feed: input name -> array). Never unpickles."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: no such file")
    if not zipfile.is_zipfile(p):  # np.load would take any other file for a pickle
        raise BadInput(f"{p}: not a readable .npz file (not a zip archive)")
    try:
        with np.load(p, allow_pickle=False) as data:
            feed = {k: np.asarray(data[k]) for k in data.files}
    except ValueError as e:  # object arrays need pickle: refused
        raise BadInput(f"{p}: not a plain .npz of numeric arrays ({e})") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise BadInput(f"{p}: not a readable .npz file ({type(e).__name__}: {e})") from None
    if not feed:
        raise BadInput(f"{p}: holds no arrays")
    for k, v in feed.items():
        if v.dtype.kind not in "biuf":
            raise BadInput(f"{p}: array {k!r} has dtype {v.dtype}; only numbers and booleans")
    return feed


def check_feed(feed: dict[str, np.ndarray], specs: Sequence[InputSpec]) -> None:
    """BadInput unless `feed` has exactly the model's inputs, with matching rank, static dims
    and dtype, and an attention mask that keeps at least one token (an all-zero mask would
    leave nothing to compare)."""
    want = {s.name: s for s in input_specs(list(specs))}
    missing = sorted(set(want) - set(feed))
    extra = sorted(set(feed) - set(want))
    if missing or extra:
        raise BadInput(f"inputs do not match the model: missing {missing}, unexpected {extra}")
    for name, s in want.items():
        arr = feed[name]
        if s.dims and arr.ndim != len(s.dims):
            raise BadInput(f"input {name!r} has rank {arr.ndim}; the model wants {len(s.dims)}")
        for got, d in zip(arr.shape, s.dims):
            if isinstance(d, int) and d > 0 and got != d:
                raise BadInput(f"input {name!r} has shape {arr.shape}; the model wants {s.dims}")
        if arr.dtype != np_dtype(s.dtype):
            raise BadInput(f"input {name!r} is {arr.dtype}; the model wants {s.dtype}")
        if s.role in (ATTENTION_MASK, ENCODER_MASK) and arr.size and not np.any(arr):
            raise BadInput(f"input {name!r} is the attention mask and it is all zeros: every "
                           "position would be padding and nothing would be compared")
