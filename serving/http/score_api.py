"""vLLM's score API, `POST /score` (and `/v1/score`), on an encoder artifact: `text_1` and
`text_2` (a string or a list each; one `text_1` is paired with every `text_2`, otherwise
they pair up in order), each pair scored as vLLM scores it for the model's kind:

  a cross-encoder   the pair through the model, its logit through the model's activation
                    (`use_activation: false`, or vLLM's older `activation`, for the logit);
  an embedding model the cosine of the two texts' embeddings (serving/embedding.py).

Answered as vLLM answers: {"id", "object": "list", "created", "model", "data": [{"index",
"object": "score", "score"}], "usage"}. A pair longer than the model is cut to its length.
Errors are OpenAI error objects, as vLLM's."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.embedding import cosine
from serving.errors import InvalidArgument
from serving.http.classify_api import activated
from serving.http.embeddings_api import (MAX_INPUTS, embed_rows, embedder_of,
                                         encoder_named, pair_outputs)
from serving.http.openai_api import error
from serving.http.openai_requests import model_named
from serving.http.rerank_api import scorer_of
from serving.rerank import is_cross_encoder


def _texts(body: dict, name: str) -> list[str]:
    raw = body.get(name)
    texts = [raw] if isinstance(raw, str) else raw
    if not isinstance(texts, list) or not texts or \
            any(not isinstance(t, str) or not t for t in texts):
        raise InvalidArgument(f"'{name}' must be a non-empty string or a non-empty list of "
                              "non-empty strings")
    return texts


def pairs_of(body: dict) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 with each text_2, else text_1[i] with text_2[i]."""
    first, second = _texts(body, "text_1"), _texts(body, "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidArgument(f"'text_1' ({len(first)}) and 'text_2' ({len(second)}) must "
                              "be as long as each other, or 'text_1' one text")
    if len(second) > MAX_INPUTS:
        raise InvalidArgument(f"at most {MAX_INPUTS} pairs a request, not {len(second)}")
    return list(zip(first, second))


async def _cross_scores(frontend, engine, scorer, pairs, activated: bool
                        ) -> tuple[list[float], int]:
    encoded = [scorer.pair(a, b) for a, b in pairs]
    outputs = await pair_outputs(frontend, engine, scorer, encoded)
    scores = [scorer.score(o) if activated else scorer.logit(o) for o in outputs]
    return scores, sum(len(p.ids) for p in encoded)


async def _cosines(frontend, engine, pairs) -> tuple[list[float], int]:
    embedder = embedder_of(engine)
    texts = sorted({t for pair in pairs for t in pair})  # each text embedded once
    rows = [embedder.ids(t) for t in texts]
    vectors = dict(zip(texts, (embedder.vector(o) for o in
                               await embed_rows(frontend, engine, embedder, rows))))
    return [cosine(vectors[a], vectors[b]) for a, b in pairs], sum(len(r) for r in rows)


async def score(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    name = model_named(frontend, body)
    engine = encoder_named(frontend, name)
    pairs, activated_ = pairs_of(body), activated(body)
    if is_cross_encoder(engine):
        scores, tokens = await _cross_scores(frontend, engine, scorer_of(engine), pairs,
                                             activated_)
    else:  # an embedding model: the cosine, as vLLM scores with one
        scores, tokens = await _cosines(frontend, engine, pairs)
    return JSONResponse({
        "id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
        "model": name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


ROUTES = [("/score", ["POST"], "score", score, error),
          ("/v1/score", ["POST"], "v1/score", score, error)]
