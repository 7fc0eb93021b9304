"""The HTTP port: one Starlette app (KServe v2 REST, Triton's generate extension, the OpenAI,
Anthropic, Text Generation Inference and Text Embeddings Inference APIs, embeddings, rerank,
tokenizer endpoints, SageMaker's /ping and /invocations, and the metrics) run by uvicorn in a
thread of the `tuner serve` process, beside gRPC, on the same model slot and engine.

Why uvicorn + Starlette: uvicorn's C parts (httptools' HTTP parser, uvloop's event loop) keep
the cost per request low under many concurrent connections; Starlette adds routing and
streaming responses (Server-Sent Events) with little over raw ASGI. Both are well kept
(they carry FastAPI, MLServer's and vLLM's servers). The model runs in a thread pool, so the
event loop only parses and writes while the batcher joins concurrent requests.
"""

from __future__ import annotations

import asyncio
import hmac
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from python_multipart.multipart import parse_options_header
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.errors import InvalidArgument, NotFound, Unauthenticated
from serving.http.codec import http_status_for, retry_headers
from serving.http.response_store import ResponseStore
from serving.metrics import EndpointMetrics
from serving.wire.servicer import Slot

Handler = Callable[["Frontend", Request], Awaitable[Response]]


@dataclass
class Frontend:
    """What every HTTP handler shares: the model slot, the token, the metrics, the pool the
    model runs in, and the largest body accepted."""

    slot: Slot
    token: str | None = None
    metrics: EndpointMetrics | None = None
    max_body_bytes: int = 256 * 1024 * 1024
    pool: ThreadPoolExecutor | None = None
    tool_parser: str | None = None  # how chat's tool_choice "auto" reads calls (tools.PARSERS)
    reasoning_parser: str | None = None  # how chat splits thinking off (reasoning.PARSERS)
    # the OpenAI-compatible APIs take generation_config.json's sampling settings where a
    # request names none (openai_requests.model_defaults)
    model_defaults: bool = True
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses' kept

    async def run(self, fn, *args):
        """`fn(*args)` in the model's thread pool (the event loop stays free)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_length(self, request: Request) -> None:
        """InvalidArgument for a body whose declared length is over the limit (before any
        of it is read)."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise InvalidArgument(f"the body ({length} bytes) is over the limit "
                                  f"{self.max_body_bytes}")

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        """The body's chunks as they arrive, InvalidArgument as soon as they pass the limit:
        a body sent without a Content-Length (chunked) is never read past it."""
        self.check_length(request)
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise InvalidArgument(f"the body is over the limit {self.max_body_bytes} bytes")
            yield chunk

    async def body(self, request: Request) -> bytes:
        """The whole body, read once per request (a handler that passes the request on, as
        SageMaker's /invocations does, has it read again from here)."""
        body = getattr(request.state, "body", None)
        if body is None:
            body = request.state.body = b"".join([c async for c in self.stream(request)])
        return body

    async def form(self, request: Request, max_files: int, max_fields: int) -> FormData:
        """A multipart/form-data body (the audio API's), parsed as it streams in, within the
        limit."""
        kind, _ = parse_options_header(request.headers.get("content-type", ""))
        if kind != b"multipart/form-data":
            raise InvalidArgument("the body must be multipart/form-data")
        try:
            return await MultiPartParser(request.headers, self.stream(request),
                                         max_files=max_files, max_fields=max_fields).parse()
        except MultiPartException as e:
            raise InvalidArgument(f"the form is not valid: {e.message}") from None

    async def json(self, request: Request, empty_ok: bool = False) -> dict:
        """The body as a JSON object (InvalidArgument when it is not one); `empty_ok`: an
        empty body is {} (tritonclient sends none for some of Triton's extension calls)."""
        raw = await self.body(request)
        if empty_ok and not raw.strip():
            return {}
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise InvalidArgument(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("the request body must be a JSON object")
        return body

    def check_token(self, request: Request) -> None:
        """The token as a bearer token, or as `x-api-key` (what the anthropic client sends
        its api_key as)."""
        if self.token is None:
            return
        bearer = request.headers.get("authorization", "").encode()
        key = request.headers.get("x-api-key", "").encode()
        if not (hmac.compare_digest(bearer, f"Bearer {self.token}".encode())
                | hmac.compare_digest(key, self.token.encode())):
            raise Unauthenticated("missing or wrong bearer token (header 'Authorization: "
                                  "Bearer <token>', or 'x-api-key: <token>')")


def kserve_error(error: BaseException) -> Response:
    """KServe v2's error body: {"error": message}."""
    status, message = http_status_for(error)
    return JSONResponse({"error": message}, status)


def endpoint(frontend: Frontend, name: str, handler: Handler,
             errors: Callable[[BaseException], Response] = kserve_error):
    """A Starlette endpoint around `handler`: the token checked, every error answered
    through `errors` (one table of statuses), each call counted per endpoint and status."""

    async def call(request: Request) -> Response:
        start = time.perf_counter()
        try:
            frontend.check_token(request)
            response = await handler(frontend, request)
        except Exception as e:  # noqa: BLE001 - answered with a status; the server lives on
            response = errors(e)
            response.headers.update(retry_headers(e))
        if frontend.metrics is not None:
            frontend.metrics.observe("http", name, str(response.status_code),
                                     time.perf_counter() - start)
        return response

    return call


async def metrics_text(frontend: Frontend, request: Request) -> Response:
    """The server's Prometheus metrics on the HTTP port too (also on --metrics-port, as
    Triton serves them): vLLM serves them beside its API, and tools that read a server's
    metrics while they drive it look there (AIPerf)."""
    if frontend.metrics is None:
        raise NotFound("this server keeps no metrics")
    return Response(generate_latest(frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST)


# KServe's Hugging Face runtime serves the OpenAI API under /openai (a client set up for it
# has base_url ".../openai/v1"): those modules' /v1 routes answer there too
OPENAI_PREFIX = "/openai"


def build_app(frontend: Frontend) -> Starlette:
    from serving.http import (audio_api, classify_api, embeddings_api, hf_routes, kserve,
                              kserve_v1,
                              messages_api, ollama_api, openai_api, rerank_api, responses_api,
                              sagemaker, score_api, tei_api, tgi_api, tokenize_api,
                              triton_extensions, triton_generate, vertex)

    openai_shaped = (openai_api, responses_api, embeddings_api, rerank_api, audio_api)
    routes = [Route("/metrics", endpoint(frontend, "metrics", metrics_text), methods=["GET"])]
    for module in (kserve, triton_extensions, kserve_v1, triton_generate, openai_api,
                   responses_api,
                   messages_api, tokenize_api, embeddings_api, rerank_api, score_api,
                   classify_api, tgi_api,
                   tei_api, hf_routes, sagemaker, ollama_api, audio_api):
        for path, methods, name, handler, errors in module.ROUTES:
            call = endpoint(frontend, name, handler, errors or kserve_error)
            routes.append(Route(path, call, methods=methods))
            if module in openai_shaped and path.startswith("/v1/"):
                routes.append(Route(OPENAI_PREFIX + path, call, methods=methods))
    for path, methods, name, handler, errors in vertex.routes():  # Vertex AI's paths
        routes.append(Route(path, endpoint(frontend, name, handler, errors), methods=methods))
    return Starlette(routes=routes)


@dataclass(frozen=True)
class HttpOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    tls_cert: Path | None = None
    tls_key: Path | None = None
    drain_timeout_s: float = 120.0
    threads: int = 128  # model calls at a time (a waiting request holds one)


class HttpServer:
    """uvicorn serving the app in its own thread; `port` is the bound port."""

    def __init__(self, frontend: Frontend, options: HttpOptions) -> None:
        import uvicorn

        self.options = options
        frontend.pool = ThreadPoolExecutor(options.threads, thread_name_prefix="http")
        self.frontend = frontend
        self._sock = socket.socket(socket.AF_INET6 if ":" in options.host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((options.host, options.port))
        except OSError:
            self._sock.close()
            raise
        self.port = self._sock.getsockname()[1]
        tls = {}
        if options.tls_cert is not None:
            tls = {"ssl_certfile": str(options.tls_cert), "ssl_keyfile": str(options.tls_key)}
        config = uvicorn.Config(build_app(frontend), log_level="warning", access_log=False,
                                lifespan="off", loop=_loop(), http=_http(),
                                timeout_graceful_shutdown=max(1, int(options.drain_timeout_s)),
                                **tls)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, name="http",
                                        daemon=True)

    def start(self, timeout: float = 30.0) -> "HttpServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Refuse new connections; requests in flight finish (up to the drain timeout)."""
        self._server.should_exit = True
        self._thread.join(self.options.drain_timeout_s + 5)
        self._sock.close()
        self.frontend.pool.shutdown(wait=False, cancel_futures=True)


def _loop() -> str:
    try:
        import uvloop  # noqa: F401

        return "uvloop"
    except ImportError:
        return "asyncio"


def _http() -> str:
    try:
        import httptools  # noqa: F401

        return "httptools"
    except ImportError:
        return "h11"
