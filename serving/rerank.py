"""Relevance scores from a cross-encoder artifact (a sequence-classification model with one
label, as rerankers are: BGE-reranker, ms-marco MiniLM), as sentence-transformers'
CrossEncoder computes them: the query and a document encoded as one pair (the tokenizer's
pair template: [CLS] query [SEP] document [SEP], the second segment's token type 1), cut to
the model's length from the longer of the two (transformers' "longest_first", which
CrossEncoder asks for), one forward pass, and the logit through the
model's activation (sigmoid, CrossEncoder's default for one label; Identity when its
config.json says so). What `/rerank` serves; no HTTP here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.errors import InvalidArgument
from serving.text_config import read_json
from serving.tokenizer import engine_tokenizer
from tuner.graph.roles import ATTENTION_MASK, POSITION_IDS, TOKEN_IDS, TOKEN_TYPE_IDS

LOGITS = "logits"
DEFAULT_LENGTH = 512  # CrossEncoder's when the tokenizer names none


def _sigmoid(x: float) -> float:
    return float(1 / (1 + np.exp(-x)))


def _activation(folder: Path):
    """CrossEncoder's activation for one label: what config.json's sentence_transformers
    block names (Identity or Sigmoid), sigmoid by default."""
    config = read_json(folder / "config.json")
    named = ((config or {}).get("sentence_transformers") or {}).get("activation_fn", "") \
        if isinstance(config, dict) else ""
    return (lambda x: float(x)) if str(named).endswith("Identity") else _sigmoid


def _length(folder: Path) -> int:
    config = read_json(folder / "tokenizer_config.json")
    limit = config.get("model_max_length") if isinstance(config, dict) else None
    return limit if isinstance(limit, int) and 0 < limit <= 1 << 20 else DEFAULT_LENGTH


@dataclass(frozen=True)
class Pair:
    ids: tuple[int, ...]
    types: tuple[int, ...]
    truncated: bool = False  # cut to the model's length


def is_cross_encoder(engine) -> bool:
    """Whether an encoder engine scores pairs (a `logits` output) rather than embedding
    texts: what tells the two kinds apart wherever an API serves either."""
    return LOGITS in {s.name for s in engine.model.signature.outputs}


def load_scorer(engine) -> "Scorer":
    """The scorer of an encoder engine whose artifact has a tokenizer.json."""
    folder, tokenizer = engine.model.folder, engine_tokenizer(engine)
    return Scorer(engine, tokenizer, _length(folder), _activation(folder))


class Scorer:
    """A cross-encoder engine's scores: the feeds for a (query, document) pair, its score
    from the outputs. InvalidArgument when the model is not a one-label classifier."""

    def __init__(self, engine, tokenizer, max_tokens: int, activation) -> None:
        self.engine, self.tokenizer, self.activation = engine, tokenizer, activation
        self.max_tokens = max_tokens
        tokenizer.enable_truncation(max_tokens, strategy="longest_first")
        outputs = {s.name: s for s in engine.model.signature.outputs}
        logits = outputs.get(LOGITS)
        if logits is None or len(logits.shape) != 2 or logits.shape[1] != 1:
            raise InvalidArgument(f"model '{engine.name}' is not a reranker: rerank needs a "
                                  "cross-encoder, whose 'logits' output is (batch, 1)")
        makers = {TOKEN_IDS: lambda p: p.ids, TOKEN_TYPE_IDS: lambda p: p.types,
                  ATTENTION_MASK: lambda p: (1,) * len(p.ids),
                  POSITION_IDS: lambda p: tuple(range(len(p.ids)))}
        specs = engine.model.signature.specs
        unknown = [s.name for s in specs if s.role not in makers]
        if unknown or not any(s.role == TOKEN_IDS for s in specs):
            raise InvalidArgument(f"model '{engine.name}' takes inputs a rerank request "
                                  f"cannot fill: {unknown or 'no token ids'}")
        self._inputs = [(s.name, makers[s.role], s.dtype) for s in specs]

    def label(self) -> str:
        """The one label's name (config.json's id2label, as transformers names it)."""
        folder = self.engine.model.folder
        config = read_json(folder / "config.json") if folder is not None else None
        names = config.get("id2label") if isinstance(config, dict) else None
        name = names.get("0") if isinstance(names, dict) else None
        return name if isinstance(name, str) else "LABEL_0"

    def pair(self, query: str, document: str) -> Pair:
        encoding = self.tokenizer.encode(query, document)
        return Pair(tuple(encoding.ids), tuple(encoding.type_ids), bool(encoding.overflowing))

    def feeds(self, pair: Pair) -> dict[str, np.ndarray]:
        return {name: np.array([make(pair)], dtype) for name, make, dtype in self._inputs}

    def logit(self, outputs: dict[str, np.ndarray]) -> float:
        return float(outputs[LOGITS][0, 0])

    def score(self, outputs: dict[str, np.ndarray]) -> float:
        """The logit through the model's activation (sigmoid unless its config says)."""
        return self.activation(self.logit(outputs))
