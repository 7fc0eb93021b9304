"""Triton's generate extension: `POST v2/models/{m}/generate` answers one JSON object,
`.../generate_stream` one Server-Sent Event (`data: {...}`) per token chunk. The body's keys
are the model's inputs by name (`text_input`, `max_tokens`, ...), `parameters` and any
other key its request parameters (as Triton passes "additional properties"), parsed by the
same conventions as gRPC (serving.conventions); each output comes back as a key, one value
when it holds one element, else a list."""

from __future__ import annotations

import json

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving import samples
from serving.datatypes import DATATYPES
from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument
from serving.http.streams import ChunkStreams, whole_answer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _tensors(engine: DecoderEngine, body: dict) -> dict[str, np.ndarray]:
    """Each key that names an input as an array of its declared datatype (the others are
    request parameters: `_parameters`)."""
    declared = {s.name: s.datatype for s in engine.signature.inputs}
    out = {}
    for name, value in body.items():
        if name not in declared:
            continue
        values = value if isinstance(value, list) else [value]
        datatype = declared[name]
        try:
            if datatype == "BYTES":
                out[name] = np.array([str(v).encode() for v in values], dtype=object)
            else:
                out[name] = np.array(values, dtype=DATATYPES[datatype])
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
    parsed = engine.parse(_tensors(engine, body), _parameters(engine, body),
                          str(body.get("id", "")))
    return engine, parsed


def _parameters(engine: DecoderEngine, body: dict) -> dict:
    """`parameters`, and, as Triton passes them, the body's keys that name no input (vLLM's
    and SGLang's benchmarks send TensorRT-LLM's BLS option `accumulate_tokens` so): a
    scalar each, else INVALID_ARGUMENT naming it."""
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be an object")
    declared = {s.name for s in engine.signature.inputs}
    extra = {k: v for k, v in body.items() if k not in declared and k not in ("parameters",
                                                                               "id")}
    for name, value in extra.items():
        if not isinstance(value, (str, int, float, bool)):
            raise InvalidArgument(f"'{name}' is not an input of model '{engine.name}', so it "
                                  "is a parameter: a string, number or boolean, not "
                                  f"{type(value).__name__}")
    return {**extra, **parameters}


def _head(engine: DecoderEngine) -> dict:
    return {"model_name": engine.name, "model_version": engine.version}


async def generate(frontend, request: Request) -> Response:
    engine, parsed = await _parse(frontend, request)
    outputs = await whole_answer(engine, parsed, request.receive)
    if outputs is None:
        return Response(status_code=499)
    return JSONResponse({**_head(engine), **_json_outputs(outputs)})


def sse(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


async def generate_stream(frontend, request: Request) -> Response:
    engine, parsed = await _parse(frontend, request)
    rows = samples.rows(parsed, engine.tokenizer)  # one, or the vLLM backend's n
    streams = ChunkStreams(engine, [g for g, _ in rows])  # refusals answer with a status here

    async def events():
        async for i, chunk in streams:
            if chunk.reason == "error":
                yield sse({"error": chunk.detail or "generation failed"})
            elif chunk.ids or chunk.text or not chunk.final or len(rows) > 1:
                yield sse({**_head(engine), **_json_outputs(rows[i][1].outputs(chunk))})

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


ROUTES = [(base + tail, ["POST"], "v2/models" + tail, fn, None)
          for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}")
          for tail, fn in (("/generate", generate), ("/generate_stream", generate_stream))]
