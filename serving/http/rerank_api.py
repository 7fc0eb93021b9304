"""Reranking for a cross-encoder artifact (serving/rerank.py), in the shapes RAG frameworks
call it:
  - vLLM's and Jina's `POST /rerank` (also `/v1/rerank`) and Cohere's `POST /v2/rerank`:
    `query`, `documents` (strings, or objects with a `text`), `top_n` (all by default),
    `return_documents` (true by default); `results` sorted by `relevance_score`, highest
    first, each with its document's `index`;
  - Hugging Face Text Embeddings Inference's `POST /rerank` (a body with `texts`, not
    `documents`): `raw_scores` (the logit, not its activation), `return_text`, `truncate`
    (true by default, as TEI's --auto-truncate; false: a pair longer than the model is
    refused, as TEI refuses it); the answer a bare
    list of {index, score[, text]}, highest first, its errors TEI's (422 Validation).
Each pair is its own request to the engine, so the dynamic batcher joins them. Errors are
OpenAI error objects, as vLLM's, but for TEI's body."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from functools import lru_cache

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.engine import Engine
from serving.errors import InvalidArgument, input_too_long
from serving.http import tei_api
from serving.http.embeddings_api import MAX_INPUTS, pair_outputs
from serving.http.openai_api import error
from serving.rerank import Scorer, load_scorer
from serving.tokenizer import whole_length

MAX_DOCUMENTS = 1000  # one call's documents, at most (Cohere's limit)


@lru_cache(maxsize=4)
def scorer_of(engine: Engine) -> Scorer:
    return load_scorer(engine)


def _documents(raw, field: str) -> list[str]:
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument(f"'{field}' must be a non-empty list of strings or of "
                              "objects with a 'text'")
    if field == "texts" and len(raw) > MAX_INPUTS:  # TEI's body: its max_client_batch_size
        raise tei_api.Validation(f"batch size {len(raw)} > maximum allowed batch size "
                                 f"{MAX_INPUTS}")
    if field == "documents" and len(raw) > MAX_DOCUMENTS:
        raise InvalidArgument(f"'{field}' holds {len(raw)} items; at most {MAX_DOCUMENTS}")
    texts = [d.get("text") if isinstance(d, dict) else d for d in raw]
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise InvalidArgument(f"{field}[{bad[0]}] must be a string or an object with a "
                              "'text'")
    return texts


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise InvalidArgument(f"'{name}' must be true or false")
    return value


@dataclass(frozen=True)
class _Shape:
    """What the request asked the answer to hold (its API's own options, checked before the
    model runs)."""
    tei: bool  # Text Embeddings Inference's shape, else vLLM's / Cohere's
    top: int = 0
    documents: bool = True  # return_documents / return_text
    raw_scores: bool = False
    truncate: bool = True


def _shape(body: dict, count: int) -> _Shape:
    if _is_tei(body):
        return _Shape(True, count, _flag(body, "return_text", False),
                      _flag(body, "raw_scores", False), _flag(body, "truncate", True))
    top = body.get("top_n", count)
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument("'top_n' must be a positive integer")
    return _Shape(False, top, _flag(body, "return_documents", True))


def _is_tei(body: dict) -> bool:
    return "texts" in body and "documents" not in body


async def rerank(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    try:
        return await _rerank(frontend, body)
    except Exception as e:  # noqa: BLE001 - TEI's body: TEI's errors ({"error", "error_type"})
        if not _is_tei(body):
            raise
        return tei_api.error(e)


async def _rerank(frontend, body: dict) -> Response:
    name = body.get("model", frontend.slot.name)
    engine = frontend.slot.find(name) if isinstance(name, str) else None
    if not isinstance(engine, Engine):
        raise InvalidArgument("'model' must name a served cross-encoder (rerank scores come "
                              "from an encoder artifact)")
    field = "texts" if _is_tei(body) else "documents"
    query, documents = body.get("query"), _documents(body.get(field), field)
    if not isinstance(query, str) or not query:
        raise InvalidArgument("'query' must be a non-empty string")
    shape, scorer = _shape(body, len(documents)), scorer_of(engine)
    pairs = [scorer.pair(query, d) for d in documents]
    long = [i for i, p in enumerate(pairs) if p.truncated]
    if long and not shape.truncate:
        raise input_too_long(f"texts[{long[0]}] with the query", whole_length(
            scorer.tokenizer, query, documents[long[0]]), scorer.max_tokens)
    outputs = await pair_outputs(frontend, engine, scorer, pairs)
    scores = [scorer.logit(o) if shape.raw_scores else scorer.score(o) for o in outputs]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:shape.top]
    if shape.tei:
        return JSONResponse([{"index": i, "score": scores[i]}
                             | ({"text": documents[i]} if shape.documents else {})
                             for i in order])
    return JSONResponse({
        "id": "rerank-" + uuid.uuid4().hex, "model": name,
        "usage": {"total_tokens": sum(len(p.ids) for p in pairs)},
        "results": [{"index": i, "relevance_score": scores[i]}
                    | ({"document": {"text": documents[i]}} if shape.documents else {})
                    for i in order]})


ROUTES = [("/rerank", ["POST"], "rerank", rerank, error),
          ("/v1/rerank", ["POST"], "v1/rerank", rerank, error),
          ("/v2/rerank", ["POST"], "v2/rerank", rerank, error)]
