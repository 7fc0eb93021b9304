"""OpenAI's `POST /v1/embeddings` for an encoder artifact with a tokenizer (a sentence-
transformers model: MiniLM, BGE, E5, ...): `input` a string, a list of strings, token ids or
a list of those (at most MAX_INPUTS); `encoding_format` "float" or "base64" (float32
little-endian, which the `openai` client asks for by default); `dimensions` only as the
model's own. Each text is its own request to the engine, so the dynamic batcher joins the
texts of one call, and of concurrent calls, into its buckets. Errors are OpenAI's."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.classify import LOGITS
from serving.embedding import Embedder, embedder_of
from serving.engine import Engine
from serving.errors import InvalidArgument
from serving.http.openai_api import error
from serving.http.openai_requests import model_named, token_ids

MAX_INPUTS = 2048  # OpenAI's limit on one call's inputs


def encoder_named(frontend, name: str) -> Engine:
    engine = frontend.slot.find(name)
    if not isinstance(engine, Engine):
        raise InvalidArgument(f"model '{name}' generates text: embeddings come from an "
                              "encoder artifact")
    return engine


def texts_of(raw, field: str = "input") -> list[str | list[int]]:
    """A request's texts: a string, token ids, or a non-empty list of those."""
    items = [raw] if isinstance(raw, str) or token_ids(raw) else raw
    if not isinstance(items, list) or not items or any(
            not (isinstance(x, str) and x) and not token_ids(x) for x in items):
        raise InvalidArgument(f"'{field}' must be a non-empty string, token ids, or a "
                              "non-empty list of those")
    if len(items) > MAX_INPUTS:
        raise InvalidArgument(f"'{field}' holds {len(items)} items; at most {MAX_INPUTS}")
    return items


async def pair_outputs(frontend, engine: Engine, feeds, pairs: list) -> list[dict]:
    """The model's `logits` for each encoded text or pair (`feeds`: a serving.classify
    TextFeeds), each its own request to the engine (the batcher joins them)."""
    return [o for o, _ in await asyncio.gather(
        *(frontend.run(engine.infer, feeds.feeds(p), [LOGITS]) for p in pairs))]


async def embed_rows(frontend, engine: Engine, embedder: Embedder,
                     rows: list[list[int]]) -> list[dict[str, np.ndarray]]:
    """The model's outputs for each row of ids, each its own request to the engine (the
    batcher joins them, and those of concurrent calls, into its buckets)."""
    results = await asyncio.gather(*(frontend.run(engine.infer, embedder.feeds(ids),
                                                  [embedder.output]) for ids in rows))
    return [outputs for outputs, _ in results]


def _encoded(vector: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()


async def embeddings(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    name = model_named(frontend, body)
    engine = encoder_named(frontend, name)
    embedder = embedder_of(engine)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise InvalidArgument("'encoding_format' must be 'float' or 'base64'")
    rows = [embedder.ids(x) if isinstance(x, str) else x for x in texts_of(body.get("input"))]
    vectors = [embedder.vector(o) for o in await embed_rows(frontend, engine, embedder, rows)]
    size, wanted = len(vectors[0]), body.get("dimensions")
    if wanted is not None and wanted != size:
        raise InvalidArgument(f"'dimensions' must be this model's own, {size} (it cannot "
                              "shorten its embeddings)")
    tokens = sum(len(ids) for ids in rows)
    return JSONResponse({"object": "list", "model": name,
                         "data": [{"object": "embedding", "index": i,
                                   "embedding": _encoded(v, fmt)}
                                  for i, v in enumerate(vectors)],
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


ROUTES = [("/v1/embeddings", ["POST"], "v1/embeddings", embeddings, error)]
