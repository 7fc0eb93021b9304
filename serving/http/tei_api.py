"""Hugging Face Text Embeddings Inference's API for an encoder artifact with a tokenizer (a
sentence-transformers model), for the clients written against TEI: huggingface_hub's
`InferenceClient.feature_extraction` and `.sentence_similarity` (and LangChain's and
Haystack's classes on them), LlamaIndex's `TextEmbeddingsInference`:

  POST /embed        {"inputs": text | ids | [text | ids], "normalize": true,
                      "truncate": true, "truncation_direction": "right",
                      "prompt_name": null, "dimensions": null}  ->  [[float, ...], ...]
  POST /similarity   {"inputs": {"source_sentence": str, "sentences": [str]},
                      "parameters": {"truncate", "truncation_direction", "prompt_name"}}
                     ->  [cosine similarity of each sentence with the source]
  POST /embed_sparse {"inputs", "truncate", "truncation_direction", "prompt_name"} ->
                     [[{"index": int, "value": float}, ...], ...]: a SPLADE model's
                     non-zero entries (serving/sparse.py)
  info(...)          TEI's `GET /info` body (serving/http/hf_routes.py routes it, and `POST /`)

As TEI computes them: the pooled vector (sentence-transformers' Pooling config, mean without
it), cut to `dimensions` (Matryoshka), then L2-normalized unless `normalize` is false; a text
longer than the model's input is cut from the `truncation_direction` side (right, or left),
or refused when `truncate` is false (TEI cuts by default: its --auto-truncate); `prompt_name`
puts that named prompt of config_sentence_transformers.json before each text. Each text is
its own request to the engine, so the batcher joins them. Errors are TEI's `{"error",
"error_type"}` with TEI's statuses (`error`): 413 Validation for what TEI checks itself (a
text too long, "`inputs` must have less than N tokens. Given: M"; more inputs than a call
takes; a prompt name the model lacks), 400 Empty, 422 for a body it cannot read, 429
Overloaded for a full queue."""

from __future__ import annotations

from functools import lru_cache

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import serving
from serving.embedding import Embedder, cosine, load_prompts, normalized
from serving.engine import Engine
from serving.errors import ContextTooLong, InvalidArgument, input_too_long
from serving.http.codec import http_status_for
from serving.http.embeddings_api import (MAX_INPUTS, embed_rows, embedder_of, encoder_named,
                                         pair_outputs, texts_of)
from serving.http.openai_requests import token_ids
from serving.sparse import SparseEmbedder
from serving.tokenizer import whole_length

# sentence-transformers' Pooling modes under TEI's names for them
_POOLING_NAMES = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max",
                  "lasttoken": "last_token"}
_ERROR_TYPES = {400: "Validation", 422: "Validation", 429: "Overloaded", 503: "Unhealthy"}


class Empty(InvalidArgument):
    """TEI's `Empty` error: a request with nothing to embed (400, not 422)."""


class Validation(InvalidArgument):
    """What TEI itself checks and refuses 413 (its `Validation` type): more inputs than one
    call takes, a prompt name the model lacks; an input past the model's length with
    `truncate` false is one too (a ContextTooLong, worded as TEI words it)."""


def error(exc: BaseException) -> Response:
    """TEI's `{"error", "error_type"}` with TEI's status: 413 Validation (TEI's own checks),
    400 Empty, 422 for a body it cannot read (its JSON reader's), 429 Overloaded for a full
    queue (TEI's "Model is overloaded", which a retry gets past), 503 Unhealthy."""
    status, message = http_status_for(exc)
    if isinstance(exc, Empty):
        return JSONResponse({"error": message, "error_type": "Empty"}, 400)
    if isinstance(exc, ContextTooLong):
        message = (f"`inputs` must have less than {exc.prompt_limit} tokens. Given: "
                   f"{exc.prompt_tokens}")  # TEI's words (for at most that many)
    if isinstance(exc, (Validation, ContextTooLong)):
        return JSONResponse({"error": message, "error_type": "Validation"}, 413)
    if getattr(exc, "retry_after_s", None):
        status = 429  # a full queue, which TEI answers as overloaded
    status = 422 if status == 400 else status
    return JSONResponse({"error": message, "error_type": _ERROR_TYPES.get(status, "Backend")},
                        status)


def flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidArgument(f"'{name}' must be true or false")
    return value


def from_left(body: dict) -> bool:
    """`truncation_direction`: right (the default) or left, in either case, as TEI reads it."""
    direction = body.get("truncation_direction") or "right"
    if not isinstance(direction, str) or direction.lower() not in ("left", "right"):
        raise InvalidArgument("'truncation_direction' must be 'right' or 'left'")
    return direction.lower() == "left"


def _prompt(prompts: dict[str, str], name) -> str:
    if name is None:
        return ""
    if not isinstance(name, str) or name not in prompts:
        known = sorted(prompts) or "none: the artifact has no " \
                                   "config_sentence_transformers.json prompts"
        raise Validation(f"'prompt_name' {name!r} is not one of the model's prompts "
                         f"({known})")
    return prompts[name]


def text_rows(embedder: Embedder, items: list, body: dict) -> list[list[int]]:
    """Each text's ids with its prompt, cut as the body says; a text too long for the model
    is refused when `truncate` is false (cut otherwise, as TEI's --auto-truncate, its
    default)."""
    truncate, left = flag(body, "truncate", True), from_left(body)
    prompt = _prompt(embedder.prompts, body.get("prompt_name"))
    rows = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            ids, cut = embedder.encode(prompt + item, left)
        else:  # token ids, as sent: only cut when asked to
            if prompt:
                raise InvalidArgument("'prompt_name' needs texts, not token ids")
            limit = embedder.pooling.max_tokens or len(item)
            ids, cut = (item[-limit:] if left else item[:limit]), len(item) > limit
        if cut and not truncate:
            whole = len(item) if not isinstance(item, str) else whole_length(
                embedder.tokenizer, prompt + item)
            raise input_too_long(f"inputs[{i}]", whole, embedder.pooling.max_tokens)
        rows.append(ids)
    return rows


def _texts(raw) -> list:
    if raw == [] or raw == "":
        raise Empty("'inputs' cannot be empty")
    if isinstance(raw, list) and len(raw) > MAX_INPUTS and not token_ids(raw):
        raise Validation(f"batch size {len(raw)} > maximum allowed batch size {MAX_INPUTS}")
    return texts_of(raw, "inputs")


def dimensions_of(body: dict, size: int) -> int:
    wanted = body.get("dimensions")
    if wanted is None:
        return size
    if isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 < wanted <= size:
        raise InvalidArgument(f"'dimensions' must be a positive integer up to the model's "
                              f"{size}")
    return wanted


async def embed_body(frontend, body: dict) -> Response:
    engine = encoder_named(frontend, frontend.slot.name)
    embedder = embedder_of(engine)
    rows = text_rows(embedder, _texts(body.get("inputs")), body)
    normalize = flag(body, "normalize", True)
    if embedder.pooled and (not normalize or body.get("dimensions") is not None):
        raise InvalidArgument(f"model '{engine.name}' pools (and may normalize) inside its "
                              "graph: 'normalize': false and 'dimensions' need the vector "
                              "before that, which it does not give")
    outputs = await embed_rows(frontend, engine, embedder, rows)
    if embedder.pooled:
        return JSONResponse([embedder.vector(o).tolist() for o in outputs])
    raw = [embedder.unnormalized(o) for o in outputs]
    size = dimensions_of(body, len(raw[0]))  # Matryoshka: cut first, then normalize
    return JSONResponse([(normalized(v[:size]) if normalize else v[:size]).tolist()
                         for v in raw])


