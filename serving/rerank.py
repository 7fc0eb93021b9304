"""Relevance scores from a cross-encoder artifact (a sequence-classification model with one
label, as rerankers are: BGE-reranker, ms-marco MiniLM), as sentence-transformers'
CrossEncoder computes them: the query and a document encoded as one pair (the tokenizer's
pair template: [CLS] query [SEP] document [SEP], the second segment's token type 1), cut to
the model's length from the longer of the two (transformers' "longest_first", which
CrossEncoder asks for), one forward pass, and the logit through the
model's activation (sigmoid, CrossEncoder's default for one label; Identity when its
config.json says so). What `/rerank` serves; no HTTP here."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from serving.classify import LOGITS, Classifier, Pair, logits_width
from serving.errors import InvalidArgument
from serving.text_config import read_json

__all__ = ["Pair", "Scorer", "is_cross_encoder", "load_scorer"]


def _sigmoid(x: float) -> float:
    return float(1 / (1 + np.exp(-x)))


def _activation(folder: Path):
    """CrossEncoder's activation for one label: what config.json's sentence_transformers
    block names (Identity or Sigmoid), sigmoid by default."""
    config = read_json(folder / "config.json")
    named = ((config or {}).get("sentence_transformers") or {}).get("activation_fn", "") \
        if isinstance(config, dict) else ""
    return (lambda x: float(x)) if str(named).endswith("Identity") else _sigmoid


def is_cross_encoder(engine) -> bool:
    """Whether an encoder engine scores texts (a `logits` (batch, labels) output) rather than
    embedding them: what tells the two kinds apart wherever an API serves either."""
    return logits_width(engine) is not None


def load_scorer(engine) -> "Scorer":
    """The scorer of an encoder engine whose artifact has a tokenizer.json."""
    return Scorer(engine)


class Scorer(Classifier):
    """A cross-encoder engine's scores: the feeds for a (query, document) pair, its score
    from the outputs. InvalidArgument when the model is not a one-label classifier."""

    def __init__(self, engine) -> None:
        if logits_width(engine) != 1:
            raise InvalidArgument(f"model '{engine.name}' is not a reranker: rerank needs a "
                                  "cross-encoder, whose 'logits' output is (batch, 1)")
        super().__init__(engine)
        self.activation = _activation(engine.model.folder)

    def label(self) -> str:
        """The one label's name (config.json's id2label, as transformers names it)."""
        return self.labels[0]

    def pair(self, query: str, document: str) -> Pair:
        return self.encode(query, document)

    def logit(self, outputs: dict[str, np.ndarray]) -> float:
        return float(outputs[LOGITS][0, 0])

    def score(self, outputs: dict[str, np.ndarray]) -> float:
        """The logit through the model's activation (sigmoid unless its config says)."""
        return self.activation(self.logit(outputs))
