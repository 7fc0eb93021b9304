"""Prompt lookup: drafts for speculative decoding, found in the stream's own tokens.

A decode step at one row is memory-bound: the run reads every weight for one token, and a
run of a few tokens costs little more (an 8-layer h-1024 Llama on 2 cores, past 160: 2, 3,
4 and 6 tokens 1.10x, 1.14x, 1.21x and 1.37x a 1-token run). So when the stream's last
tokens already occurred earlier in its prompt or output (a quoted passage, code being
edited, a repeated phrase), the tokens that followed them there are fed as drafts after its
last token, and one run scores all of them (serving.generation.engine). Each position's
token is then sampled as any step samples it, in order, and kept while it equals the draft
it checks: the output is the one the stream gets without drafts (the same tokens for greedy
rows, the same random draws for sampled ones), up to floating-point rounding between a run
of several tokens and several runs of one. (Saxena's prompt lookup decoding; vLLM's "ngram"
method and TGI's --speculate.)

    propose([7, 8, 9, 4, 7, 8], drafts=3)   # -> [9, 4, 7]: what followed (7, 8) before

A run whose drafts all missed cost more than a plain step (3 drafts: ~1.2x), so after one a
stream rests from lookups (`Backoff`): 1, 3, 7, then 8 decode steps after misses in a row,
none after a hit. Where drafts never hold, that leaves about one such run in 9 steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# The longest and shortest tails looked up: a longer match first (stronger evidence), never
# one token alone (a common token matches everywhere, and a wrong draft costs a longer run).
NGRAM_MAX, NGRAM_MIN = 3, 2
REST_MAX = 8  # decode steps a stream rests from lookups after misses in a row, at most


@dataclass
class Backoff:
    """One stream's rest from lookups after runs whose drafts all missed."""

    misses: int = 0  # speculative runs in a row that accepted nothing
    wait: int = 0  # decode steps before the next lookup

    def ready(self) -> bool:
        """Whether this decode step may look drafts up (a step of rest is counted)."""
        if self.wait:
            self.wait -= 1
            return False
        return True

    def observe(self, accepted: int) -> None:
        self.misses = 0 if accepted else self.misses + 1
        self.wait = min(2 ** self.misses - 1, REST_MAX)


def propose(tokens: Sequence[int], drafts: int, ngram_max: int = NGRAM_MAX,
            ngram_min: int = NGRAM_MIN) -> list[int]:
    """Up to `drafts` tokens that followed the latest earlier occurrence of the longest tail
    of `tokens` (ngram_max .. ngram_min tokens long); [] when no tail occurred before. A
    match that runs into the end of `tokens` goes on with the drafts themselves: the tail
    repeats with the period the match found."""
    if drafts < 1:
        return []
    seq = np.asarray(tokens, np.int64)
    for n in range(min(ngram_max, len(seq) - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # (L - n, n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            out: list[int] = []
            at = int(hits[-1]) + n  # the token after the match
            while len(out) < drafts:
                out.append(int(seq[at]) if at < len(seq) else out[at - len(seq)])
                at += 1
            return out
    return []
