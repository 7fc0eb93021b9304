"""Realistic inputs for a transformer graph: random token ids inside the vocabulary, attention
masks with right and left padding, several (batch, seq) shapes; or the user's own .npz.

Used by the accuracy gate (`tuner verify`, `tuner pad`), the benchmark and the server's
self-check. Inputs are recognised by name: `*input_ids*` (ids below `vocab_size`),
`*attention_mask*` (1 = real token), `*token_type_ids*` (zeros), `*position_ids*`
(0..seq-1); other integer inputs get zeros, float inputs small normal noise.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from tuner.errors import BadInput
from tuner.graph.io import ATTENTION_MASK, POSITION_IDS, TOKEN_IDS, InputSpec, input_specs, role_of

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


def _concrete(dims: tuple, batch: int, seq: int) -> tuple[int, ...]:
    """Dynamic axes become batch (the first) and seq (the second); fixed ones stay."""
    out, dynamic = [], [batch, seq]
    for d in dims:
        if isinstance(d, int) and d > 0:
            out.append(d)
        else:
            out.append(dynamic.pop(0) if dynamic else 1)
    return tuple(out)


def make_feed(specs: Sequence[InputSpec], vocab_size: int, batch: int, seq: int,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    mask = padded_mask(batch, seq, rng)
    feed = {}
    for s in specs:
        dims = _concrete(s.dims, batch, seq) if s.dims else (batch, seq)
        role, dtype = role_of(s.name), np.dtype(s.dtype)
        if role == ATTENTION_MASK and dims == (batch, seq):
            arr = mask.astype(dtype)
        elif role == TOKEN_IDS:
            arr = rng.integers(0, vocab_size, size=dims).astype(dtype)
        elif role == POSITION_IDS and dims == (batch, seq):
            arr = np.broadcast_to(np.arange(seq), dims).astype(dtype)
        elif dtype.kind in "iub":
            arr = np.zeros(dims, dtype=dtype)
        else:
            arr = rng.standard_normal(dims).astype(dtype)
        feed[s.name] = np.ascontiguousarray(arr)
    return feed


def make_feeds(model, vocab_size: int, shapes: Iterable[tuple[int, int]] = DEFAULT_SHAPES,
               seed: int = 0) -> list[dict[str, np.ndarray]]:
    """One feed dict per (batch, seq) shape for `model` (an onnx_ir.Model, a path or specs)."""
    if vocab_size < 1:
        raise BadInput(f"vocab_size must be >= 1, not {vocab_size}")
    shapes = [tuple(s) for s in shapes]
    for b, s in shapes:
        if b < 1 or s < 1:
            raise BadInput(f"batch and sequence must be >= 1, not ({b}, {s})")
    specs = input_specs(model)
    rng = np.random.default_rng(seed)
    return [make_feed(specs, vocab_size, b, s, rng) for b, s in shapes]


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
    """BadInput unless `feed` has exactly the model's inputs, with matching rank and dtype."""
    want = {s.name: s for s in specs}
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
        if arr.dtype != np.dtype(s.dtype):
            raise BadInput(f"input {name!r} is {arr.dtype}; the model wants {s.dtype}")
