"""A sequence classifier's predictions from an encoder artifact whose graph ends in `logits`
(batch, labels), as Optimum's text-classification export names it: sentiment, toxicity and
prompt-injection guards, NLI over a (premise, hypothesis) pair. A reranker is its one-label
case (serving/rerank.py). What TEI's `/predict`, vLLM's `/classify` and Hugging Face's
Inference API serve (serving/http/classify_api.py); no HTTP here.

A text, or a pair of texts through the tokenizer's pair template ([CLS] a [SEP] b [SEP], the
second segment's token type 1), cut to the model's length (transformers' "longest_first" for a
pair) from the right or the left, one forward pass, then the logits through the function
transformers' text-classification pipeline applies for the model's config: none for
`problem_type` regression, sigmoid per label for multi-label classification or one label,
softmax otherwise. The labels are config.json's id2label (LABEL_i where it names none).

Also the one way text becomes an encoder's feeds (`TextFeeds`, which the token classifier, the
masked LM and the SPLADE model use too), and Triton's classification extension (`classified`:
any output, on gRPC and HTTP)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.datatypes import datatype_of
from serving.errors import InvalidArgument, input_too_long
from serving.model import batches
from serving.text_config import read_json
from serving.tokenizer import cutting, engine_tokenizer, whole_length
from tuner.graph.roles import ATTENTION_MASK, POSITION_IDS, TOKEN_IDS, TOKEN_TYPE_IDS

LOGITS = "logits"
DEFAULT_LENGTH = 512  # transformers' when the tokenizer names none
FUNCTIONS = ("softmax", "sigmoid", "none")  # the pipeline's `function_to_apply`, lower case


def logits_spec(engine):
    """The engine's `logits` output (a TensorSpec), or None."""
    return {s.name: s for s in engine.model.signature.outputs}.get(LOGITS)


def logits_width(engine) -> int | None:
    """The labels of a sequence classifier's `logits` output (batch, labels); None when the
    model has no such output (an embedding model, a token classifier's (batch, seq, labels))."""
    spec = logits_spec(engine)
    if spec is None or len(spec.shape) != 2 or spec.shape[1] < 1:
        return None
    return spec.shape[1]


def per_token_logits(engine, architecture: str) -> bool:
    """`logits` of (batch, sequence, n) and config.json naming an architecture that ends
    with `architecture` (ForTokenClassification, ForMaskedLM: both heads give such logits)."""
    spec = logits_spec(engine)
    kinds = read_config(engine.model.folder).get("architectures") or []
    return spec is not None and len(spec.shape) == 3 and \
        any(str(k).endswith(architecture) for k in kinds)


def is_classifier(engine) -> bool:
    """Several labels: what TEI calls a classifier (one label is a reranker)."""
    width = logits_width(engine)
    return width is not None and width > 1


def read_config(folder: Path | None) -> dict:
    config = read_json(folder / "config.json") if folder is not None else None
    return config if isinstance(config, dict) else {}


def label_names(folder: Path | None, count: int) -> tuple[str, ...]:
    """config.json's id2label for each of `count` outputs (LABEL_i, transformers' default)."""
    names = read_config(folder).get("id2label")
    names = names if isinstance(names, dict) else {}
    return tuple(str(names.get(str(i), f"LABEL_{i}")) for i in range(count))


def default_function(folder: Path | None, count: int) -> str:
    """What transformers' text-classification pipeline applies to this model's logits."""
    problem = read_config(folder).get("problem_type")
    if problem == "regression":
        return "none"
    if problem == "multi_label_classification" or count == 1:
        return "sigmoid"
    return "softmax"


def apply(function: str, logits: np.ndarray) -> np.ndarray:
    """The scores of one row of logits (float64, as the pipeline computes them in numpy)."""
    x = logits.astype(np.float64)
    if function == "sigmoid":
        return 1 / (1 + np.exp(-x))
    if function == "softmax":
        e = np.exp(x - x.max())
        return e / e.sum()
    if function == "none":
        return x
    raise InvalidArgument(f"'function_to_apply' must be one of {list(FUNCTIONS)}, not "
                          f"{function!r}")


