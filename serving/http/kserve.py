"""KServe v2 over HTTP/REST (the Open Inference Protocol's REST binding, with Triton's
binary-data extension): health, server and model metadata, Triton's model configuration
and statistics, and infer. Thin, as the gRPC servicer: convert, delegate to the same
engine, convert back (the metadata and configuration are the gRPC messages, as JSON)."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import serving
from serving.classify import classified, unplaced
from serving.decoder import DecoderEngine
from serving.embedding import embed_texts, texts_in
from serving.errors import InvalidArgument
from serving.http import codec
from serving.http.streams import whole_answer
from serving.trtllm_core import asks_to_stop
from serving.wire._generated import inference_pb2 as pb
from serving.wire.protocol import write_placed
from serving.wire.servicer import (EXTENSIONS, SERVER_NAME, config_for, model_metadata,
                                   model_statistics)

_BINARY = "application/octet-stream"


def _names(request: Request) -> tuple[str, str]:
    p = request.path_params
    return p["model"], p.get("version", "")


async def live(frontend, request: Request) -> Response:
    return JSONResponse({"live": True})


async def ready(frontend, request: Request) -> Response:
    ok = frontend.slot.ready()
    return JSONResponse({"ready": ok}, 200 if ok else 503)


async def server_metadata(frontend, request: Request) -> Response:
    return JSONResponse({"name": SERVER_NAME, "version": serving.__version__,
                         "extensions": list(EXTENSIONS) + ["binary_tensor_data", "generate"]})


async def model_ready(frontend, request: Request) -> Response:
    name, version = _names(request)
    ok = frontend.slot.model_ready(name, version)
    return JSONResponse({"name": name, "ready": ok}, 200 if ok else 503)


def _as_dict(message) -> dict:
    """A protobuf message as Triton's JSON (int64 fields as numbers, not strings)."""
    return _ints(MessageToDict(message, preserving_proto_field_name=True))


# the 64-bit integer fields of the messages written here (protobuf's JSON makes them strings)
_INT64 = frozenset({"dims", "shape", "count", "ns", "inference_count", "execution_count",
                    "last_inference", "batch_size", "max_queue_delay_microseconds"})


def _ints(value, key: str = ""):
    if isinstance(value, dict):
        return {k: _ints(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v, key) for v in value]
    if key in _INT64 and isinstance(value, str):
        return int(value)
    return value


async def metadata(frontend, request: Request) -> Response:
    meta = _as_dict(model_metadata(frontend.slot.find(*_names(request))))
    for key in ("inputs", "outputs"):  # an empty shape ([] is a scalar) is left out by protobuf
        for t in meta.get(key, []):
            t.setdefault("shape", [])
    return JSONResponse(meta)


async def config(frontend, request: Request) -> Response:
    return JSONResponse(_as_dict(config_for(frontend.slot.find(*_names(request)))))


async def statistics(frontend, request: Request) -> Response:
    p = request.path_params
    engines = ([frontend.slot.find(p["model"], p.get("version", ""))] if "model" in p
               else [e for e in [frontend.slot.engine] if e is not None])
    message = pb.ModelStatisticsResponse(model_stats=[model_statistics(e) for e in engines])
    return JSONResponse(_as_dict(message))


async def infer(frontend, request: Request) -> Response:
    engine = frontend.slot.find(*_names(request))
    body = await frontend.body(request)
    header, binary = codec.split_body(body, request.headers.get(codec.HEADER_LENGTH))
    regions = frontend.slot.regions
    names, as_binary = codec.requested_outputs(header)
    places, counts = codec.output_places(header), codec.class_counts(header)
    unplaced(counts, places)
    for name, place in places.items():  # a bad place is refused before the model runs
        regions.check(place, f"output '{name}'")
    feeds = codec.decode_inputs(header, binary, regions)
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")
    parameters = header.get("parameters") or {}
    if isinstance(engine, DecoderEngine) and not engine.takes_forward(feeds):
        if places or counts:
            raise InvalidArgument(f"output '{next(iter({**places, **counts}))}': a "
                                  "generation's outputs are sent as they are, in its "
                                  "response (no shared memory, no classification)")
        # the decoder answers with the outputs named, those its flags produce (Reply)
        outputs = await _generate_whole(engine, request, feeds, parameters, request_id or "",
                                        names)
        if outputs is None:  # the client went away
            return Response(status_code=499)
        final = {"triton_final_response": True}
    else:
        final = None
        texts = None if isinstance(engine, DecoderEngine) else texts_in(feeds, engine)
        if texts is not None:  # an encoder sent text: its sentence embeddings
            outputs = await frontend.run(embed_texts, engine, texts, names)
        else:
            runner = engine.forward if isinstance(engine, DecoderEngine) else engine
            outputs, _ = await frontend.run(runner.infer, feeds, names)
        if names:
            missing = [n for n in names if n not in outputs]
            if missing:
                raise InvalidArgument(f"unexpected inference output '{missing[0]}' for model "
                                      f"'{engine.name}'")
            outputs = {n: outputs[n] for n in names}
        outputs = classified(engine.forward if isinstance(engine, DecoderEngine) else engine,
                             outputs, counts)
        write_placed(regions, places, outputs)
    content, header_length = codec.encode_response(engine.name, engine.version, request_id,
                                                   outputs, as_binary, final, places)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(content, media_type=_BINARY,
                    headers={"Inference-Header-Content-Length": str(header_length)})


async def _generate_whole(engine: DecoderEngine, request: Request, feeds, parameters,
                          request_id: str, names=()):
    """A decoder's unary infer: the whole sequence in one response (None if the client left;
    a `stop` request, TensorRT-LLM's cancel: no outputs)."""
    if asks_to_stop(feeds):
        engine.stop(request_id)
        return {}
    return await whole_answer(engine, engine.parse(feeds, parameters, request_id, names),
                              request.receive)


_M = "/v2/models/{model}"
_V = "/v2/models/{model}/versions/{version}"
ROUTES = [
    ("/v2/health/live", ["GET"], "v2/health/live", live, None),
    ("/v2/health/ready", ["GET"], "v2/health/ready", ready, None),
    ("/v2", ["GET"], "v2", server_metadata, None),
    ("/v2/models/stats", ["GET"], "v2/stats", statistics, None),
] + [(base + tail, [method], "v2/models" + tail, fn, None) for base in (_M, _V)
     for tail, method, fn in (("", "GET", metadata), ("/ready", "GET", model_ready),
                              ("/config", "GET", config), ("/stats", "GET", statistics),
                              ("/infer", "POST", infer))]
