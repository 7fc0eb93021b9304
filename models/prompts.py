"""Prompts for the reference decoders: token ids of real text as well as random ids.

A byte-level BPE tokenizer (the `tokenizers` library, the kind GPT-2 and Llama ship) is trained
on the short built-in TEXT below, with a vocabulary small enough for every reference model
(vocab 1003 and up), so real sentences become id sequences with the statistics of text: common
tokens repeat, rare ones appear once. Built in memory in well under a second; nothing is
downloaded.

    ids = text_prompts(vocab_size=1003)        # list of 1-D int64 arrays, one per sentence
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

TEXT = """\
Exported transformers often carry shapes that graphics processors handle badly.
A vocabulary of fifty thousand two hundred and fifty seven tokens is not a multiple of sixty four.
Padding the matrices with zeros changes no output, but only if every reshape follows the new size.
The gate runs both graphs on several batch and sequence shapes and compares what the mask keeps.
A decoder with a key and value cache is checked by short greedy generations, step by step.
The server answers requests over gRPC and batches them into the buckets the tuner measured.
When the rewrite meets a pattern it does not understand, it refuses and names the node.
Rotary embeddings rotate pairs of dimensions, so a padded head keeps each pair together.
Grouped query attention shares one key and value head among several query heads.
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
"""
SENTENCES = tuple(line for line in TEXT.splitlines() if line)
TOKENIZER_VOCAB = 600  # below the smallest reference vocabulary (1003)


@lru_cache(maxsize=1)
def tokenizer():
    """A byte-level BPE tokenizer trained on TEXT (deterministic: same text, same merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES, trainer=trainer)
    return tok


def text_prompts(vocab_size: int, count: int = 3) -> list[np.ndarray]:
    """The first `count` sentences of TEXT as token ids (int64), every id below `vocab_size`."""
    tok = tokenizer()
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"the tokenizer's {tok.get_vocab_size()} ids do not fit a vocabulary "
                         f"of {vocab_size}")
    return [np.array(tok.encode(s).ids, dtype=np.int64) for s in SENTENCES[:count]]


def random_prompts(vocab_size: int, lengths: tuple[int, ...] = (1, 9, 40),
                   seed: int = 0) -> list[np.ndarray]:
    """Random ids, one prompt per length: a 1-token prompt is where an echoing model shows."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, n).astype(np.int64) for n in lengths]
