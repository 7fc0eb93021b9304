"""Named entities from a token classifier (a `logits` output of (batch, sequence, labels): an
NER or PII tagger, as Optimum's token-classification export writes it), computed as
transformers' token-classification pipeline computes them, so that huggingface_hub's
`InferenceClient.token_classification` gets what the Inference API gives it. No HTTP here.

Each token's scores are the softmax of its logits; special tokens are skipped. Then, by
`aggregation_strategy`:
  none     one entity per token: its best label (`entity`), score, token, index, offsets;
  simple   adjacent tokens of one entity type (B-X then I-X ..., not a second B-X) grouped:
           `entity_group`, the mean score, the tokens joined back into text;
  first / average / max   each word's tokens first made to agree (the first token's label,
           the average scores' best, or the single most confident token's), then grouped
           as simple.
A word's continuation is told by the tokenizer's subword prefix (WordPiece's "##"), else by
no space before it. Entities labelled with `ignore_labels` (["O"]) are left out. A text past
the model's length is cut (the pipeline's `stride`, which runs the rest, is not served)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from serving.classify import TextFeeds, label_names, logits_spec, per_token_logits
from serving.errors import InvalidArgument
from serving.text_config import special_token

STRATEGIES = ("none", "simple", "first", "average", "max")


def is_token_classifier(engine) -> bool:
    return per_token_logits(engine, "ForTokenClassification")


@dataclass(frozen=True)
class Token:
    """A non-special token: its text as the tokenizer names it, its scores and place."""
    word: str
    scores: np.ndarray  # (labels,)
    index: int
    start: int
    end: int
    is_subword: bool


class Tagger(TextFeeds):
    """A token classifier engine's entities (InvalidArgument for another kind of model)."""

    def __init__(self, engine) -> None:
        if not is_token_classifier(engine):
            raise InvalidArgument(f"model '{engine.name}' is not a token classifier: that "
                                  "needs a 'logits' output of (batch, sequence, labels) and a "
                                  "*ForTokenClassification config.json")
        super().__init__(engine)
        width = logits_spec(engine).shape[-1]
        self.labels = label_names(engine.model.folder, width)
        model = self.tokenizer.model
        self._subword = getattr(model, "continuing_subword_prefix", None)
        # the unknown token as transformers knows it (tokenizer_config.json's), else the model's
        unk = special_token(engine.model.folder, "unk_token") or getattr(model, "unk_token", "")
        self._unk = self.tokenizer.token_to_id(unk) if unk else None

    def tokens(self, text: str, encoding, logits: np.ndarray) -> list[Token]:
        """Each non-special token with its softmax scores."""
        x = logits.astype(np.float64)
        scores = np.exp(x - x.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        out = []
        for i, (token_id, special, (start, end)) in enumerate(
                zip(encoding.ids, encoding.special_tokens_mask, encoding.offsets)):
            if special:
                continue
            word, ref = self.tokenizer.id_to_token(token_id), text[start:end]
            subword = len(word) != len(ref) if self._subword else \
                start > 0 and " " not in text[start - 1:start + 1]
            if token_id == self._unk:
                word, subword = ref, False
            out.append(Token(word, scores[i], i, start, end, subword))
        return out

    def entities(self, text: str, encoding, logits: np.ndarray, strategy: str = "none",
                 ignore: tuple[str, ...] = ("O",)) -> list[dict]:
        if strategy not in STRATEGIES:
            raise InvalidArgument(f"'aggregation_strategy' must be one of {list(STRATEGIES)}")
        tokens = self.tokens(text, encoding, logits)
        if strategy in ("none", "simple"):
            found = [self._entity(t) for t in tokens]
        else:
            found = [self._word(group, strategy) for group in _words(tokens)]
        if strategy != "none":
            found = [self._group(g) for g in _groups(found)]
        return [e for e in found if e.get("entity", e.get("entity_group")) not in ignore]

    def _entity(self, t: Token) -> dict:
        best = int(t.scores.argmax())
        return {"entity": self.labels[best], "score": float(t.scores[best]), "index": t.index,
                "word": t.word, "start": t.start, "end": t.end}

    def _word(self, group: list[Token], strategy: str) -> dict:
        if strategy == "first":
            scores = group[0].scores
        elif strategy == "max":
            scores = max(group, key=lambda t: t.scores.max()).scores
        else:  # average
            scores = np.nanmean(np.stack([t.scores for t in group]), axis=0)
        best = int(scores.argmax())
        return {"entity": self.labels[best], "score": float(scores[best]),
                "word": self._joined([t.word for t in group]),
                "start": group[0].start, "end": group[-1].end}

    def _group(self, entities: list[dict]) -> dict:
        return {"entity_group": entities[0]["entity"].split("-", 1)[-1],
                "score": float(np.nanmean([e["score"] for e in entities])),
                "word": self._joined([e["word"] for e in entities]),
                "start": entities[0]["start"], "end": entities[-1]["end"]}

    def _joined(self, tokens: list[str]) -> str:
        """Tokens back into text, as transformers' convert_tokens_to_string (the decoder's)."""
        decoder = self.tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)


def _words(tokens: list[Token]) -> list[list[Token]]:
    """Tokens grouped into words: a subword joins the word before it."""
    words: list[list[Token]] = []
    for t in tokens:
        if words and t.is_subword:
            words[-1].append(t)
        else:
            words.append([t])
    return words


def _tag(label: str) -> tuple[str, str]:
    """(B or I, the entity type): a label not in B-/I- form continues (I)."""
    if label.startswith(("B-", "I-")):
        return label[0], label[2:]
    return "I", label


def _groups(entities: list[dict]) -> list[list[dict]]:
    """Adjacent entities of one type, a B- starting a new group."""
    groups: list[list[dict]] = []
    for e in entities:
        bi, tag = _tag(e["entity"])
        if groups and tag == _tag(groups[-1][-1]["entity"])[1] and bi != "B":
            groups[-1].append(e)
        else:
            groups.append([e])
    return groups
