"""Triton's generate extension: `POST v2/models/{m}/generate` answers one JSON object,
`.../generate_stream` one Server-Sent Event (`data: {...}`) per token chunk. The body's keys
are the model's inputs by name (`text_input`, `max_tokens`, ...) and `parameters` its
request parameters, parsed by the same conventions as gRPC (serving.conventions); each
output comes back as a key, one value when it holds one element, else a list."""

from __future__ import annotations

import json

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.replies import Reply
from serving.datatypes import DATATYPES
from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument
from serving.http.streams import ChunkStream, until_disconnect
from serving.sampling import join_chunks

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _tensors(engine: DecoderEngine, body: dict) -> dict[str, np.ndarray]:
    """Each input key as an array of its declared datatype (unknown names as they are:
    the parser names them in its error)."""
    declared = {s.name: s.datatype for s in engine.signature.inputs}
    out = {}
    for name, value in body.items():
        if name in ("parameters", "id"):
            continue
        values = value if isinstance(value, list) else [value]
        datatype = declared.get(name)
        try:
            if datatype == "BYTES" or (datatype is None and all(isinstance(v, str)
                                                               for v in values)):
                out[name] = np.array([str(v).encode() for v in values], dtype=object)
            elif datatype is not None:
                out[name] = np.array(values, dtype=DATATYPES[datatype])
            else:
                out[name] = np.array(values)
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument(f"'{name}' must be {datatype or 'a value'}, not "
                                  f"{value!r}") from None
        if name == "input_ids":
            out[name] = out[name].reshape(1, -1)
    return out


def _json_outputs(outputs: dict[str, np.ndarray]) -> dict:
    result = {}
    for name, array in outputs.items():
        flat = [x.decode("utf-8", "replace") if isinstance(x, bytes) else x
                for x in array.reshape(-1).tolist()]
        result[name] = flat[0] if len(flat) == 1 and name != "output_ids" else flat
    return result


async def _parse(frontend, request: Request):
    engine = frontend.slot.find(request.path_params["model"],
                                request.path_params.get("version", ""))
    if not isinstance(engine, DecoderEngine):
        raise InvalidArgument(f"model '{engine.name}' is not a decoder: generate needs one")
    body = await frontend.json(request)
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be an object")
    parsed = engine.parse(_tensors(engine, body), parameters, str(body.get("id", "")))
    return engine, parsed


def _head(engine: DecoderEngine) -> dict:
    return {"model_name": engine.name, "model_version": engine.version}


async def generate(frontend, request: Request) -> Response:
    engine, parsed = await _parse(frontend, request)
    stream = ChunkStream(engine, parsed.generation)
    chunks = await until_disconnect(request.receive, stream.collect(), stream.close)
    if chunks is None:
        return Response(status_code=499)
    if chunks[-1].reason == "error":
        raise RuntimeError(chunks[-1].detail)
    outputs = Reply(parsed, engine.tokenizer).outputs(join_chunks(chunks))
    return JSONResponse({**_head(engine), **_json_outputs(outputs)})


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def generate_stream(frontend, request: Request) -> Response:
    engine, parsed = await _parse(frontend, request)
    stream = ChunkStream(engine, parsed.generation)  # refusals answer with a status here
    reply = Reply(parsed, engine.tokenizer)

    async def events():
        async for chunk in stream:
            if chunk.reason == "error":
                yield sse({"error": chunk.detail or "generation failed"})
            elif chunk.ids or chunk.text or not chunk.final:
                yield sse({**_head(engine), **_json_outputs(reply.outputs(chunk))})

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


ROUTES = [(base + tail, ["POST"], "v2/models" + tail, fn, None)
          for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")
          for tail, fn in (("/generate", generate), ("/generate_stream", generate_stream))]
