"""The engine's chunks (called back from its own thread) as an asyncio stream, and the two
ways a client can go away: a streaming response whose send fails (Starlette then cancels
the generator, whose `finally` cancels the generation), and a plain request whose client
disconnects while the answer is computed (`until_disconnect`). Either way the engine frees
the stream's slot at its next step."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from serving.sampling import Chunk, GenerationRequest

T = TypeVar("T")


class ChunkStream:
    """One submitted generation: iterate it for its chunks (the last one final); `close`
    (also run when iteration stops early) cancels the generation."""

    def __init__(self, engine, generation: GenerationRequest) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Chunk] = asyncio.Queue()
        put = self._queue.put_nowait
        # raises InvalidArgument / ResourceExhausted / Unavailable before anything is sent
        self._handle = engine.submit(generation, lambda c: loop.call_soon_threadsafe(put, c))

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            while True:
                chunk = await self._queue.get()
                yield chunk
                if chunk.final:
                    return
        finally:
            self.close()

    async def collect(self) -> list[Chunk]:
        return [c async for c in self]

    def close(self) -> None:
        self._handle.cancel()


async def until_disconnect(receive: Callable[[], Awaitable[dict]], work: Awaitable[T],
                           on_disconnect: Callable[[], None]) -> T | None:
    """`work`'s result, or None (after `on_disconnect`) when the client goes away first.
    Call it once the request body has been read: the next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        on_disconnect()
        task.cancel()
        return None
    finally:
        watch.cancel()


async def _disconnected(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
