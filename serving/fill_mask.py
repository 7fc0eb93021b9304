"""A masked LM's guesses for its mask token, computed as transformers' fill-mask pipeline
computes them, for huggingface_hub's `InferenceClient.fill_mask`. No HTTP here.

At each mask of the text: the softmax over the vocabulary (or over `targets` alone), its
`top_k` best, each with the text decoded with that token in the mask's place (special tokens
left out when there is one mask, kept when several, as the pipeline writes them)."""

from __future__ import annotations

import numpy as np

from serving.classify import TextFeeds, per_token_logits
from serving.errors import InvalidArgument
from serving.text_config import special_token


def is_masked_lm(engine) -> bool:
    return per_token_logits(engine, "ForMaskedLM")


class MaskFiller(TextFeeds):
    """A masked LM engine's fills (InvalidArgument for another kind of model)."""

    def __init__(self, engine) -> None:
        if not is_masked_lm(engine):
            raise InvalidArgument(f"model '{engine.name}' is not a masked LM: that needs a "
                                  "'logits' output of (batch, sequence, vocabulary) and a "
                                  "*ForMaskedLM config.json")
        super().__init__(engine)
        self.mask = special_token(engine.model.folder, "mask_token")
        self.mask_id = self.tokenizer.token_to_id(self.mask) if self.mask else None
        if self.mask_id is None:
            raise InvalidArgument(f"model '{engine.name}' names no mask token its tokenizer "
                                  "knows (tokenizer_config.json's mask_token)")

    def masks(self, ids) -> list[int]:
        where = [i for i, t in enumerate(ids) if t == self.mask_id]
        if not where:
            raise InvalidArgument(f"'inputs' holds no mask token ({self.mask})")
        return where

    def target_ids(self, targets: list[str]) -> list[int]:
        """Each target's id (a word the vocabulary lacks: its first token, as the pipeline)."""
        ids = []
        for target in targets:
            token = self.tokenizer.token_to_id(target)
            if token is None:
                pieces = self.tokenizer.encode(target, add_special_tokens=False).ids
                token = pieces[0] if pieces else None
            if token is not None and token not in ids:
                ids.append(token)
        if not ids:
            raise InvalidArgument("none of 'targets' is in the model's vocabulary")
        return ids

    def fills(self, ids: tuple[int, ...], logits: np.ndarray, top_k: int = 5,
              targets: list[int] | None = None) -> list[dict] | list[list[dict]]:
        """The fills at each mask (a list of them per mask when there are several)."""
        where = self.masks(ids)
        rows = []
        for at in where:
            x = logits[at].astype(np.float64)
            probs = np.exp(x - x.max())
            probs /= probs.sum()
            candidates = np.array(targets) if targets else np.arange(len(probs))
            order = candidates[np.argsort(-probs[candidates], kind="stable")][:top_k]
            rows.append([self._fill(ids, at, int(t), float(probs[t]), len(where) == 1)
                         for t in order])
        return rows[0] if len(rows) == 1 else rows

    def _fill(self, ids, at: int, token: int, score: float, single: bool) -> dict:
        filled = list(ids)
        filled[at] = token
        return {"score": score, "token": token,
                "token_str": self.tokenizer.decode([token], skip_special_tokens=False),
                "sequence": self.tokenizer.decode(filled, skip_special_tokens=single)}
