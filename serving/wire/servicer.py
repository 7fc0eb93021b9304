"""The gRPC servicer: convert the request, delegate to the engine, convert back. Every error
leaves through serving.wire.protocol.status_for, so no exception ever reaches grpc unmapped."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Iterable

import grpc

import serving
from serving.classify import classified, unplaced
from serving.datatypes import triton_type
from serving.decoder import DecoderEngine
from serving.embedding import embed_texts, texts_in
from serving.engine import Engine
from serving.errors import InvalidArgument, NotFound, ServingError, Unavailable
from serving.model import batches
from serving.shared_memory import SystemRegions, no_cuda
from serving.wire import extensions, protocol
from serving.wire._generated import inference_pb2 as pb
from serving.wire._generated import inference_pb2_grpc as pb_grpc
from serving.wire.generation import decoder_config, generate_stream, generate_whole

log = logging.getLogger("serving")

SERVER_NAME = "shapetuner"
EXTENSIONS = ("classification", "model_configuration", "statistics", "model_repository",
              "system_shared_memory")
PLATFORM = "onnxruntime_onnx"


@dataclass
class Slot:
    """The one model this server serves: its name from the start, its engine once it is
    loaded and has passed (or failed over from) the accuracy gate."""

    name: str
    engine: Engine | DecoderEngine | None = None
    status: str = "loading and checking accuracy"
    draining: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    regions: SystemRegions = field(default_factory=SystemRegions, repr=False)

    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    def model_ready(self, name: str, version: str = "") -> bool:
        return name == self.name and version in ("", "1") and self.ready()

    def find(self, name: str, version: str = "") -> Engine | DecoderEngine:
        """The engine serving `name` (version "" or "1"); NotFound or Unavailable."""
        if name != self.name:
            raise _unknown(name)
        if version not in ("", "1"):
            raise NotFound(f"Request for unknown model: '{name}' version {version} is not found")
        engine = self.engine
        if engine is None:
            raise Unavailable(f"model '{name}' is not ready: {self.status}")
        return engine

    # Triton's model repository extension, for a server that serves one model for its
    # lifetime: the index lists it, a load of it is answered once it is ready, nothing
    # else loads and nothing unloads.

    def index(self, ready_only: bool = False) -> list[ModelIndex]:
        ready = self.ready()
        if ready_only and not ready:
            return []
        return [ModelIndex(self.name, "1", "READY" if ready else "UNAVAILABLE",
                           "" if ready else ("shutting down" if self.draining else self.status))]

    def load(self, name: str, parameters: Iterable[str] = ()) -> None:
        self._served(name, "load")
        if any(p == "config" or p.startswith("file:") for p in parameters):
            raise InvalidArgument(f"model '{name}' is served as its artifact was built: a load "
                                  "with a config or files cannot change it")
        if not self.ready():
            raise Unavailable(f"model '{name}' is not ready: "
                              f"{'shutting down' if self.draining else self.status}")

    def unload(self, name: str) -> None:
        self._served(name, "unload")
        raise InvalidArgument(f"model '{name}' cannot be unloaded: this server serves one model "
                              "for its lifetime (stop the server instead)")

    def _served(self, name: str, action: str) -> None:
        if name != self.name:
            raise NotFound(f"cannot {action} model '{name}': this server serves one model, "
                           f"'{self.name}'")


@dataclass(frozen=True)
class ModelIndex:
    """One entry of the repository index (Triton's RepositoryIndexResponse.ModelIndex)."""

    name: str
    version: str
    state: str  # READY or UNAVAILABLE
    reason: str = ""


def _unknown(name: str) -> NotFound:
    return NotFound(f"Request for unknown model: '{name}' is not found")


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, slot: Slot) -> None:
        self.slot = slot

    # --------------------------------------------------------------------------- helpers

    def _engine(self, name: str, version: str) -> Engine | DecoderEngine:
        return self.slot.find(name, version)

    @staticmethod
    def _abort(context: grpc.ServicerContext, error: Exception):
        code, message = protocol.status_for(error)
        if code == grpc.StatusCode.INTERNAL:
            log.error("internal error answering a request", exc_info=error)
        context.set_trailing_metadata(protocol.retry_trailers(error))
        context.abort(code, message)

    # ---------------------------------------------------------------------------- health

    def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.slot.ready())

    def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.slot.model_ready(request.name, request.version))

    def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=serving.__version__,
                                         extensions=EXTENSIONS)

    # ------------------------------------------------------------------------- metadata

    def ModelMetadata(self, request, context):
        try:
            engine = self._engine(request.name, request.version)
        except Exception as e:  # noqa: BLE001
            return self._abort(context, e)
        return model_metadata(engine)

    def ModelConfig(self, request, context):
        try:
            engine = self._engine(request.name, request.version)
        except Exception as e:  # noqa: BLE001
            return self._abort(context, e)
        return pb.ModelConfigResponse(config=config_for(engine))

    def ModelStatistics(self, request, context):
        try:
            engines = ([self._engine(request.name, request.version)] if request.name
                       else [e for e in [self.slot.engine] if e is not None])
        except Exception as e:  # noqa: BLE001
            return self._abort(context, e)
        return pb.ModelStatisticsResponse(model_stats=[model_statistics(e) for e in engines])

    # ------------------------------------------------------------------------- inference

    def _infer(self, request: pb.ModelInferRequest, engine: Engine | None = None
               ) -> pb.ModelInferResponse:
        engine = engine or self._engine(request.model_name, request.model_version)
        regions = self.slot.regions
        places = protocol.output_places(request)
        for name, place in places.items():  # a bad place is refused before the model runs
            regions.check(place, f"output '{name}'")
        counts = protocol.class_counts(request)
        unplaced(counts, places)
        feeds = protocol.decode_inputs(request, regions)
        names = protocol.requested_outputs(request)
        texts = texts_in(feeds, engine) if isinstance(engine, Engine) else None
        if texts is not None:  # an encoder sent text: its sentence embeddings
            outputs = embed_texts(engine, texts, names)
        else:
            outputs, _ = engine.infer(feeds, names)
        outputs = classified(engine, outputs, counts)
        protocol.write_placed(regions, places, outputs)
        return protocol.encode_response(engine.name, engine.version, request.id, outputs,
                                        list(outputs), places)

    def ModelInfer(self, request, context):
        try:
            engine = self._engine(request.model_name, request.model_version)
            if isinstance(engine, DecoderEngine):
                if engine.takes_forward(i.name for i in request.inputs):
                    return self._infer(request, engine.forward)
                if protocol.class_counts(request):
                    raise InvalidArgument("a generation's outputs are sent as they are: no "
                                          "classification")
                return generate_whole(engine, request, context, self.slot.regions)
            return self._infer(request, engine)
        except Exception as e:  # noqa: BLE001 - mapped to a status; the server lives on
            return self._abort(context, e)

    def ModelStreamInfer(self, request_iterator, context):
        """Triton's streaming extension: one response per request, in order; a failed request
        answers with `error_message` and the stream goes on. A decoder is decoupled: many
        responses per request (serving.generation_service)."""
        if isinstance(self.slot.engine, DecoderEngine):
            yield from generate_stream(self.slot.engine, request_iterator, context,
                                       self.slot.regions)
            return
        for request in request_iterator:
            try:
                yield pb.ModelStreamInferResponse(infer_response=self._infer(request))
            except Exception as e:  # noqa: BLE001
                code, message = protocol.status_for(e)
                if not isinstance(e, ServingError):
                    log.error("internal error answering a stream request", exc_info=e)
                yield pb.ModelStreamInferResponse(error_message=message)

    # ------------------------------------------------- model repository, shared memory

    def _answer(self, context: grpc.ServicerContext, call, *args):
        """`call(*args)`'s message, or the call aborted with its error's status."""
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001
            return self._abort(context, e)

    def RepositoryIndex(self, request, context):
        return self._answer(context, extensions.index, self.slot, request)

    def RepositoryModelLoad(self, request, context):
        return self._answer(context, extensions.load, self.slot, request)

    def RepositoryModelUnload(self, request, context):
        return self._answer(context, extensions.unload, self.slot, request)

    def SystemSharedMemoryStatus(self, request, context):
        return self._answer(context, extensions.shm_status, self.slot.regions, request)

    def SystemSharedMemoryRegister(self, request, context):
        return self._answer(context, extensions.shm_register, self.slot.regions, request,
                            context.peer())

    def SystemSharedMemoryUnregister(self, request, context):
        return self._answer(context, extensions.shm_unregister, self.slot.regions, request)

    def CudaSharedMemoryStatus(self, request, context):
        return self._answer(context, no_cuda)

    CudaSharedMemoryRegister = CudaSharedMemoryUnregister = CudaSharedMemoryStatus


