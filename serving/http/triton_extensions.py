"""Triton's system shared memory and model repository extensions over HTTP, as Triton's own
HTTP server routes them (tritonclient.http calls these paths); CUDA shared memory's routes
are refused. Thin: convert, call the slot or its regions (serving.shared_memory), convert
back; errors are KServe's `{"error": ...}` through the one table of statuses."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.errors import InvalidArgument
from serving.shared_memory import no_cuda


def _ok() -> Response:
    """Triton's answer to a call that succeeds with nothing to say: 200, an empty body."""
    return Response(b"", 200, media_type="application/json")


def _uint(body: dict, key: str, default: int | None = None) -> int:
    value = body.get(key, default)
    if value is None:
        raise InvalidArgument(f"Shared memory register request has no '{key}' field")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"Shared memory register request: '{key}' must be an integer "
                              f">= 0, not {value!r}")
    return value


async def shm_status(frontend, request: Request) -> Response:
    regions = frontend.slot.regions.status(request.path_params.get("name", ""))
    return JSONResponse([{"name": r.name, "key": r.key, "offset": r.offset,
                          "byte_size": r.byte_size} for r in regions])


async def shm_register(frontend, request: Request) -> Response:
    body = await frontend.json(request, empty_ok=True)
    key = body.get("key")
    if not isinstance(key, str):
        raise InvalidArgument("Shared memory register request has no 'key' field (a string)")
    client = request.client.host if request.client is not None else None  # None: a socket
    frontend.slot.regions.register(request.path_params["name"], key, _uint(body, "offset", 0),
                                   _uint(body, "byte_size"), client)
    return _ok()


async def shm_unregister(frontend, request: Request) -> Response:
    frontend.slot.regions.unregister(request.path_params.get("name", ""))
    return _ok()


async def cuda_refused(frontend, request: Request) -> Response:
    no_cuda()
    return _ok()  # not reached: no_cuda raises


async def repository_index(frontend, request: Request) -> Response:
    ready = (await frontend.json(request, empty_ok=True)).get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidArgument("Invalid value for 'ready': expected a boolean")
    return JSONResponse([{"name": m.name, "version": m.version, "state": m.state,
                          **({"reason": m.reason} if m.reason else {})}
                         for m in frontend.slot.index(ready)])


async def repository_load(frontend, request: Request) -> Response:
    parameters = (await frontend.json(request, empty_ok=True)).get("parameters") or {}
    if not isinstance(parameters, dict):
        raise InvalidArgument("'parameters' must be an object")
    frontend.slot.load(request.path_params["model"], list(parameters))
    return _ok()


async def repository_unload(frontend, request: Request) -> Response:
    frontend.slot.unload(request.path_params["model"])
    return _ok()


_SHM = "/v2/systemsharedmemory"
_CUDA = "/v2/cudasharedmemory"
_REGION = "/region/{name}"
ROUTES = [
    (_SHM + "/status", ["GET"], "v2/systemsharedmemory/status", shm_status, None),
    (_SHM + _REGION + "/status", ["GET"], "v2/systemsharedmemory/status", shm_status, None),
    (_SHM + _REGION + "/register", ["POST"], "v2/systemsharedmemory/register", shm_register,
     None),
    (_SHM + "/unregister", ["POST"], "v2/systemsharedmemory/unregister", shm_unregister, None),
    (_SHM + _REGION + "/unregister", ["POST"], "v2/systemsharedmemory/unregister",
     shm_unregister, None),
    ("/v2/repository/index", ["POST"], "v2/repository/index", repository_index, None),
    ("/v2/repository/models/{model}/load", ["POST"], "v2/repository/load", repository_load,
     None),
    ("/v2/repository/models/{model}/unload", ["POST"], "v2/repository/unload",
     repository_unload, None),
] + [(_CUDA + tail, [method], "v2/cudasharedmemory", cuda_refused, None)
     for tail, method in (("/status", "GET"), (_REGION + "/status", "GET"),
                          (_REGION + "/register", "POST"), ("/unregister", "POST"),
                          (_REGION + "/unregister", "POST"))]
