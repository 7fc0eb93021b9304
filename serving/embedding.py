"""Sentence embeddings from an encoder artifact, as sentence-transformers computes them: the
tokenizer's ids (cut to sentence_bert_config.json's `max_seq_length`, as its `encode` cuts
them), one forward pass, the token outputs pooled as the Pooling module's config says (the
modes it enables, concatenated in its order; mean over the tokens when there is no config)
and L2-normalized where modules.json lists Normalize. A graph that outputs the sentence
embedding itself (`sentence_embedding`, (B, H): Optimum's sentence-transformers export) is
taken as it is. Also what Text Embeddings Inference's API needs beside: whether a text was
cut, cutting from the left, the vector before normalization, and the named prompts of
config_sentence_transformers.json. What `/v1/embeddings`, `/embed` and `/similarity` serve; no
grpc, no HTTP here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Mapping

import numpy as np

from serving.classify import LOGITS
from serving.errors import InvalidArgument
from serving.text_config import read_json
from serving.tokenizer import cutting, engine_tokenizer
from tuner.graph.roles import ATTENTION_MASK, POSITION_IDS, TOKEN_IDS, TOKEN_TYPE_IDS

# sentence-transformers' Pooling modes, in the order it concatenates them
MODES = ("cls_token", "max_tokens", "mean_tokens", "mean_sqrt_len_tokens", "lasttoken")
SENTENCE_OUTPUT = "sentence_embedding"
# text sent to an encoder over KServe v2 (BYTES [n]): Triton's LLM name, and LiteLLM's (its
# Triton embedding provider); answered with the vectors as one output [n, dim]
TEXT_INPUTS = ("text_input", "input_text")
EMBEDDINGS_OUTPUT = "embeddings"


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...] = ("mean_tokens",)
    normalize: bool = False
    max_tokens: int | None = None  # ids past this are cut (sentence_bert_config.json)


def load_pooling(folder: Path) -> Pooling:
    """The pooling sentence-transformers' files in `folder` describe; mean without them."""
    modules = read_json(folder / "modules.json")
    modules = modules if isinstance(modules, list) else []
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: str(m.get("path", ""))
             for m in modules if isinstance(m, dict)}
    where = (folder / kinds.get("Pooling", "1_Pooling") / "config.json").resolve()
    # the file's own paths are not trusted: nothing outside the artifact is read
    config = read_json(where) if where.is_relative_to(Path(folder).resolve()) else None
    modes = tuple(m for m in MODES if isinstance(config, dict)
                  and config.get(f"pooling_mode_{m}") is True) or ("mean_tokens",)
    bert = read_json(folder / "sentence_bert_config.json")
    limit = bert.get("max_seq_length") if isinstance(bert, dict) else None
    return Pooling(modes, "Normalize" in kinds,
                   limit if isinstance(limit, int) and limit > 0 else None)


def load_prompts(folder: Path) -> dict[str, str]:
    """sentence-transformers' named prompts (config_sentence_transformers.json `prompts`:
    {"query": "query: ", ...}), each put before a text whose request names it."""
    config = read_json(folder / "config_sentence_transformers.json")
    prompts = config.get("prompts") if isinstance(config, dict) else None
    if not isinstance(prompts, dict):
        return {}
    return {k: v for k, v in prompts.items() if isinstance(k, str) and isinstance(v, str)}


