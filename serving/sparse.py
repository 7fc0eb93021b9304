"""Sparse embeddings (SPLADE) of a masked LM as sentence-transformers' SparseEncoder computes
them (what Text Embeddings Inference serves with `--pooling splade`, and what hybrid search
pairs with dense vectors): the artifact holds SparseEncoder's files (modules.json naming a
SpladePooling module, its config under 1_SpladePooling/) beside a masked LM's graph, whose
`logits` are (batch, sequence, vocabulary). No HTTP here.

One text's vector over the vocabulary: each token's logits through relu then log1p (twice
for the `log1p_relu` activation), then the maximum (or the sum) over the tokens; only
SparseEncoder's `max_active_dims` largest entries kept when its config names a limit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.classify import LOGITS, TextFeeds, logits_spec
from serving.errors import InvalidArgument
from serving.text_config import read_json

SPLADE = "SpladePooling"  # the sentence-transformers module's class name


@dataclass(frozen=True)
class Splade:
    strategy: str = "max"  # or "sum"
    activation: str = "relu"  # or "log1p_relu"
    max_active: int | None = None  # entries kept, the largest


def _module_path(folder: Path) -> Path | None:
    modules = read_json(folder / "modules.json")
    for m in modules if isinstance(modules, list) else []:
        if isinstance(m, dict) and str(m.get("type", "")).rsplit(".", 1)[-1] == SPLADE:
            where = (folder / str(m.get("path", "1_SpladePooling"))).resolve()
            # the file's own paths are not trusted: nothing outside the artifact is read
            return where if where.is_relative_to(folder.resolve()) else None
    return None


def load_splade(folder: Path | None) -> Splade | None:
    """The SPLADE pooling SparseEncoder's files in `folder` describe; None without them."""
    where = _module_path(folder) if folder is not None else None
    if where is None:
        return None
    config = read_json(where / "config.json")
    config = config if isinstance(config, dict) else {}
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if strategy not in ("max", "sum") or activation not in ("relu", "log1p_relu"):
        raise InvalidArgument(f"SpladePooling's config asks for pooling {strategy!r} with "
                              f"{activation!r}: served are max or sum, relu or log1p_relu")
    top = (read_json(folder / "config_sentence_transformers.json") or {}).get("max_active_dims")
    return Splade(strategy, activation, top if isinstance(top, int) and top > 0 else None)


def is_sparse(engine) -> bool:
    spec = logits_spec(engine)
    return spec is not None and len(spec.shape) == 3 and \
        load_splade(engine.model.folder) is not None


class SparseEmbedder(TextFeeds):
    """A SPLADE engine's sparse vectors (InvalidArgument for another kind of model)."""

    def __init__(self, engine) -> None:
        if not is_sparse(engine):
            raise InvalidArgument(f"model '{engine.name}' gives no sparse embeddings: that "
                                  "needs a masked LM's 'logits' and sentence-transformers' "
                                  "SpladePooling (modules.json) in its artifact")
        super().__init__(engine)
        self.splade = load_splade(engine.model.folder)

    def vector(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """(vocabulary,) of one unpadded row's logits (sequence, vocabulary)."""
        x = np.log1p(np.maximum(outputs[LOGITS][0].astype(np.float32), 0))
        if self.splade.activation == "log1p_relu":
            x = np.log1p(x)
        vector = x.max(axis=0) if self.splade.strategy == "max" else x.sum(axis=0)
        if self.splade.max_active is not None and self.splade.max_active < len(vector):
            cut = np.argpartition(-vector, self.splade.max_active)[self.splade.max_active:]
            vector[cut] = 0
        return vector

    @staticmethod
    def entries(vector: np.ndarray) -> list[dict]:
        """TEI's sparse value: the non-zero entries, by index."""
        return [{"index": int(i), "value": float(vector[i])} for i in np.flatnonzero(vector)]
