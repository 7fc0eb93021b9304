"""Reranking for a cross-encoder artifact (serving/rerank.py), in the shape RAG frameworks
call it: vLLM's and Jina's `POST /rerank` (also `/v1/rerank`) and Cohere's `POST
/v2/rerank`: `query`, `documents` (strings, or objects with a `text`), `top_n` (all by
default), `return_documents` (true by default); the results sorted by `relevance_score`,
highest first, each with its document's `index`. Each pair is its own request to the
engine, so the dynamic batcher joins them. Errors are OpenAI error objects, as vLLM's."""

from __future__ import annotations

import asyncio
import uuid
from functools import lru_cache

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.engine import Engine
from serving.errors import InvalidArgument
from serving.http.openai_api import error
from serving.rerank import Scorer, load_scorer

MAX_DOCUMENTS = 1000  # one call's documents, at most


@lru_cache(maxsize=4)
def _scorer(engine: Engine) -> Scorer:
    return load_scorer(engine)


def _documents(raw) -> list[str]:
    if not isinstance(raw, list) or not raw:
        raise InvalidArgument("'documents' must be a non-empty list of strings or of "
                              "objects with a 'text'")
    if len(raw) > MAX_DOCUMENTS:
        raise InvalidArgument(f"'documents' holds {len(raw)} items; at most {MAX_DOCUMENTS}")
    texts = [d.get("text") if isinstance(d, dict) else d for d in raw]
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise InvalidArgument(f"documents[{bad[0]}] must be a string or an object with a "
                              "'text'")
    return texts


async def rerank(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    name = body.get("model", frontend.slot.name)
    engine = frontend.slot.find(name) if isinstance(name, str) else None
    if not isinstance(engine, Engine):
        raise InvalidArgument("'model' must name a served cross-encoder (rerank scores come "
                              "from an encoder artifact)")
    scorer = _scorer(engine)
    query, documents = body.get("query"), _documents(body.get("documents"))
    if not isinstance(query, str) or not query:
        raise InvalidArgument("'query' must be a non-empty string")
    top = body.get("top_n", len(documents))
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument("'top_n' must be a positive integer")
    keep = body.get("return_documents", True)
    if not isinstance(keep, bool):
        raise InvalidArgument("'return_documents' must be true or false")
    pairs = [scorer.pair(query, d) for d in documents]
    results = await asyncio.gather(*(frontend.run(engine.infer, scorer.feeds(p), ["logits"])
                                     for p in pairs))
    scores = [scorer.score(outputs) for outputs, _ in results]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top]
    tokens = sum(len(p.ids) for p in pairs)
    return JSONResponse({
        "id": "rerank-" + uuid.uuid4().hex, "model": name,
        "usage": {"total_tokens": tokens},
        "results": [{"index": i, "relevance_score": scores[i]}
                    | ({"document": {"text": documents[i]}} if keep else {}) for i in order]})


ROUTES = [("/rerank", ["POST"], "rerank", rerank, error),
          ("/v1/rerank", ["POST"], "v1/rerank", rerank, error),
          ("/v2/rerank", ["POST"], "v2/rerank", rerank, error)]
