"""Google Vertex AI's custom-container contract, as Hugging Face's Text Generation Inference
and Text Embeddings Inference answer it (their Vertex AI images are those servers), so an
endpoint's callers keep their bodies when the container behind it is this one:

  POST /vertex, and the path in AIP_PREDICT_ROUTE when Vertex AI sets it
       {"instances": [instance, ...]}  ->  {"predictions": [one per instance, in order]}
       a decoder: each instance TGI's generate body ({"inputs", "parameters"}: sampled
         unless `do_sample` is false, as TGI's Vertex route samples) or a chat completions
         body ({"messages", "max_tokens", ...}); its prediction the generated text
       an encoder: each instance a `POST /` body (TEI: embed, rerank, predict, ...; see
         serving/http/hf_routes.py), its prediction that body's answer
  GET  the path in AIP_HEALTH_ROUTE: 200 once the model serves (its accuracy re-checked)

The instances run at once (the engine batches them); the first one refused answers for the
whole call, in its API's error shape, as TGI and TEI answer. Vertex AI sends to port 8080
(AIP_HTTP_PORT): the container's args `OUT --host 0.0.0.0 --http-port 8080`."""

from __future__ import annotations

import asyncio
import os
from typing import Mapping

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument
from serving.http import hf_routes, openai_api, tgi_api
from serving.http.openai_requests import body_value

MAX_INSTANCES = 2048  # one call's, as many as one call's inputs elsewhere (the queue's share)


def _instance_request(request: Request, instance: dict) -> Request:
    """The call's request with `instance` as its body (what each API's handler reads)."""
    return Request({**request.scope, "state": {"body": orjson.dumps(instance)}},
                   request.receive)


async def _generated(frontend, request: Request, instance: dict) -> Response | str:
    """A decoder's instance: its generated text, or the refusal that answers the call."""
    try:
        if body_value(instance, "stream", (bool,), False):
            raise InvalidArgument("a Vertex AI instance is answered whole: 'stream' must be "
                                  "false")
        if "messages" in instance:
            response = await openai_api.chat_completions(frontend, _instance_request(
                request, instance))
            if response.status_code != 200:
                return response
            return orjson.loads(response.body)["choices"][0]["message"]["content"]
        parameters = body_value(instance, "parameters", (dict,), None) or {}
        body = {**instance, "parameters": {"do_sample": True, **parameters}}
        answer = await tgi_api.generate(frontend, _instance_request(request, body))
        return answer if answer.status_code != 200 else orjson.loads(answer.body)[
            "generated_text"]
    except Exception as e:  # noqa: BLE001 - answered in TGI's shape, as its Vertex route
        return tgi_api.error(e)


async def _answered(frontend, request: Request, instance: dict) -> Response | object:
    """An encoder's instance: the answer TEI's `POST /` gives its body."""
    response = await hf_routes.root(frontend, _instance_request(request, instance))
    return response if response.status_code != 200 else orjson.loads(response.body)


async def predict(frontend, request: Request) -> Response:
    body = await frontend.json(request)
    instances = body.get("instances")
    if not isinstance(instances, list) or not instances or not all(
            isinstance(x, dict) for x in instances):
        raise InvalidArgument("'instances' must be a non-empty list of request bodies")
    if len(instances) > MAX_INSTANCES:
        raise InvalidArgument(f"'instances' holds {len(instances)} bodies; at most "
                              f"{MAX_INSTANCES}")
    decoder = isinstance(frontend.slot.find(frontend.slot.name), DecoderEngine)
    one = _generated if decoder else _answered
    answers = await asyncio.gather(*(one(frontend, request, x) for x in instances))
    refused = next((a for a in answers if isinstance(a, Response)), None)
    return refused or JSONResponse({"predictions": answers})


def error(exc: BaseException) -> Response:
    return tgi_api.error(exc)  # a body that is no Vertex request: TGI's 422 shape


def routes(environ: Mapping[str, str] = os.environ) -> list[tuple]:
    """/vertex, and the predict and health paths Vertex AI names in its environment
    variables for the container (a path it gives that a route cannot be is an error)."""
    found = [("/vertex", ["POST"], "vertex", predict, error)]
    for variable, methods, name, handler in (
            ("AIP_PREDICT_ROUTE", ["POST"], "vertex/predict", predict),
            ("AIP_HEALTH_ROUTE", ["GET"], "vertex/health", openai_api.health)):
        path = environ.get(variable)
        if not path:
            continue
        if not path.startswith("/") or any(c in path for c in "{}?# "):
            raise ValueError(f"{variable}={path!r} is not a route path (one starting with "
                             "'/', without braces, '?', '#' or spaces)")
        found.append((path, methods, name, handler, error))
    return found