def model_metadata(engine: Engine | DecoderEngine) -> pb.ModelMetadataResponse:
    """The served model's metadata (gRPC's message; the REST frontend writes it as JSON)."""
    sig = engine.signature if isinstance(engine, DecoderEngine) else engine.model.signature
    meta = pb.ModelMetadataResponse(name=engine.name, versions=[engine.version],
                                    platform=PLATFORM)
    for spec in sig.inputs:
        meta.inputs.add(name=spec.name, datatype=spec.datatype, shape=spec.shape)
    for spec in sig.outputs:
        meta.outputs.add(name=spec.name, datatype=spec.datatype, shape=spec.shape)
    return meta


def config_for(engine: Engine | DecoderEngine) -> pb.ModelConfig:
    return decoder_config(engine) if isinstance(engine, DecoderEngine) else model_config(engine)


def model_config(engine: Engine) -> pb.ModelConfig:
    """Triton's model configuration for the served model (what perf_analyzer reads)."""
    sig = engine.model.signature
    batching = batches(sig)
    cut = 1 if batching else 0  # with max_batch_size > 0 the batch axis is left out of dims
    config = pb.ModelConfig(name=engine.name, platform=PLATFORM, backend="onnxruntime",
                            max_batch_size=engine.max_batch if batching else 0)
    for spec in sig.inputs:
        config.input.add(name=spec.name, data_type=triton_type(spec.datatype),
                         dims=spec.shape[cut:])
    for spec in sig.outputs:
        config.output.add(name=spec.name, data_type=triton_type(spec.datatype),
                          dims=spec.shape[cut:])
    if batching:
        config.dynamic_batching.preferred_batch_size.extend(
            b for b in engine.model.buckets.batch if b <= engine.join_rows)
        config.dynamic_batching.max_queue_delay_microseconds = int(
            engine.options.max_queue_delay_ms * 1e3)
    config.instance_group.add(name=engine.name, kind="KIND_CPU", count=engine.workers)
    config.parameters["served_variant"].string_value = engine.model.served
    config.parameters["sequence_buckets"].string_value = ",".join(
        str(s) for s in engine.model.buckets.seq)
    config.parameters["runtime_backend"].string_value = engine.model.backend
    config.parameters["pad_to"].string_value = engine.pad_to
    return config


def model_statistics(engine: Engine) -> pb.ModelStatistics:
    s = engine.stats
    with s.lock:
        n = s.success.count
        stats = pb.ModelStatistics(
            name=engine.name, version=engine.version, last_inference=s.last_inference_ms,
            inference_count=s.inference_count, execution_count=s.execution_count)
        inf = stats.inference_stats
        inf.success.count, inf.success.ns = n, s.success.ns
        inf.fail.count, inf.fail.ns = s.fail.count, s.fail.ns
        inf.queue.count, inf.queue.ns = s.queue.count, s.queue.ns
        inf.compute_infer.count, inf.compute_infer.ns = s.compute_infer.count, s.compute_infer.ns
        inf.compute_input.count = inf.compute_output.count = n  # not measured apart: 0 ns
        for rows, d in sorted(s.batches.items()):
            b = stats.batch_stats.add(batch_size=rows)
            b.compute_infer.count, b.compute_infer.ns = d.count, d.ns
            b.compute_input.count = b.compute_output.count = d.count
    return stats