def _length(folder: Path | None) -> int:
    config = read_json(folder / "tokenizer_config.json") if folder is not None else None
    limit = config.get("model_max_length") if isinstance(config, dict) else None
    return limit if isinstance(limit, int) and 0 < limit <= 1 << 20 else DEFAULT_LENGTH


@dataclass(frozen=True)
class Pair:
    """One encoded input: a text, or a pair of texts in one sequence."""
    ids: tuple[int, ...]
    types: tuple[int, ...]
    truncated: bool = False  # cut to the model's length

    @staticmethod
    def of(encoding) -> "Pair":
        """A `tokenizers` Encoding's ids and token types."""
        return Pair(tuple(encoding.ids), tuple(encoding.type_ids), bool(encoding.overflowing))


def zero_shot_scores(logits: np.ndarray, entailment: int, multi_label: bool) -> np.ndarray:
    """transformers' zero-shot pipeline on an NLI model's logits (labels, classes), one row per
    candidate label (the text paired with its hypothesis): the entailment logits' softmax over
    the labels, or for `multi_label` (or one label) each label's entailment against its
    contradiction (index 0, or the last when entailment is 0)."""
    x = logits.astype(np.float64)
    if multi_label or len(x) == 1:
        pair = x[:, [-1 if entailment == 0 else 0, entailment]]
        e = np.exp(pair - pair.max(axis=1, keepdims=True))
        return e[:, 1] / e.sum(axis=1)
    return apply("softmax", x[:, entailment])


class TextFeeds:
    """An encoder engine's feeds for a text or a pair of texts, cut to the model's length
    (InvalidArgument when the graph takes inputs a text cannot fill)."""

    def __init__(self, engine) -> None:
        self.engine, folder = engine, engine.model.folder
        self.max_tokens = _length(folder)
        self.tokenizer = engine_tokenizer(engine)
        self._tokenizers = {(d, how): cutting(self.tokenizer, self.max_tokens, d, how)
                            for d, how in (("right", "longest_first"), ("left", "longest_first"),
                                           ("right", "only_first"))}
        makers = {TOKEN_IDS: lambda p: p.ids, TOKEN_TYPE_IDS: lambda p: p.types,
                  ATTENTION_MASK: lambda p: (1,) * len(p.ids),
                  POSITION_IDS: lambda p: tuple(range(len(p.ids)))}
        specs = engine.model.signature.specs
        unknown = [s.name for s in specs if s.role not in makers]
        if unknown or not any(s.role == TOKEN_IDS for s in specs):
            raise InvalidArgument(f"model '{engine.name}' takes inputs a text cannot fill: "
                                  f"{unknown or 'no token ids'}")
        self._inputs = [(s.name, makers[s.role], s.dtype) for s in specs]

    def encoding(self, text: str, second: str | None = None, left: bool = False,
                 only_first: bool = False):
        """The tokenizer's Encoding (ids, offsets, special tokens) of a text or a pair, cut to
        the model's length from the right, or the left; a pair from the longer text, or
        (`only_first`) from the first alone."""
        tokenizer = self._tokenizers[("left" if left else "right",
                                      "only_first" if only_first else "longest_first")]
        return tokenizer.encode(text) if second is None else tokenizer.encode(text, second)

    def encode(self, text: str, second: str | None = None, left: bool = False,
               only_first: bool = False) -> Pair:
        return Pair.of(self.encoding(text, second, left, only_first))

    def encode_all(self, sequences, truncate: bool = True, left: bool = False) -> list[Pair]:
        """Each (text, second text or None) encoded; one past the model's length refused
        when `truncate` is false (TEI's rule)."""
        pairs = [self.encode(a, b, left) for a, b in sequences]
        long = [i for i, p in enumerate(pairs) if p.truncated]
        if long and not truncate:
            raise input_too_long(f"inputs[{long[0]}]", whole_length(
                self.tokenizer, *sequences[long[0]]), self.max_tokens)
        return pairs

    def feeds(self, pair: Pair) -> dict[str, np.ndarray]:
        return {name: np.array([make(pair)], dtype) for name, make, dtype in self._inputs}


