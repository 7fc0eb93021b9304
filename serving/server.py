"""Start, run and stop a `tuner serve` process: the gRPC server (inference, health and
reflection services), the HTTP server (KServe v2 REST, Triton's generate extension, the
OpenAI-compatible API; serving.http), the metrics endpoint, TLS and the bearer token (the
same on both ports), and signals.

Lifecycle:
  start()  binds the ports at once (live, not ready), then loads the model in a thread:
           runners, the accuracy gate on this machine, the layout probe; then ready.
  stop()   (SIGTERM/SIGINT in `serve`): health NOT_SERVING and ready false, gRPC refuses new
           calls, every call already accepted runs to its answer (up to `drain_timeout_s`),
           the batcher drains, the metrics endpoint closes."""

from __future__ import annotations

import gc
import logging
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from serving.decoder import DecoderEngine
from serving.engine import Engine, EngineOptions
from serving.errors import ServingError
from serving.generation import GenerateOptions
from serving.http.reasoning import PARSERS as REASONING_PARSERS
from serving.http.tools import PARSERS
from serving.metrics import (Stats, add_endpoint_metrics, add_generation_metrics, make_metrics,
                             start_metrics_server)
from serving.model import load_artifact
from serving.seq2seq import Seq2SeqEngine, load_seq2seq
from serving.shared_memory import SystemRegions
from serving.wire._generated import POOL
from serving.wire._generated import inference_pb2_grpc as pb_grpc
from serving.wire.interceptors import EndpointInterceptor, TokenInterceptor
from serving.wire.servicer import InferenceServicer, Slot
from tuner.artifact.store import read_manifest
from tuner.errors import BadInput
from tuner.graph.seq2seq_record import is_seq2seq_folder
from tuner.runtime.base import SessionSettings

log = logging.getLogger("serving")

SERVICE = "inference.GRPCInferenceService"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int | None = 8001  # gRPC; 0: any free port (see Server.port); None: no gRPC
    http_port: int | None = None  # REST + OpenAI (`tuner serve`: 8000); 0: any; None: none
    metrics_port: int | None = 8002  # None: no metrics endpoint; 0: any free port
    model_name: str | None = None  # default: the source model file's stem
    backend: str | None = None  # default: the manifest's backend
    engine: EngineOptions = field(default_factory=EngineOptions)
    generate: GenerateOptions = field(default_factory=GenerateOptions)  # decoders only
    settings: SessionSettings | None = None  # default: those the artifact was timed with
    tls_cert: Path | None = None
    tls_key: Path | None = None
    token: str | None = None
    max_message_bytes: int = 256 * 1024 * 1024
    threads: int = 128  # gRPC handler threads: a waiting request holds one
    drain_timeout_s: float = 120.0
    tool_call_parser: str | None = None  # chat's tool_choice "auto": serving/http/tools.py
    reasoning_parser: str | None = None  # chat's thinking apart: serving/http/reasoning.py
    # "auto": the OpenAI-compatible APIs default to the sampling settings of the model's
    # generation_config.json, as vLLM's do; "none": to the APIs' own
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise BadInput("--tls-cert and --tls-key go together")
        for name in ("tls_cert", "tls_key"):
            p = getattr(self, name)
            if p is not None and not Path(p).is_file():
                raise BadInput(f"--{name.replace('_', '-')} {p}: no such file")
        for what, port in (("port", self.port), ("HTTP port", self.http_port),
                           ("metrics port", self.metrics_port)):
            if port is not None and not 0 <= port <= 65535:
                raise BadInput(f"{what} must be in [0, 65535], not {port}")
        if self.port is None and self.http_port is None:
            raise BadInput("both gRPC and HTTP are turned off: serve at least one")
        if self.tool_call_parser not in (None, *PARSERS):
            raise BadInput(f"--tool-call-parser must be one of {list(PARSERS)}, not "
                           f"{self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise BadInput(f"--reasoning-parser must be one of {list(REASONING_PARSERS)}, "
                           f"not {self.reasoning_parser!r}")
        if self.generation_config not in ("auto", "none"):
            raise BadInput("--generation-config must be 'auto' or 'none', not "
                           f"{self.generation_config!r}")
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise BadInput("the token must be non-empty and hold no whitespace")
        if not 1024 <= self.max_message_bytes <= 2**31 - 1:
            raise BadInput("max message size must be in [1 KiB, 2 GiB)")
        if not 1 <= self.threads <= 4096:
            raise BadInput("threads must be in [1, 4096]")


def _register_in_pool(*files) -> None:
    """Reflection answers from our private pool: put health's and reflection's own
    descriptors there too, so that one pool describes every service this server offers."""
    for fd in files:
        try:
            POOL.FindFileByName(fd.name)
        except KeyError:
            POOL.AddSerializedFile(fd.serialized_pb)


