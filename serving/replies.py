"""What a decoder's client gets back, in the names of Triton's LLM backends
(serving/conventions.py parses what it sent): per chunk of tokens, `output_ids` and
`text_output` (the prompt's text first when the request asked), TensorRT-LLM's
`sequence_length`, `output_log_probs` and `cum_log_probs` in every response (a beam
search's beams in one response, a row each), and the outputs sent only when asked (the
token counts, the vLLM backend's `finish_reason`, `cumulative_logprob` and `logprobs`), as
those backends write them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from serving.conventions import ClientRequest
from serving.sampling import Chunk, join_chunks
from serving.tokenizer import token_text
from serving.whisper_names import OUTPUT, transcript

_VLLM_REASONS = {"length": "length", "stop": "stop"}  # else vLLM's "abort"


def chunk_outputs(chunk: Chunk, with_text: bool) -> dict[str, np.ndarray]:
    """The response tensors of one chunk: text_output [1] first (as both Triton LLM backends
    answer; a client may read the first output as the text), then output_ids [1, k]."""
    out = {"text_output": np.array([(chunk.text or "").encode()], dtype=object)} if with_text \
        else {}
    out["output_ids"] = np.array([chunk.ids], np.int64).reshape(1, len(chunk.ids))
    return out


@dataclass
class Reply:
    """One request's responses: the totals they carry (sequence length, cumulative
    log-probability) and the prompt text sent ahead of the first one when asked."""

    request: ClientRequest
    tokenizer: object | None  # the artifact's (None: no text outputs)
    generated: int = 0
    cum_logprob: float = 0.0
    started: bool = field(default=False)
    text: str = ""  # the text so far (a transcript's responses carry all of it)

    def outputs(self, chunk: Chunk) -> dict[str, np.ndarray]:
        if chunk.beams is not None:
            return self._named(self._beams(chunk))
        if self.request.core:
            return self._named(self._core(chunk))
        if self.request.transcripts:
            self.text += chunk.text or ""
            return self._named({OUTPUT: np.array([transcript(self.text).encode()], object)})
        text = chunk.text
        if not self.started and self.request.prompt_text is not None:
            text = self.request.prompt_text + (text or "")
        self.started = True
        out = chunk_outputs(Chunk(chunk.ids, text), self.tokenizer is not None)
        self.generated += len(chunk.ids)
        out["sequence_length"] = np.array([self.generated], np.int32)
        # TensorRT-LLM's outputs in every response, as its ensemble answers (a client such as
        # perf_analyzer reads them): log-probs are 0 unless asked for, as TensorRT-LLM's are
        lp = np.array(chunk.logprobs if chunk.logprobs is not None else [0.0] * len(chunk.ids),
                      np.float32)
        self.cum_logprob += float(lp.sum())
        out["output_log_probs"] = lp
        out["cum_log_probs"] = np.array([self.cum_logprob], np.float32)
        out.update(self._asked_for(chunk))
        return self._named(out)

    def whole(self, chunks: Sequence[Chunk]) -> dict[str, np.ndarray]:
        """The one response of a request that is not streamed."""
        return self.outputs(join_chunks(chunks))

    def _named(self, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.request.batch_index is not None:  # a row of a batch says which, as TRT-LLM
            out["batch_index"] = np.array([[self.request.batch_index]], np.int32)
        if self.request.outputs:  # those the client named (one its flags leave out stays out)
            return {n: out[n] for n in self.request.outputs if n in out}
        return out

    def _core(self, chunk: Chunk) -> dict[str, np.ndarray]:
        """TensorRT-LLM's core model's response: one beam, [1, 1, n] (serving/trtllm_core.py);
        its log-probs only when asked, as it sends them."""
        ids = chunk.ids
        if not self.started and self.request.prompt_ids_first:
            ids = self.request.generation.prompt + ids
        self.started = True
        out = {"output_ids": np.array(ids, np.int32).reshape(1, 1, len(ids)),
               "sequence_length": np.array([[len(ids)]], np.int32)}
        if self.request.generation.logprobs:
            lp = np.array(chunk.logprobs or (), np.float32)
            self.cum_logprob += float(lp.sum())
            out["output_log_probs"] = lp.reshape(1, 1, len(lp))
            out["cum_log_probs"] = np.array([[self.cum_logprob]], np.float32)
        out.update(self._asked_for(chunk))
        return out

    def _beams(self, chunk: Chunk) -> dict[str, np.ndarray]:
        """A search's k beams, best first, in the one response that ends it, as TensorRT-LLM
        answers a beam width: each beam a row of output_ids (the core model's [1, k, n], its
        ensemble's [k, n]; a shorter beam padded, its length in sequence_length), and its
        ensemble's text_output [k]; log-probs 0, as they are unless asked for."""
        r, beams = self.request, chunk.beams
        first = r.generation.prompt if r.core and r.prompt_ids_first else ()
        rows = [first + b.ids for b in beams]
        width = max(len(row) for row in rows)
        ids = np.array([row + (r.pad,) * (width - len(row)) for row in rows], np.int32)
        lengths = np.array([len(row) for row in rows], np.int32)
        if r.core:
            out = {"output_ids": ids[None], "sequence_length": lengths[None]}
        else:
            out = {"text_output": np.array([((r.prompt_text or "") + (b.text or "")).encode()
                                            for b in beams], dtype=object)} \
                if self.tokenizer is not None else {}
            out |= {"output_ids": ids, "sequence_length": lengths,
                    "output_log_probs": np.zeros(ids.shape, np.float32),
                    "cum_log_probs": np.zeros(len(beams), np.float32)}
        out.update(self._asked_for(chunk))
        return out

    def _asked_for(self, chunk: Chunk) -> dict[str, np.ndarray]:
        """The outputs sent only when asked (COUNTS, VLLM_OUTPUTS), as the backends write
        them: the finish reason as Python's str() of vLLM's ("None" until the last one)."""
        extras, out = self.request.extras, {}
        if "num_input_tokens" in extras:
            out["num_input_tokens"] = np.array([len(self.request.generation.prompt)], np.uint32)
        if "num_output_tokens" in extras:
            out["num_output_tokens"] = np.array([len(chunk.ids)], np.uint32)
        if "finish_reason" in extras:
            reason = _VLLM_REASONS.get(chunk.reason, "abort") if chunk.final else "None"
            out["finish_reason"] = np.array([reason.encode()], dtype=object)
        if "cumulative_logprob" in extras:
            out["cumulative_logprob"] = np.array([self.cum_logprob], np.float32)
        if "logprobs" in extras:
            listing = None if chunk.ranks is None else [
                self._listing(*at) for at in zip(chunk.ids, chunk.logprobs, chunk.ranks,
                                                 chunk.top_logprobs or [()] * len(chunk.ids))]
            out["logprobs"] = np.array([json.dumps(listing).encode()], dtype=object)
        return out

    def _listing(self, token: int, logprob: float, rank: int, top) -> dict:
        """One position as vLLM lists it: the sampled id first, then the most likely (rank
        1, 2, ...); JSON keys are the ids as strings."""
        entries = {token: (logprob, rank)}
        entries.update((t, (p, k)) for k, (t, p) in enumerate(top, 1))
        return {str(t): {"logprob": p, "rank": k, "decoded_token": self._text(t)}
                for t, (p, k) in entries.items()}

    def _text(self, token: int) -> str | None:
        return None if self.tokenizer is None else token_text(self.tokenizer, token)
