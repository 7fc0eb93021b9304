"""The gRPC server's interceptors: the bearer token on every call of every service, and
each call counted and timed per method and status (the same series as the HTTP
endpoints')."""

from __future__ import annotations

import hmac
import time
from contextlib import contextmanager

import grpc


class TokenInterceptor(grpc.ServerInterceptor):
    """Every call, on every service, must carry `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        got = dict(details.invocation_metadata).get("authorization", "")
        got = got.encode() if isinstance(got, str) else got
        handler = continuation(details)
        if hmac.compare_digest(got, self._expected) or handler is None:
            return handler
        return _deny(handler)


_KINDS = {(False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
          (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
          (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
          (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler)}


def _rebuilt(handler: grpc.RpcMethodHandler, behaviour) -> grpc.RpcMethodHandler:
    """`handler` with another behaviour (same kind, same (de)serializers)."""
    make = _KINDS[(handler.request_streaming, handler.response_streaming)][1]
    return make(behaviour, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    def abort(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "missing or wrong bearer token (metadata 'authorization: Bearer <token>')")

    return _rebuilt(handler, abort)


class EndpointInterceptor(grpc.ServerInterceptor):
    """Counts every call per method and status code, and times it (a stream: to its end),
    into the same series as the HTTP endpoints (serving.metrics.EndpointMetrics)."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        name, observe = details.method.rsplit("/", 1)[-1], self.metrics.observe
        kind = _KINDS[(handler.request_streaming, handler.response_streaming)][0]
        inner = getattr(handler, kind)

        @contextmanager
        def observed(context):
            start, code = time.perf_counter(), "OK"
            try:
                yield
            except BaseException:
                found = context.code() if hasattr(context, "code") else None
                code = found.name if found is not None else "UNKNOWN"
                raise
            finally:
                observe("grpc", name, code, time.perf_counter() - start)

        if not handler.response_streaming:
            def unary(request, context):
                with observed(context):
                    return inner(request, context)

            return _rebuilt(handler, unary)

        def streaming(request, context):
            with observed(context):
                yield from inner(request, context)

        return _rebuilt(handler, streaming)