def max_positions(folder: Path) -> int | None:
    """The longest input the model's config.json allows (`max_position_embeddings`)."""
    config = read_json(folder / "config.json")
    n = config.get("max_position_embeddings") if isinstance(config, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def load_embedder(engine) -> "Embedder":
    """The embedder of an encoder engine whose artifact has a tokenizer.json."""
    folder, tokenizer = engine.model.folder, engine_tokenizer(engine)
    pooling = load_pooling(folder)
    if pooling.max_tokens is None:  # sentence-transformers' own default: the model's limit,
        # read from the graph where it can be (config.json's max_position_embeddings is 514
        # for RoBERTa and XLM-R, whose tables take 512 tokens)
        pooling = replace(pooling, max_tokens=engine.model.max_positions or max_positions(folder))
    return Embedder(engine, tokenizer, pooling, load_prompts(folder))


@lru_cache(maxsize=4)
def embedder_of(engine) -> "Embedder":
    return load_embedder(engine)


def texts_in(feeds: Mapping[str, np.ndarray], engine) -> list[str] | None:
    """The texts of a KServe request that sends an encoder text (one of TEXT_INPUTS, BYTES
    [n]) instead of its graph's inputs; None for a request of the graph's own inputs."""
    own = {s.name for s in engine.model.signature.inputs}
    names = [n for n in TEXT_INPUTS if n in feeds and n not in own]
    if not names:
        return None
    if len(feeds) != 1:
        raise InvalidArgument(f"send '{names[0]}' (BYTES [n]) alone: the text is tokenized "
                              f"here, not with {sorted(n for n in feeds if n != names[0])}")
    array = np.asarray(feeds[names[0]])
    items = array.reshape(-1).tolist()
    if array.dtype != object or not items or not all(isinstance(x, bytes) for x in items):
        raise InvalidArgument(f"'{names[0]}' must be BYTES [n], one text each")
    try:
        return [x.decode("utf-8") for x in items]
    except UnicodeDecodeError:
        raise InvalidArgument(f"'{names[0]}' is not valid UTF-8") from None


def embed_texts(engine, texts: list[str], names=()) -> dict[str, np.ndarray]:
    """sentence-transformers' vectors of `texts`, one row each: {EMBEDDINGS_OUTPUT: (n, dim)}
    (`names`: the outputs a request asked for, as Engine.infer takes them). InvalidArgument
    for an encoder without a tokenizer, or for a name it does not answer with."""
    for name in names:
        if name != EMBEDDINGS_OUTPUT:
            raise InvalidArgument(f"unexpected inference output '{name}' for model "
                                  f"'{engine.name}'")
    embedder = embedder_of(engine)
    rows = []
    for text in texts:
        outputs, _ = engine.infer(embedder.feeds(embedder.encode(text)[0]), [embedder.output])
        rows.append(embedder.vector(outputs))
    return {EMBEDDINGS_OUTPUT: np.stack(rows).astype(np.float32)}


def normalized(vector: np.ndarray) -> np.ndarray:
    return vector / max(float(np.linalg.norm(vector)), 1e-12)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(normalized(a64) @ normalized(b64))


def pool(tokens: np.ndarray, pooling: Pooling) -> np.ndarray:
    """One text's token outputs (S, H), every position real -> its embedding."""
    x = tokens.astype(np.float64)
    parts = {"cls_token": x[0], "max_tokens": x.max(0), "mean_tokens": x.mean(0),
             "mean_sqrt_len_tokens": x.sum(0) / np.sqrt(len(x)), "lasttoken": x[-1]}
    vector = np.concatenate([parts[m] for m in pooling.modes])
    if pooling.normalize:
        vector = normalized(vector)
    return vector.astype(np.float32)


def _what(outputs: dict) -> str:
    """What a model's `logits` make it, for the refusal to pool them."""
    logits = outputs.get(LOGITS)
    if logits is None:
        return ""
    if len(logits.shape) == 2:
        return " (it is a classifier: its scores come from POST /predict, /classify or /rerank)"
    return (" (its 'logits' are a token classifier's or a masked LM's scores; a SPLADE "
            "model's sparse vectors come from POST /embed_sparse)")


class Embedder:
    """An encoder engine's embeddings: the feeds for one text's ids, and its vector from the
    outputs. InvalidArgument when the graph takes an input it cannot fill."""

    def __init__(self, engine, tokenizer, pooling: Pooling,
                 prompts: dict[str, str] | None = None) -> None:
        """`tokenizer`: a `tokenizers.Tokenizer` of the embedder's own (its truncation is set
        here: the text cut to max_tokens with the special tokens kept, as in
        sentence-transformers)."""
        self.engine, self.tokenizer, self.pooling = engine, tokenizer, pooling
        self.prompts = prompts or {}
        self._left = None  # a copy that cuts from the left, made when first asked for
        if pooling.max_tokens is not None:
            tokenizer.enable_truncation(pooling.max_tokens)
        outputs = {s.name: s for s in engine.model.signature.outputs}
        given = outputs.get(SENTENCE_OUTPUT)
        # a token classifier's or a masked LM's `logits` are (batch, sequence, labels or
        # vocabulary) too, and pooling them gives a vector that means nothing
        tokens = [s for s in outputs.values() if len(s.shape) == 3 and s.name != LOGITS]
        if given is not None and len(given.shape) == 2:
            self.output, self.pooled = SENTENCE_OUTPUT, True
        elif tokens:
            self.output, self.pooled = tokens[0].name, False
        else:
            raise InvalidArgument(f"model '{engine.name}' has no output of token embeddings "
                                  f"(batch, sequence, hidden) to pool{_what(outputs)}")
        makers = {TOKEN_IDS: lambda ids: ids, ATTENTION_MASK: np.ones_like,
                  TOKEN_TYPE_IDS: np.zeros_like,
                  POSITION_IDS: lambda ids: np.arange(ids.shape[1], dtype=np.int64)[None]}
        specs = engine.model.signature.specs
        unknown = [s.name for s in specs if s.role not in makers]
        if unknown or not any(s.role == TOKEN_IDS for s in specs):
            raise InvalidArgument(f"model '{engine.name}' takes inputs an embedding request "
                                  f"cannot fill: {unknown or 'no token ids'}")
        self._inputs = [(s.name, makers[s.role], s.dtype) for s in specs]

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def encode(self, text: str, left: bool = False) -> tuple[list[int], bool]:
        """The ids of `text` cut to max_tokens from the right (or the left), and whether
        anything was cut."""
        tokenizer = self.tokenizer
        if left and self.pooling.max_tokens is not None:
            if self._left is None:
                self._left = cutting(self.tokenizer, self.pooling.max_tokens, "left")
            tokenizer = self._left
        encoding = tokenizer.encode(text)
        return encoding.ids, bool(encoding.overflowing)

    def feeds(self, ids: list[int]) -> dict[str, np.ndarray]:
        row = np.array([ids], np.int64)  # (1, S)
        return {name: make(row).astype(dtype) for name, make, dtype in self._inputs}

    def vector(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        out = outputs[self.output][0]  # (H,) or (S, H)
        return out.astype(np.float32) if self.pooled else pool(out, self.pooling)

    def unnormalized(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """The pooled vector before any L2 normalization (what TEI's `normalize: false`
        asks for); InvalidArgument for a graph that pools, and may normalize, itself."""
        if self.pooled:
            raise InvalidArgument(f"model '{self.engine.name}' pools (and may normalize) "
                                  "inside its graph: only normalized embeddings come from it")
        return pool(outputs[self.output][0], replace(self.pooling, normalize=False))