async def embed(frontend, request: Request) -> Response:
    return await embed_body(frontend, await frontend.json(request))


async def similarity_body(frontend, body: dict) -> Response:
    inputs = body.get("inputs")
    if not isinstance(inputs, dict):
        raise InvalidArgument("'inputs' must be an object with 'source_sentence' and "
                              "'sentences'")
    source, sentences = inputs.get("source_sentence"), inputs.get("sentences")
    if not isinstance(source, str) or not source:
        raise InvalidArgument("'source_sentence' must be a non-empty string")
    if not isinstance(sentences, list) or not sentences or \
            any(not isinstance(s, str) or not s for s in sentences):
        raise Empty("'sentences' must be a non-empty list of non-empty strings")
    if len(sentences) >= MAX_INPUTS:  # with the source: TEI's batch
        raise Validation(f"batch size {len(sentences) + 1} > maximum allowed batch size "
                         f"{MAX_INPUTS}")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be an object")
    engine = encoder_named(frontend, frontend.slot.name)
    embedder = embedder_of(engine)
    rows = text_rows(embedder, [source, *sentences], parameters)
    vectors = [embedder.vector(o) for o in await embed_rows(frontend, engine, embedder, rows)]
    return JSONResponse([cosine(vectors[0], v) for v in vectors[1:]])


async def similarity(frontend, request: Request) -> Response:
    return await similarity_body(frontend, await frontend.json(request))


@lru_cache(maxsize=4)
def sparse_of(engine: Engine) -> SparseEmbedder:
    return SparseEmbedder(engine)


async def embed_sparse_body(frontend, body: dict) -> Response:
    """TEI's /embed_sparse: each text's SPLADE vector as its non-zero entries."""
    engine = encoder_named(frontend, frontend.slot.name)
    sparse = sparse_of(engine)
    texts = _texts(body.get("inputs"))
    if any(not isinstance(t, str) for t in texts):
        raise InvalidArgument("'inputs' must be texts: token ids are not served here")
    truncate, left = flag(body, "truncate", True), from_left(body)
    prompt = _prompt(load_prompts(engine.model.folder), body.get("prompt_name"))
    pairs = sparse.encode_all([(prompt + t, None) for t in texts], truncate, left)
    outputs = await pair_outputs(frontend, engine, sparse, pairs)
    return JSONResponse([sparse.entries(sparse.vector(o)) for o in outputs])


async def embed_sparse(frontend, request: Request) -> Response:
    return await embed_sparse_body(frontend, await frontend.json(request))


def embedding_type(embedder: Embedder) -> dict:
    """TEI's `model_type` of an embedding model: its pooling, under TEI's name."""
    pooling = "mean" if embedder.pooled else _POOLING_NAMES.get(embedder.pooling.modes[0],
                                                                 embedder.pooling.modes[0])
    return {"embedding": {"pooling": pooling}}


def info(frontend, engine: Engine, model_type: dict, max_input_length: int | None) -> dict:
    """TEI's `GET /info` body for an encoder artifact (serving/http/hf_routes.py finds its
    type: an embedding model, or a reranker)."""
    return {"model_id": frontend.slot.name, "model_sha": None, "model_dtype": "float32",
            "served_model_name": frontend.slot.name, "model_type": model_type,
            "max_concurrent_requests": engine.options.max_queue,
            "max_input_length": max_input_length,
            "max_batch_tokens": engine.max_batch * max(engine.model.buckets.seq),
            "max_batch_requests": engine.join_rows, "max_client_batch_size": MAX_INPUTS,
            "auto_truncate": True, "tokenization_workers": 1,
            "version": serving.__version__, "sha": None, "docker_label": None}


ROUTES = [("/embed", ["POST"], "tei/embed", embed, error),
          ("/embed_sparse", ["POST"], "tei/embed_sparse", embed_sparse, error),
          ("/similarity", ["POST"], "tei/similarity", similarity, error)]