class Classifier(TextFeeds):
    """An encoder engine's classifier: the feeds of a text or pair, its labels' scores.
    InvalidArgument when the model has no `logits` (batch, labels) output, or inputs a text
    cannot fill."""

    def __init__(self, engine) -> None:
        width = logits_width(engine)
        if width is None:
            raise InvalidArgument(f"model '{engine.name}' is not a sequence classifier: that "
                                  "needs a 'logits' output of (batch, labels)")
        super().__init__(engine)
        self.labels = label_names(engine.model.folder, width)
        self.function = default_function(engine.model.folder, width)

    def entailment(self) -> int:
        """The NLI label zero-shot classification reads (the first named entail...)."""
        found = [i for i, name in enumerate(self.labels) if name.lower().startswith("entail")]
        if not found:
            raise InvalidArgument(f"model '{self.engine.name}' has no entailment label (its "
                                  f"labels: {list(self.labels)}): zero-shot classification "
                                  "needs an NLI model")
        return found[0]

    def logits(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(outputs[LOGITS][0])  # (labels,)

    def scores(self, outputs: dict[str, np.ndarray], function: str | None = None) -> np.ndarray:
        """Each label's score: the logits through `function` (the model's default)."""
        return apply(function or self.function, self.logits(outputs))

    def ranked(self, scores: np.ndarray, top: int | None = None) -> list[dict]:
        """[{label, score}], highest first (ties in label order), the first `top`."""
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top]
        return [{"label": self.labels[i], "score": float(scores[i])} for i in order]


# Triton's classification extension: an output requested with the parameter
# `classification: k` comes back as BYTES, each batch row's k largest values as
# "value:index[:label]" strings, highest first; the value as the model gave it (C's %f for a
# float), the label where the model has one (here config.json's id2label, for a sequence
# classifier's logits; Triton reads an output's label file).
_ORDERED = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP32",
            "FP64")


def class_count(parameters: dict, name: str) -> int | None:
    """An output request's `classification` count (None when it asks for none)."""
    count = parameters.get("classification")
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidArgument(f"output '{name}': 'classification' must be a positive integer")
    return count


def _row(values: np.ndarray, count: int, labels: tuple[str, ...]) -> list[bytes]:
    order = np.argsort(-values.astype(np.float64), kind="stable")[:count]
    number = "{:f}" if values.dtype.kind == "f" else "{:d}"
    return [(number.format(values[i].item()) + f":{i}"
             + (f":{labels[i]}" if i < len(labels) else "")).encode() for i in order]


def top_classes(values: np.ndarray, count: int, batched: bool,
                labels: tuple[str, ...] = ()) -> np.ndarray:
    """Triton's classification of one output: (batch, k) when batched (each row's elements
    flattened), else (k,); an array of bytes (KServe's BYTES)."""
    datatype = datatype_of(values.dtype)
    if datatype not in _ORDERED:
        raise InvalidArgument("class result not available for output due to unsupported type "
                              f"'{datatype}'")
    rows = values.reshape(len(values), -1) if batched else values.reshape(1, -1)
    k = min(count, rows.shape[1])
    classes = np.empty((len(rows), k), dtype=object)
    for b, row in enumerate(rows):
        classes[b] = _row(row, k, labels)
    return classes if batched else classes[0]


def unplaced(counts: dict[str, int], places) -> None:
    """Refuse an output asked both for classification and for shared memory (its classes are
    strings in the response)."""
    both = sorted(set(counts) & set(places))
    if both:
        raise InvalidArgument(f"output '{both[0]}': classification results are sent in the "
                              "response, not written to shared memory")


def classified(engine, outputs: dict[str, np.ndarray], counts: dict[str, int]
               ) -> dict[str, np.ndarray]:
    """`outputs` with each output named in `counts` replaced by its classification."""
    if not counts:
        return outputs
    signature = engine.model.signature
    width = logits_width(engine)
    labels = label_names(engine.model.folder, width) if width else ()
    return {name: top_classes(value, counts[name], batches(signature),
                              labels if name == LOGITS else ()) if name in counts else value
            for name, value in outputs.items()}
