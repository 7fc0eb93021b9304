"""Amazon SageMaker's container contract, which vLLM's and Text Generation Inference's servers
also answer (their SageMaker images are those servers), so an endpoint's callers keep their
bodies when the container behind it is this one:

  GET|POST /ping      200 once the model serves (its accuracy re-checked), 503 before
  POST /invocations   the body, routed by its keys to the API that takes it:
                        messages             OpenAI chat completions
                        prompt               OpenAI completions
                        inputs               `POST /` (serving/http/hf_routes.py): TGI's
                                             generate for a decoder (a list of one, or
                                             Server-Sent Events when `stream` is true),
                                             TEI's embed, similarity or predict for an
                                             encoder
                        input                OpenAI embeddings (vLLM's classify for a
                                             classifier, as vLLM routes it by its task)
                        query                rerank (vLLM's, Cohere's or TEI's shape)
                      answered, errors included, in that API's own shape

SageMaker sends to port 8080: `tuner serve OUT --host 0.0.0.0 --http-port 8080`, which the
image's entrypoint runs when SageMaker starts it (deploy/docker-entrypoint.sh)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from serving.encoder_kind import encoder_kind
from serving.engine import Engine
from serving.errors import InvalidArgument
from serving.http import (classify_api, embeddings_api, hf_routes, openai_api, rerank_api,
                          tei_api)
from serving.http.audio_api import takes_audio


async def _input(frontend, request: Request) -> Response:
    """A body with `input`: vLLM's classify for a classifier, OpenAI embeddings otherwise."""
    engine = frontend.slot.find(frontend.slot.name)
    if isinstance(engine, Engine) and encoder_kind(engine) == "classifier":
        return await classify_api.classify(frontend, request)
    return await embeddings_api.embeddings(frontend, request)


# the first of these keys that a body has picks its API (as vLLM's and TGI's /invocations
# route the bodies each of them takes)
_APIS = (("messages", openai_api.chat_completions, openai_api.error),
         ("prompt", openai_api.completions, openai_api.error),
         ("inputs", hf_routes.root, tei_api.error),  # (answers its own errors)
         ("input", _input, openai_api.error),
         ("query", rerank_api.rerank, openai_api.error))


async def ping(frontend, request: Request) -> Response:
    return await openai_api.health(frontend, request)


async def invocations(frontend, request: Request) -> Response:
    if takes_audio(frontend.slot.find(frontend.slot.name)):  # the audio file, or its base64
        return await hf_routes.root(frontend, request)
    body = await frontend.json(request)  # (read once: the API's handler gets it cached)
    for key, handler, errors in _APIS:
        if key in body:
            try:
                return await handler(frontend, request)
            except Exception as e:  # noqa: BLE001 - answered in that API's error shape
                return errors(e)
    raise InvalidArgument("the body names no API: 'messages' (chat), 'prompt' (completions), "
                          "'inputs' (TGI's generate, TEI's embed), 'input' (embeddings) or "
                          "'query' (rerank)")


ROUTES = [("/ping", ["GET", "POST"], "ping", ping, openai_api.error),
          ("/invocations", ["POST"], "invocations", invocations, openai_api.error)]
