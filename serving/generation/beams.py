"""Beam search for one stream, step by step, as transformers' generate runs it (its
vectorized `_beam_search`, 4.50 on): an encoder-decoder's generation config names
`num_beams` (Marian's 4, BART's 4), and its users compare the served text with what
`generate` gives them. Pure numpy; the loop (serving/generation/seq2seq.py) owns the rows.

    per step, k beams (1 row at the first step), vocabulary V:
      scores = log_softmax(logits) (float32), then the constraints (-inf; a forced token 0)
      acc = scores + running beam scores                      (k, V) -> flattened
      the 2k best (beam, token) continuations; those ending (the end token, or the length
      limit) among the first k become finished hypotheses, scored sum / length ** penalty;
      the k best that do not end run on (their rows gathered: cache rows reordered)
    done when k hypotheses are finished and no running beam can beat them (early_stopping
    False: judged at the current length; True: at once; "never": at the limit for a positive
    penalty), or at the length limit. The best hypothesis is the answer (the n best where
    more are asked for).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

_OUT = np.float32(-1.0e9)  # how transformers rules a candidate out


@dataclass(frozen=True)
class BeamConfig:
    beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"

    def __post_init__(self) -> None:
        if self.beams < 1:
            raise ValueError(f"beams must be >= 1, not {self.beams}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', not "
                             f"{self.early_stopping!r}")


def config_for(request, base: BeamConfig, beams: int) -> BeamConfig:
    """`base` (the model's settings) with `beams` beams and the request's own length penalty
    and early stopping where it names them."""
    own = {"length_penalty": request.length_penalty, "early_stopping": request.early_stopping}
    return replace(base, beams=beams, **{k: v for k, v in own.items() if v is not None})


def searchable(request) -> bool:
    """Whether a beam search answers `request` as asked: greedy, and nothing asked of it that
    a search does not give (per-token scores, grammars, penalties, stop words)."""
    r, sampling = request, request.sampling
    return sampling.greedy and not sampling.adjusts and not (
        r.logprobs or r.top_logprobs or r.ranks or r.grammar or r.stop_sequences
        or r.bad_words or r.timestamps or r.prompt_logprobs is not None)


def unsearchable(beams: int) -> str:
    """Why a request that `searchable` refuses is not searched with `beams` beams."""
    return (f"beam search ({beams} beams) is greedy and gives the best sequence only: no "
            "sampling, penalties, log-probs, grammars, stop words, bad words or timestamps "
            "with it")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


class BeamSearch:
    """One stream's beams. `step(scores)` takes the rows' constrained log-probs and returns
    which current row each next beam continues (the loop gathers its cache rows so)."""

    def __init__(self, config: BeamConfig, eos: frozenset[int], max_new: int) -> None:
        self.k, self.config, self.eos, self.max_new = config.beams, config, eos, max_new
        self.running = np.zeros((1, 0), np.int64)  # (rows, generated)
        self.scores = np.zeros(1, np.float32)  # running beams' summed log-probs
        self.finished: list[tuple[float, tuple[int, ...]]] = []  # best first, at most k
        self.generated = 0
        self.improvable = True  # transformers' "early stop heuristic unsatisfied"
        self.done = False

    @property
    def next_tokens(self) -> list[int]:
        """Each running beam's last token (what its row is fed next)."""
        return self.running[:, -1].tolist()

    def step(self, scores: np.ndarray) -> list[int]:
        """`scores` (rows, V): this step's log-probs per running beam, constraints applied.
        The rows the next beams continue, in their order."""
        k, vocab = self.k, scores.shape[1]
        flat = (scores.astype(np.float32) + self.scores[:, None]).reshape(-1)
        keep = min(2 * k, flat.size)
        top = np.argsort(-flat, kind="stable")[:keep]
        values, rows, tokens = flat[top], top // vocab, top % vocab
        at_limit = self.generated + 1 >= self.max_new
        ends = np.array([at_limit or int(t) in self.eos for t in tokens])
        self._finish(values, rows, tokens, ends)
        running = values + ends.astype(np.float32) * _OUT
        chosen = np.argsort(-running, kind="stable")[:k]
        self.running = np.concatenate([self.running[rows[chosen]], tokens[chosen, None]], 1)
        self.scores = running[chosen].astype(np.float32)
        self.generated += 1
        self._judge(all(ends))
        return rows[chosen].tolist()

    def _finish(self, values, rows, tokens, ends) -> None:
        """The first k candidates that end become hypotheses, the best k kept."""
        full = len(self.finished) == self.k and self.config.early_stopping is True
        if full or not self.improvable:
            return
        norm = np.float32(self.generated + 1) ** np.float32(self.config.length_penalty)
        for rank in range(min(self.k, len(values))):
            if ends[rank]:
                sequence = (*self.running[rows[rank]].tolist(), int(tokens[rank]))
                self.finished.append((float(values[rank] / norm), sequence))
        self.finished.sort(key=lambda h: -h[0])  # (stable: earlier ones first on ties)
        del self.finished[self.k:]

    def _judge(self, no_continuation: bool) -> None:
        c = self.config
        if len(self.finished) == self.k:  # can a running beam still beat the worst one?
            length = (self.max_new if c.early_stopping == "never" and c.length_penalty > 0
                      else self.generated)
            best = self.scores[0] / np.float32(length) ** np.float32(c.length_penalty)
            self.improvable &= bool(best > self.finished[-1][0])
        all_done = len(self.finished) == self.k and c.early_stopping is True
        self.done = not self.improvable or all_done or no_continuation

    def best(self) -> tuple[int, ...]:
        """The answer: the best finished hypothesis (its end token last, where it ended so)."""
        return self.top(1)[0]

    def top(self, n: int) -> list[tuple[int, ...]]:
        """The n best finished hypotheses, best first (transformers' num_return_sequences);
        running beams after them where fewer have finished (not once done: the length limit
        finishes k of them)."""
        found = [sequence for _, sequence in self.finished]
        return (found + [tuple(row) for row in self.running.tolist()])[:n]
