"""The servicer's half for a decoder (serving.decoder): unary ModelInfer returns the whole
sequence, ModelStreamInfer is decoupled (one response per token). Thin: convert, delegate
to the engine, convert back; every error leaves through serving.protocol.status_for."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Iterator

from serving import samples
from serving.datatypes import triton_type
from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument, NotFound, ServingError
from serving.sampling import Chunk, join_chunks
from serving.shared_memory import SystemRegions
from serving.trtllm_core import asks_to_stop
from serving.wire import protocol
from serving.wire._generated import inference_pb2 as pb

log = logging.getLogger("serving")
PLATFORM = "onnxruntime_onnx"  # as serving.service says


def generate_whole(engine: DecoderEngine, request, context,
                   regions: SystemRegions | None = None) -> pb.ModelInferResponse:
    """Unary: the whole generated sequence in one response (a `stop` request: an empty
    one, once the request it names is cancelled)."""
    tensors = _decode(request, regions)
    if asks_to_stop(tensors):
        engine.stop(request.id)
        return _stopped(engine, request.id)
    parsed = engine.parse(tensors, protocol.parameter_values(request.parameters), request.id,
                          protocol.requested_outputs(request))
    streams = samples.rows(parsed, engine.tokenizer)  # one, or the vLLM backend's n
    chunks: queue.Queue[tuple[int, Chunk]] = queue.Queue()
    handles = samples.start(engine, [g for g, _ in streams], lambda i, c: chunks.put((i, c)))
    context.add_callback(lambda: [h.cancel() for h in handles])  # the client went away
    got: list[list[Chunk]] = [[] for _ in streams]
    for _ in range(len(streams)):  # until every stream has ended
        while True:
            i, chunk = chunks.get()
            got[i].append(chunk)
            if chunk.final:
                break
    outputs = samples.whole([answer for _, answer in streams], got)
    return _response(engine, request.id, outputs, join_chunks(got[-1]))


def _decode(request, regions: SystemRegions | None) -> dict:
    """The request's inputs (shared memory ones read from their regions). Outputs go in
    the responses only: a generation streams them, one response per token, and a region
    would hold only the last."""
    placed = protocol.output_places(request)
    if placed:
        raise InvalidArgument(f"output '{next(iter(placed))}': a generation's outputs are "
                              "sent in its responses, not written to shared memory")
    return protocol.decode_inputs(request, regions)


def generate_stream(engine: DecoderEngine, request_iterator, context,
                    regions: SystemRegions | None = None
                    ) -> Iterator[pb.ModelStreamInferResponse]:
    """Decoupled: every request on the stream generates at once (a reader thread submits
    them as they arrive); responses interleave, one per token, each request's last one
    flagged `triton_final_response`. A bad request answers with `error_message` only."""
    events: queue.Queue = queue.Queue()
    handles = []
    context.add_callback(lambda: [h.cancel() for h in list(handles)])
    threading.Thread(target=_read_requests,
                     args=(engine, request_iterator, events, handles, regions),
                     name="stream-reader", daemon=True).start()
    open_requests, reading = 0, True
    while reading or open_requests:
        kind, request, payload = events.get()
        if kind == "opened":
            open_requests += 1
        elif kind == "done reading":
            reading = False
        elif kind == "stopped":
            open_requests -= 1
            yield pb.ModelStreamInferResponse(infer_response=_stopped(engine, request.id))
        elif kind == "refused":
            open_requests -= 1
            code, message = protocol.status_for(payload)
            answer = pb.ModelInferResponse(model_name=engine.name, model_version=engine.version,
                                           id=request.id)
            answer.parameters["triton_final_response"].bool_param = True
            yield pb.ModelStreamInferResponse(error_message=message, infer_response=answer)
        else:  # a chunk
            chunk, state = payload
            if chunk.final:
                state.group.left -= 1
                if state.group.left == 0:
                    open_requests -= 1
            yield from _stream_responses(engine, request, chunk, state)


class _Group:
    """The rows of one request (one, or a batch of prompts): the request's last response is
    the last row's last. The rows start together or not at all (samples.start), so nothing
    of a refused request ever reaches the stream."""

    def __init__(self, rows: int) -> None:
        self.left = rows


class _RequestState:
    """One stream of a request of a decoupled stream (a row of a batch of prompts, or a
    sample of the vLLM backend's n): whether it streams, and the chunks held back when it
    does not (`stream` false: the whole sequence in one final response)."""

    def __init__(self, request, reply: samples.RowReply, stream: bool, group: _Group) -> None:
        self.stream, self.reply, self.group = stream, reply, group
        self.empty_final = protocol.parameter_values(request.parameters).get(
            "triton_enable_empty_final_response", False)
        self.held: list[Chunk] = []


def _read_requests(engine: DecoderEngine, request_iterator, events: queue.Queue,
                   handles: list, regions: SystemRegions | None) -> None:
    try:
        for request in request_iterator:
            events.put(("opened", request, None))
            try:
                tensors = _decode(request, regions)
                if asks_to_stop(tensors):  # TensorRT-LLM's cancel of a running request, by
                    # id whatever model it names (LangChain's TensorRT-LLM client sends it to
                    # `tensorrt_llm` for a request it sent to `ensemble`)
                    engine.stop(request.id)
                    events.put(("stopped", request, None))
                    continue
                _check_model(engine, request)
                batch = engine.parse_rows(tensors,
                                          protocol.parameter_values(request.parameters),
                                          request.id, protocol.requested_outputs(request))
                _submit_rows(engine, request, batch, events, handles)
            except Exception as e:  # noqa: BLE001 - answered on the stream; it goes on
                if not isinstance(e, ServingError):
                    log.error("internal error starting a generation", exc_info=e)
                events.put(("refused", request, e))
    except Exception:  # noqa: BLE001 - the client went away mid-stream
        pass
    finally:
        events.put(("done reading", None, None))


def _check_model(engine: DecoderEngine, request) -> None:
    if request.model_name != engine.name or request.model_version not in ("", "1"):
        version = f" version {request.model_version}" if request.model_version else ""
        raise NotFound(f"Request for unknown model: '{request.model_name}'{version} is not "
                       "found")


def _submit_rows(engine: DecoderEngine, request, batch: list, events: queue.Queue,
                 handles: list) -> None:
    """Start every stream of a request (a row of a batch, a sample of n), all or none:
    refused whole when the server is full."""
    streams = [(parsed, s) for parsed in batch for s in samples.rows(parsed, engine.tokenizer)]
    group = _Group(len(streams))
    states = [_RequestState(request, reply, parsed.stream, group)
              for parsed, (_, reply) in streams]
    handles.extend(samples.start(engine, [g for _, (g, _) in streams],
                                 lambda i, c: events.put(("chunk", request, (c, states[i])))))


def _stream_responses(engine: DecoderEngine, request, chunk: Chunk, state: _RequestState
                      ) -> Iterator[pb.ModelStreamInferResponse]:
    last = state.group.left == 0  # this row's final chunk ends the request too
    if not state.stream:
        state.held.append(chunk)
        outputs = state.reply.whole(state.held) if chunk.final else None
        if outputs is not None:  # (a sample's: once every sample has ended)
            yield pb.ModelStreamInferResponse(infer_response=_response(
                engine, request.id, outputs, join_chunks(state.held), last))
        return
    if chunk.final and state.empty_final and chunk.ids and last:  # asked for an empty last
        yield pb.ModelStreamInferResponse(infer_response=_chunk_response(
            engine, request.id, Chunk(chunk.ids, chunk.text, logprobs=chunk.logprobs),
            state.reply))
        chunk = Chunk((), None, True, chunk.reason, chunk.detail)
    yield pb.ModelStreamInferResponse(infer_response=_chunk_response(
        engine, request.id, chunk, state.reply, last))


def _stopped(engine: DecoderEngine, request_id: str) -> pb.ModelInferResponse:
    """The answer to a `stop` request: no outputs, final (as TensorRT-LLM's core model)."""
    response = pb.ModelInferResponse(model_name=engine.name, model_version=engine.version,
                                     id=request_id)
    response.parameters["triton_final_response"].bool_param = True
    return response


def _chunk_response(engine: DecoderEngine, request_id: str, chunk: Chunk,
                    reply: samples.RowReply, last: bool = True) -> pb.ModelInferResponse:
    return _response(engine, request_id, reply.outputs(chunk), chunk, last)


def _response(engine: DecoderEngine, request_id: str, outputs: dict, chunk: Chunk,
              last: bool = True) -> pb.ModelInferResponse:
    """One response: the tensors, the request id, and `triton_final_response` (false on
    all but the request's last: `last` false for a batch row or sample that ends before
    another), as Triton's decoupled models answer; `chunk`: whether it ends a stream, and
    how."""
    response = protocol.encode_response(engine.name, engine.version, request_id, outputs,
                                        list(outputs))
    response.parameters["triton_final_response"].bool_param = chunk.final and last
    if chunk.final:
        response.parameters["finish_reason"].string_param = chunk.reason or ""
        if chunk.detail:
            response.parameters["finish_detail"].string_param = chunk.detail
    return response


def decoder_config(engine: DecoderEngine) -> pb.ModelConfig:
    """A decoder's configuration: decoupled (many responses per request), no batch axis in
    the client's tensors (the server batches streams itself, in flight)."""
    config = pb.ModelConfig(name=engine.name, platform=PLATFORM, backend="onnxruntime",
                            max_batch_size=0)
    for spec in engine.signature.inputs:  # every one optional, as Triton's LLM ensembles
        config.input.add(name=spec.name, data_type=triton_type(spec.datatype), dims=spec.shape,
                         optional=True)
    for spec in engine.signature.outputs:
        config.output.add(name=spec.name, data_type=triton_type(spec.datatype), dims=spec.shape)
    config.model_transaction_policy.decoupled = True
    config.instance_group.add(name=engine.name, kind="KIND_CPU", count=1)
    g = engine.generator
    for key, value in (("served_variant", engine.model.served),
                       ("runtime_backend", engine.model.backend), ("pad_to", engine.pad_to),
                       ("max_streams", engine.options.max_streams),
                       ("max_cache_len", g.max_cache_len), ("max_prompt", g.max_prompt),
                       ("max_tokens", engine.options.max_tokens),
                       ("cache_buckets", ",".join(map(str, g.cache_buckets))),
                       ("batch_buckets", ",".join(map(str, g.batch_buckets)))):
        config.parameters[key].string_value = str(value)
    return config
