"""A byte-level BPE tokenizer made with the `tokenizers` library, for decoders built with
random weights (no download): trained on a fixed text plus seeded pseudo-words, so that
every id of a vocabulary of `vocab` is a real token (a random-weight model draws from all
of them, and their text must not come back empty)."""

from __future__ import annotations

import numpy as np

TEXT = ("The quick brown fox jumps over the lazy dog. Café, naïve, façade; 日本語のテキスト, "
        "emoji 🎉🚀 and Ελληνικά too. ") * 20


def corpus(words: int = 3000, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    letters = list("abcdefghijklmnopqrstuvwxyzéüñ")
    return TEXT + " ".join("".join(rng.choice(letters, rng.integers(2, 9)))
                           for _ in range(words))


def byte_level_bpe(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus()], trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return tok
