"""The engine's chunks (called back from its own thread) as an asyncio stream, and the two
ways a client can go away: a streaming response whose send fails (Starlette then cancels
the generator, whose `finally` cancels the generation), and a plain request whose client
disconnects while the answer is computed (`until_disconnect`). Either way the engine frees
the stream's slot at its next step."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, Sequence, TypeVar

from serving import samples
from serving.sampling import Chunk, GenerationRequest, join_chunks

T = TypeVar("T")


class ChunkStreams:
    """Submitted generations (OpenAI's `n` choices: one stream each in the engine): iterate
    for (index, chunk) pairs, as the engine makes them, until every one has sent its final
    chunk; `close` (also run when iteration stops early) cancels them all."""

    def __init__(self, engine, generations: Sequence[GenerationRequest]) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, Chunk]] = asyncio.Queue()
        put = self._queue.put_nowait
        # raises InvalidArgument / ResourceExhausted / Unavailable before anything is sent
        self._handles = samples.start(engine, generations,
                                      lambda i, c: loop.call_soon_threadsafe(put, (i, c)))

    async def __aiter__(self) -> AsyncIterator[tuple[int, Chunk]]:
        try:
            running = len(self._handles)
            while running:
                index, chunk = await self._queue.get()
                running -= chunk.final
                yield index, chunk
        finally:
            self.close()

    async def collect(self) -> list[list[Chunk]]:
        """Each generation's chunks, by index."""
        out: list[list[Chunk]] = [[] for _ in self._handles]
        async for index, chunk in self:
            out[index].append(chunk)
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.cancel()


class ChunkStream(ChunkStreams):
    """One submitted generation: iterate it for its chunks (the last one final)."""

    def __init__(self, engine, generation: GenerationRequest) -> None:
        super().__init__(engine, [generation])

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        async for _, chunk in super().__aiter__():
            yield chunk

    async def collect(self, seen: Callable[[Chunk], None] | None = None) -> list[Chunk]:
        """The chunks, each passed to `seen` as it comes (an answer's timings)."""
        out = []
        async for chunk in self:
            if seen is not None:
                seen(chunk)
            out.append(chunk)
        return out

    async def whole(self, receive: Callable[[], Awaitable[dict]],
                    seen: Callable[[Chunk], None] | None = None) -> Chunk | None:
        """The generation as one final chunk, or None when the client went away first (the
        generation is then stopped); RuntimeError when it ended otherwise than at a stop or
        at its length (an answer that is not streamed: the LLM APIs). `seen`: as collect."""
        chunks = await until_disconnect(receive, self.collect(seen), self.close)
        if chunks is None:
            return None
        whole = join_chunks(chunks)
        if whole.reason not in ("length", "stop"):
            raise RuntimeError(whole.detail or f"generation ended: {whole.reason}")
        return whole


async def whole_answer(engine, parsed, receive: Callable[[], Awaitable[dict]]
                       ) -> dict | None:
    """A request of Triton's names answered whole (KServe infer, Triton's generate): its
    one response's tensors, or None when the client went away first."""
    rows = samples.rows(parsed, engine.tokenizer)  # one, or the vLLM backend's n
    streams = ChunkStreams(engine, [g for g, _ in rows])
    chunks = await until_disconnect(receive, streams.collect(), streams.close)
    return None if chunks is None else samples.whole([answer for _, answer in rows], chunks)


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
