"""The Responses API's `background: true` (serving/http/responses_api.py): the response is
answered at once, queued, while its generation runs on as a task of the server's loop; the
stored response (serving/http/response_store.py) says where it is, for `GET
/v1/responses/{id}` to poll, and `POST /v1/responses/{id}/cancel` stops it."""

from __future__ import annotations

import asyncio
from typing import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.errors import InvalidArgument
from serving.http.streams import ChunkStream
from serving.sampling import join_chunks


def in_background(frontend, answer, stream: ChunkStream, kept: Callable[[dict], None]) -> dict:
    """Run `stream` as a task of the server's loop; `answer` (responses_api's, being built)
    makes the stored response, which `kept` stores: queued, in_progress, then completed,
    incomplete, failed or cancelled. The queued response is what the request answers."""
    cancelled: list[bool] = []

    def stop() -> None:
        cancelled.append(True)
        stream.close()

    async def run() -> None:
        try:
            kept(answer.response("in_progress", []))
            whole = join_chunks(await stream.collect())
            answer.add(whole)
            if cancelled:
                kept(answer.response("cancelled", answer.output("incomplete")))
            elif whole.reason not in ("length", "stop"):
                kept(answer.response("failed", [], failure=whole.detail or
                                     f"generation ended: {whole.reason}"))
            else:
                kept(answer.final(whole))
        finally:
            frontend.responses.ran(answer.id)

    queued = answer.response("queued", [])
    kept(queued)
    frontend.responses.run(answer.id, stop, asyncio.get_running_loop().create_task(run()))
    return queued


async def cancel(frontend, request: Request) -> Response:
    """`client.responses.cancel(id)`: a running background response stopped (its slot freed
    at the engine's next step) and answered as it was left, status "cancelled"; a finished
    one answered as it is."""
    response_id = request.path_params["response_id"]
    if not frontend.responses.get(response_id).response.get("background"):
        raise InvalidArgument("only a response created with 'background': true can be "
                              "cancelled")
    task = frontend.responses.cancel(response_id)
    if task is not None:
        await asyncio.wait_for(asyncio.shield(task), 60)
    return JSONResponse(frontend.responses.get(response_id).response)
