"""The vLLM backend's `n` (a `sampling_parameters` key): n samples of one prompt, each its
own stream in the engine (sample i seeded seed + i, as OpenAI's n choices here; all under
the request's id, so that a cancel stops them all), answered as that backend answers: each
response holds one row per sample, `text_output` [n] (a sample's new text, empty where it
did not move) and the outputs asked for (`finish_reason` [n], `cumulative_logprob` [n],
`logprobs` [n], `num_output_tokens` [n]; `num_input_tokens` once), the last response the
one after every sample has ended; not streamed, one response of the n whole texts.

Every request is answered through `rows`: one (generation, reply) pair per stream, the
reply's `outputs(chunk)` a streamed response's tensors and `whole(chunks)` the one
response of a request that is not streamed (None until the request's last stream ends)."""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from serving.conventions import ClientRequest
from serving.errors import InvalidArgument
from serving.replies import Reply
from serving.sampling import Chunk, GenerationRequest, join_chunks, sample_seed

# each sample's row in a response; a sample that did not move in it: these, and its
# finish reason and cumulative log-probability as they stand
_ROWS = ("text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_output_tokens")


class RowReply(Protocol):
    def outputs(self, chunk: Chunk) -> dict[str, np.ndarray]: ...

    def whole(self, chunks: Sequence[Chunk]) -> dict[str, np.ndarray] | None: ...


def check(request: ClientRequest, max_streams: int, prompts: int = 1) -> None:
    """InvalidArgument for n that this server cannot sample (the engine's streams bound it;
    one prompt, no beam search, the vLLM backend's names)."""
    n = request.samples
    if not 1 <= n <= max_streams:
        raise InvalidArgument(f"sampling parameter 'n' must be between 1 and {max_streams} "
                              f"(--max-streams), not {n}")
    if n > 1 and (request.generation.beams or 1) > 1:
        raise InvalidArgument("sampling parameter 'n' with a beam search: a search answers "
                              "with its beams")
    if n > 1 and (prompts > 1 or request.core or request.transcripts):
        raise InvalidArgument("sampling parameter 'n' takes one prompt in the vLLM backend's "
                              "names")


def rows(request: ClientRequest, tokenizer) -> list[tuple[GenerationRequest, RowReply]]:
    """The streams a request runs, each with what answers its chunks."""
    if request.samples == 1:
        return [(request.generation, Reply(request, tokenizer))]
    samples = _Samples(request, tokenizer)
    g = request.generation
    return [(dataclasses.replace(g, sampling=dataclasses.replace(
        g.sampling, seed=sample_seed(g.sampling.seed, i))), samples.row(i))
        for i in range(request.samples)]


def start(engine, generations: Sequence[GenerationRequest], deliver) -> list:
    """Submit every stream of a request, `deliver(i, chunk)` called (from the engine's
    thread) with each chunk of stream i: all of them or none (the server is full), taken
    into one step of the engine."""
    return engine.submit_all([(generation, lambda c, i=i: deliver(i, c))
                              for i, generation in enumerate(generations)])


def whole(answers: Sequence[RowReply], chunks: Sequence[Sequence[Chunk]]
          ) -> dict[str, np.ndarray]:
    """The one response of a request that is not streamed, from each stream's chunks
    (RuntimeError when one ended in an error)."""
    out = None
    for answer, got in zip(answers, chunks):
        if got[-1].reason == "error":
            raise RuntimeError(got[-1].detail)
        out = answer.whole(got) or out
    assert out is not None  # (the last stream's whole answers the request)
    return out


class _Samples:
    """One request's n samples: their rows stacked into each response."""

    def __init__(self, request: ClientRequest, tokenizer) -> None:
        self.n = request.samples
        self.replies = [Reply(request, tokenizer) for _ in range(self.n)]
        self.reasons = [b"None"] * self.n  # each sample's finish reason as it stands
        self.listing = b"[]" if request.generation.ranks else b"null"  # no new token's
        self.ended: list[Chunk | None] = [None] * self.n

    def row(self, i: int) -> "_Row":
        return _Row(self, i)

    def outputs(self, i: int, chunk: Chunk) -> dict[str, np.ndarray]:
        mine = self._own(i, chunk)
        return self._stack([mine if j == i else self._blank(j, mine) for j in range(self.n)],
                           mine)

    def whole(self, i: int, chunks: Sequence[Chunk]) -> dict[str, np.ndarray] | None:
        self.ended[i] = join_chunks(chunks)
        if any(c is None for c in self.ended):
            return None
        rows = [self._own(j, c) for j, c in enumerate(self.ended)]
        return self._stack(rows, rows[0])

    def _own(self, i: int, chunk: Chunk) -> dict[str, np.ndarray]:
        out = self.replies[i].outputs(chunk)
        if "finish_reason" in out:
            self.reasons[i] = out["finish_reason"][0]
        return out

    def _blank(self, j: int, like: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        values = {"text_output": b"", "finish_reason": self.reasons[j],
                  "cumulative_logprob": self.replies[j].cum_logprob,
                  "logprobs": self.listing, "num_output_tokens": 0}
        return {k: np.array([values[k]], like[k].dtype) for k in _ROWS if k in like}

    @staticmethod
    def _stack(rows: list[dict[str, np.ndarray]], like: dict[str, np.ndarray]
               ) -> dict[str, np.ndarray]:
        """The response: each row output stacked (sample i at i), num_input_tokens once, in
        the order the reply names them; TensorRT-LLM's outputs are not the vLLM backend's."""
        return {k: np.concatenate([r[k] for r in rows]) if k in _ROWS else v
                for k, v in like.items() if k in _ROWS or k == "num_input_tokens"}


class _Row:
    """Sample i of a request's n."""

    def __init__(self, samples: _Samples, i: int) -> None:
        self.samples, self.i = samples, i

    def outputs(self, chunk: Chunk) -> dict[str, np.ndarray]:
        return self.samples.outputs(self.i, chunk)

    def whole(self, chunks: Sequence[Chunk]) -> dict[str, np.ndarray] | None:
        return self.samples.whole(self.i, chunks)