class Server:
    def __init__(self, artifact: str | Path, options: ServerOptions = ServerOptions(),
                 say: Callable[[str], None] = print) -> None:
        self.artifact, self.options, self.say = Path(artifact), options, say
        if is_seq2seq_folder(self.artifact):  # an encoder-decoder export folder, as it is
            name = options.model_name or self.artifact.resolve().name
        else:
            manifest = read_manifest(self.artifact)  # bad artifacts fail here, before any port
            name = options.model_name or Path(manifest.source_path).stem
        self.slot = Slot(name, regions=SystemRegions(options.max_message_bytes))
        self.stats = Stats()
        self.metrics = make_metrics(self.stats, name, "1")
        self.endpoint_metrics = add_endpoint_metrics(self.metrics)
        self.health = health.HealthServicer()
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.failed: BaseException | None = None
        self.loaded = threading.Event()  # set when loading ends, ready or failed
        self._grpc: grpc.Server | None = None
        self._http = None  # serving.http.app.HttpServer
        self._metrics_http = None

    # ------------------------------------------------------------------------------ start

    def _build(self) -> grpc.Server:
        o = self.options
        size = [("grpc.max_receive_message_length", o.max_message_bytes),
                ("grpc.max_send_message_length", o.max_message_bytes),
                # gRPC shares ports by default (SO_REUSEPORT): a second server started on a
                # busy port would silently take half of its calls. Refuse instead.
                ("grpc.so_reuseport", 0)]
        interceptors = [EndpointInterceptor(self.endpoint_metrics)]
        if o.token:
            interceptors.append(TokenInterceptor(o.token))
        server = grpc.server(ThreadPoolExecutor(o.threads, thread_name_prefix="grpc"),
                             interceptors=interceptors, options=size)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(self.slot), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        _register_in_pool(health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server, pool=POOL)
        address = f"{o.host}:{o.port}"
        try:
            if o.tls_cert is not None:
                creds = grpc.ssl_server_credentials(
                    [(Path(o.tls_key).read_bytes(), Path(o.tls_cert).read_bytes())])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as e:  # grpc raises when the address cannot be bound
            raise BadInput(f"cannot listen on {address} ({e})") from None
        if not self.port:
            raise BadInput(f"cannot listen on {address}")
        return server

    def start(self, load: bool = True) -> "Server":
        """Bind and serve (live, not ready); load and check the model in the background
        (`load=False`: not yet; call `load()`)."""
        o = self.options
        if o.port is not None:
            self._grpc = self._build()
            self._grpc.start()
        try:
            if o.http_port is not None:
                self._http = self._build_http().start()
                self.http_port = self._http.port
            if o.metrics_port is not None:
                try:
                    self._metrics_http = start_metrics_server(self.metrics, o.host,
                                                              o.metrics_port)
                except OSError as e:
                    raise BadInput(f"cannot serve metrics on {o.host}:{o.metrics_port} "
                                   f"({e})") from None
                self.metrics_port = self._metrics_http[0].server_port
        except BaseException:
            if self._grpc is not None:
                self._grpc.stop(None)
            if self._http is not None:
                self._http.stop()
            raise
        tls = "s" if o.tls_cert else ""
        where = ([f"grpc{tls}://{o.host}:{self.port}"] if self.port is not None else []) + \
            ([f"http{tls}://{o.host}:{self.http_port}"] if self.http_port is not None else [])
        self.say(f"listening on {', '.join(where)}"
                 + (f", metrics on http://{o.host}:{self.metrics_port}/metrics"
                    if self.metrics_port else "")
                 + f"; model '{self.slot.name}' loading")
        if load:
            threading.Thread(target=self.load, name="load", daemon=True).start()
        return self

    def _build_http(self):
        try:
            from serving.http.app import Frontend, HttpOptions, HttpServer
        except ImportError as e:  # the HTTP stack is a dependency, but may be missing
            raise BadInput(f"the HTTP port needs {e.name or 'its packages'} (pip install "
                           "starlette uvicorn uvloop httptools orjson), or turn it off with "
                           "--http-port -1") from None

        o = self.options
        frontend = Frontend(self.slot, o.token, self.endpoint_metrics, o.max_message_bytes,
                            tool_parser=o.tool_call_parser,
                            reasoning_parser=o.reasoning_parser,
                            model_defaults=o.generation_config == "auto")
        try:
            return HttpServer(frontend, HttpOptions(o.host, o.http_port, o.tls_cert, o.tls_key,
                                                    o.drain_timeout_s, o.threads))
        except OSError as e:
            raise BadInput(f"cannot listen on {o.host}:{o.http_port} ({e})") from None

    def load(self) -> None:
        """Load the model, run the accuracy gate, then report ready (or record the failure)."""
        try:
            engine = self._engine()
            with self.slot.lock:
                if self.slot.draining:  # stopped while loading
                    engine.close()
                    return
                self.slot.engine = engine
                self.slot.status = "ready"
            for service in ("", SERVICE):
                self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
            self.say(f"model '{self.slot.name}' ready ({engine.model.note}); {engine.note()}"
                     + self._defaults_note(engine) + self._apis_note(engine))
        except BaseException as e:  # noqa: BLE001 - reported; `serve` exits 1
            self.failed = e
            self.slot.status = f"failed to load: {e}"
            self.say(f"model '{self.slot.name}' failed to load: {type(e).__name__}: {e}")
        finally:
            self.loaded.set()

    def _apis_note(self, engine) -> str:
        """An encoder's kind and the HTTP APIs that take its texts."""
        if self.options.http_port is None:
            return ""
        from serving.http.hf_routes import text_apis

        try:
            apis = text_apis(engine)
        except ServingError as e:  # a model the text APIs cannot feed: they will say so
            return f"; no text APIs ({e})"
        return f"; {apis}" if apis else ""

    def _defaults_note(self, engine) -> str:
        """What the OpenAI-compatible APIs sample with by default, where the model's
        generation_config.json says (vLLM warns of the same when it applies them)."""
        text = getattr(engine, "text", None)
        if text is None or not text.sampling or self.options.http_port is None:
            return ""
        named = ", ".join(f"{k} {v}" for k, v in text.sampling)
        if self.options.generation_config == "none":
            return f"; generation_config.json's {named} not applied (--generation-config none)"
        return (f"; the OpenAI-compatible APIs sample with generation_config.json's {named} "
                "where a request names none (--generation-config none: their own defaults)")

    def _engine(self) -> Engine | DecoderEngine:
        """The artifact's selected variant loaded and gated (an encoder-decoder folder: its
        graphs loaded and their cache path checked), in the engine its kind takes."""
        o = self.options
        gen_metrics = lambda: add_generation_metrics(self.metrics, self.slot.name, "1")  # noqa
        if is_seq2seq_folder(self.artifact):
            return Seq2SeqEngine(load_seq2seq(self.artifact, o.backend, o.settings,
                                              self.slot.name, log=self.say),
                                 o.generate, self.stats, self.metrics, gen_metrics())
        model = load_artifact(self.artifact, o.backend, o.settings, self.slot.name,
                              log=self.say, overlap=o.engine.workers is None,
                              shadow=o.engine.shadow_fraction > 0)
        if model.cache_model:  # generation, and a plain forward for requests with a past
            return DecoderEngine(model, o.generate, self.stats, self.metrics, gen_metrics(),
                                 forward=Engine(model, o.engine, self.stats, self.metrics))
        return Engine(model, o.engine, self.stats, self.metrics)

    def wait_ready(self, timeout: float | None = None) -> bool:
        self.loaded.wait(timeout)
        return self.slot.ready()

    # ------------------------------------------------------------------------------- stop

    def stop(self, grace: float | None = None) -> None:
        """Refuse new calls, answer every accepted one, then release everything."""
        grace = self.options.drain_timeout_s if grace is None else grace
        with self.slot.lock:
            self.slot.draining = True
        self.health.enter_graceful_shutdown()
        engine = self.slot.engine
        if isinstance(engine, DecoderEngine):  # streams end within the grace, saying why
            engine.drain(max(0.0, grace - 1.0))
        stopped = self._grpc.stop(grace) if self._grpc is not None else None
        if self._http is not None:
            self._http.stop()
        if stopped is not None:
            stopped.wait()
        engine = self.slot.engine
        if engine is not None:
            engine.close()
        self.slot.regions.close()  # every client's shared memory region let go
        if self._metrics_http is not None:
            http, thread = self._metrics_http
            http.shutdown()
            http.server_close()
            thread.join(5)


