"""Hugging Face's Inference API for speech recognition on a Whisper export folder: what
huggingface_hub's `InferenceClient.automatic_speech_recognition` posts to `POST /` (and
SageMaker's `/invocations`, as Hugging Face's inference toolkit takes it there):

  the audio file itself as the body (WAV, FLAC, OGG, MP3, AIFF), or
  {"inputs": the file base64-encoded, "parameters": {"return_timestamps": bool,
   "generate_kwargs" (transformers' pipeline's name) or "generation_parameters" (the
   Inference API's): {"language", "task": "transcribe" | "translate", "temperature"}}}

answered as transformers' pipeline answers: {"text"}, and with `return_timestamps`
{"text", "chunks": [{"text", "timestamp": [start, end]}]} (each segment's, in seconds). One
try at the temperature (0: greedy, the pipeline's default: no fallback); audio past the
encoder's 30 s is cut into pieces at quiet moments as on OpenAI's audio API
(serving/http/audio_api.py), which does the work. Errors are TGI's shape (the `POST /` of
a model that generates text)."""

from __future__ import annotations

import base64
import binascii

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.errors import InvalidArgument
from serving.http.audio_api import (asked_for, audio_engine, fallback_of, plain_text,
                                    timed_parts)
from serving.http.streams import until_disconnect
from serving.http.transcripts import text_of

_GENERATION = ("language", "task", "temperature")  # the generation keys read


async def _audio_and_parameters(frontend, request: Request) -> tuple[bytes, dict]:
    """The audio file and the parameters: a JSON body's (its audio base64 in `inputs`), or
    none with the file as the body."""
    body = await frontend.body(request)
    kind = request.headers.get("content-type", "")
    if not (kind.startswith("application/json") or body[:1] == b"{"):
        return body, {}
    parsed = await frontend.json(request)
    inputs = parsed.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise InvalidArgument("'inputs' must be the audio file, base64-encoded")
    try:
        audio = base64.b64decode(inputs, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument("'inputs' is not base64: send the audio file "
                              "base64-encoded, or as the body itself") from None
    parameters = parsed.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be an object")
    return audio, parameters


def _fields(parameters: dict) -> tuple[FormData, str, bool]:
    """The parameters as the audio API's fields, the task, and whether timestamps are
    asked for."""
    stamps = parameters.get("return_timestamps", False)
    if stamps == "word":
        raise InvalidArgument("word timestamps are not generated here (they need the "
                              "decoder's cross-attention): ask for return_timestamps true")
    if not isinstance(stamps, bool):
        raise InvalidArgument("'return_timestamps' must be true or false")
    given = [parameters.get(k) or {} for k in ("generation_parameters", "generate_kwargs")]
    if not all(isinstance(g, dict) for g in given):
        raise InvalidArgument("'generation_parameters' and 'generate_kwargs' must be objects")
    generation = {**given[0], **given[1]}
    unknown = sorted(set(generation) - set(_GENERATION))
    if unknown:
        raise InvalidArgument(f"generation parameters {unknown} are not served (these are: "
                              f"{list(_GENERATION)})")
    task = generation.get("task", "transcribe")
    if task not in ("transcribe", "translate"):
        raise InvalidArgument("'task' must be 'transcribe' or 'translate'")
    fields = [("response_format", "verbose_json" if stamps else "json"),
              ("temperature_increment_on_fallback", "none")]  # one try, as the pipeline
    fields += [(k, str(generation[k])) for k in ("language", "temperature") if k in generation]
    return FormData(fields), task, stamps


async def recognize(frontend, request: Request) -> Response:
    engine = audio_engine(frontend, frontend.slot.name)
    audio, parameters = await _audio_and_parameters(frontend, request)
    fields, task, stamps = _fields(parameters)
    asked = await asked_for(frontend, engine, fields, audio, task)
    fallback = fallback_of(asked)
    work = (timed_parts if stamps else plain_text)(asked, fallback)
    answer = await until_disconnect(request.receive, work, fallback.close)
    if answer is None:
        return Response(status_code=499)  # the client went away
    if not stamps:
        return JSONResponse({"text": answer})
    return JSONResponse({"text": text_of(answer), "chunks": [
        {"text": t.text, "timestamp": [round(t.segment.start, 3), round(t.segment.end, 3)]}
        for t in answer]})