def hold_the_startup_heap() -> None:
    """Put what the start-up made (~90k objects for a decoder) out of the cycle collector's
    reach, as vLLM does: a full collection of it took 47 ms, a pause for every running stream;
    0.4 ms after. Only in the process `serve` owns (tests start many servers in one)."""
    gc.collect()
    gc.freeze()


def serve(artifact: str | Path, options: ServerOptions, say: Callable[[str], None] = print
          ) -> int:
    """Run until SIGTERM/SIGINT, then drain and stop. 0 after a clean stop; if the model
    could not be loaded: 2 when the artifact is at fault, 1 otherwise."""
    server = Server(artifact, options, say)
    stop = threading.Event()
    signals = {}

    def on_signal(signum, frame):
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signals[sig] = signal.signal(sig, on_signal)
    try:
        server.start()
        held = False
        while not stop.wait(0.2):
            if server.failed is not None:
                break
            if not held and server.slot.ready():
                hold_the_startup_heap()
                held = True
        say("stopping: refusing new calls, finishing the ones in flight")
        server.stop()
        answered = server.stats.success.count + server.stats.fail.count
        say(f"stopped after answering {answered} inference request(s)")
        if server.failed is None:
            return 0
        return 2 if isinstance(server.failed, BadInput) else 1
    finally:
        for sig, previous in signals.items():
            signal.signal(sig, previous)
