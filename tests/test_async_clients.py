"""The asyncio clients that LLM applications are written with (LangChain's and LlamaIndex's
async calls and the web services around them use these, not their blocking twins), on one
decoder server: openai's AsyncOpenAI, anthropic's AsyncAnthropic, huggingface_hub's
AsyncInferenceClient (aiohttp underneath), ollama's AsyncClient and tritonclient's grpc.aio
and http.aio clients (on an encoder too). Each answer, whole or streamed, is ONNX Runtime's
own; requests sent together from one event loop come back each its own; and a stream the
application abandons (it leaves the `async for`, or its task is cancelled) frees its slot at
the next step."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from llm_support import decoder as server  # noqa: F401 - a fixture
from llm_support import (CHAT, NO_EOS, PROMPT, bert, encoder, greedy, llama,  # noqa: F401
                         rendered_ids, tokenizer, wait_for)
from serving_support import feeds_for, scraped_metrics, slowed

NEW = 8
TRITON_NAMES = {"max_tokens": (NEW, "INT32"), "stream": (True, "BOOL")}  # TensorRT-LLM's


@pytest.fixture(scope="module")
def want(llama) -> dict[str, str]:
    """Greedy's text for PROMPT (as a prompt) and for CHAT (through the chat template)."""
    text = lambda ids: tokenizer().decode(greedy(llama, ids, NEW)[0])  # noqa: E731
    return {"prompt": text(tokenizer().encode(PROMPT).ids), "chat": text(rendered_ids(CHAT))}


def _url(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def _running(server) -> float:
    return scraped_metrics(server)[("vllm:num_requests_running", ())]


def test_async_openai_whole_streamed_and_together(server, want) -> None:
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=f"{_url(server)}/v1", api_key="x", max_retries=0)
        chat = dict(model=server.slot.name, messages=CHAT, max_tokens=NEW, temperature=0,
                    extra_body=NO_EOS)
        completion = dict(model=server.slot.name, prompt=PROMPT, max_tokens=NEW,
                          temperature=0, extra_body=NO_EOS)

        async def streamed() -> str:
            stream = await client.chat.completions.create(**chat, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])

        whole, texts, done = await asyncio.gather(
            client.chat.completions.create(**chat), streamed(),
            asyncio.gather(*(client.completions.create(**completion) for _ in range(4))))
        await client.close()
        return whole.choices[0].message.content, texts, [c.choices[0].text for c in done]

    whole, streamed, completions = asyncio.run(main())
    assert whole == streamed == want["chat"]
    assert completions == [want["prompt"]] * 4


def test_async_anthropic_stream(server, want) -> None:
    from anthropic import AsyncAnthropic

    async def main():
        client = AsyncAnthropic(base_url=_url(server), api_key="x", max_retries=0)
        async with client.messages.stream(
                model=server.slot.name, system=CHAT[0]["content"], max_tokens=NEW,
                messages=CHAT[1:], extra_body={"temperature": 0, **NO_EOS}) as stream:
            text = await stream.get_final_text()
        await client.close()
        return text

    assert asyncio.run(main()) == want["chat"]


def test_async_huggingface_hub_over_aiohttp(server, want, monkeypatch) -> None:
    from huggingface_hub import AsyncInferenceClient, constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's offline mode

    async def main():
        async with AsyncInferenceClient(model=_url(server), timeout=60) as client:
            whole = await client.text_generation(PROMPT, max_new_tokens=NEW)
            tokens = [t async for t in await client.text_generation(
                PROMPT, max_new_tokens=NEW, stream=True)]
            chat = await client.chat_completion(CHAT, max_tokens=NEW, temperature=0,
                                                extra_body=NO_EOS)
        return whole, "".join(tokens), chat.choices[0].message.content

    assert asyncio.run(main()) == (want["prompt"], want["prompt"], want["chat"])


def test_async_ollama(server, want) -> None:
    import ollama

    async def main():
        client = ollama.AsyncClient(host=_url(server), timeout=60)
        options = {"temperature": 0, "repeat_penalty": 1, "num_predict": NEW}
        parts = [p.message.content async for p in await client.chat(
            model=server.slot.name, messages=CHAT, stream=True, options=options)]
        whole = await client.generate(model=server.slot.name, prompt=PROMPT, raw=True,
                                      options=options)
        return "".join(parts), whole.response

    chat, prompt = asyncio.run(main())
    # (the artifact's end token may end greedy's chat answer early: Ollama has no ignore_eos)
    assert want["chat"].startswith(chat) and chat and prompt == want["prompt"]


def _triton_inputs(module, text: str) -> list:
    made = module.InferInput("text_input", [1], "BYTES")
    made.set_data_from_numpy(np.array([text.encode()], np.object_))
    inputs = [made]
    for name, (value, datatype) in TRITON_NAMES.items():
        made = module.InferInput(name, [1], datatype)
        made.set_data_from_numpy(np.array([value], bool if datatype == "BOOL" else np.int32))
        inputs.append(made)
    return inputs


def test_tritonclient_grpc_aio_streams_and_infers(server, want) -> None:
    import tritonclient.grpc.aio as ta

    async def main():
        client = ta.InferenceServerClient(f"127.0.0.1:{server.port}")

        async def requests():
            for i in range(2):
                yield {"model_name": server.slot.name, "request_id": str(i),
                       "inputs": _triton_inputs(ta, PROMPT)}

        pieces: dict[str, list[str]] = {"0": [], "1": []}
        async for result, error in client.stream_infer(requests()):
            assert error is None, error.message()
            response = result.get_response()
            pieces[response.id] += [t.decode() for t in result.as_numpy("text_output")]
        whole = await client.infer(server.slot.name, _triton_inputs(ta, PROMPT))
        await client.close()
        return pieces, whole.as_numpy("text_output")[0].decode()

    pieces, whole = asyncio.run(main())
    assert "".join(pieces["0"]) == "".join(pieces["1"]) == whole == want["prompt"]


def test_tritonclient_http_aio_generate(server, want) -> None:
    import tritonclient.http.aio as ta

    async def main():
        client = ta.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        ready = await client.is_model_ready(server.slot.name)
        answers = await asyncio.gather(*(client.infer(server.slot.name,
                                                      _triton_inputs(ta, PROMPT))
                                         for _ in range(3)))
        await client.close()
        return ready, [a.as_numpy("text_output")[0].decode() for a in answers]

    assert asyncio.run(main()) == (True, [want["prompt"]] * 3)


@pytest.mark.parametrize("how", ["break", "cancel", "grpc-cancel"])
def test_an_abandoned_async_stream_frees_its_slot(server, how) -> None:
    """An application that stops reading (leaves the loop and closes the stream, or has its
    task cancelled, as a web framework cancels it when its own client goes; over HTTP, or
    tritonclient's grpc.aio stream): the server's stream ends at its next step, long before
    its 64 slowed tokens would, while the client itself is still open."""
    from openai import AsyncOpenAI

    async def until_cancelled(read) -> None:
        task = asyncio.create_task(read())
        await asyncio.sleep(0.3)  # a few tokens in
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def over_http():
        client = AsyncOpenAI(base_url=f"{_url(server)}/v1", api_key="x", max_retries=0)
        stream = await client.completions.create(model=server.slot.name, prompt=PROMPT,
                                                 max_tokens=64, stream=True,
                                                 extra_body=NO_EOS)
        if how == "break":
            async for _ in stream:
                break
            await stream.close()
        else:
            async def read():
                async for _ in stream:
                    pass

            await until_cancelled(read)
        freed = await asyncio.to_thread(wait_for, lambda: _running(server) == 0, 1.5)
        await client.close()
        return freed

    async def over_grpc():
        import tritonclient.grpc.aio as ta

        client = ta.InferenceServerClient(f"127.0.0.1:{server.port}")
        long = _triton_inputs(ta, PROMPT)
        long[1].set_data_from_numpy(np.array([64], np.int32))  # max_tokens

        async def requests():
            yield {"model_name": server.slot.name, "inputs": long}
            await asyncio.sleep(60)  # the stream stays open, as a client's would

        async def read():
            async for _ in client.stream_infer(requests()):
                pass

        await until_cancelled(read)
        freed = await asyncio.to_thread(wait_for, lambda: _running(server) == 0, 1.5)
        await client.close()
        return freed

    generator, fast = slowed(server, 0.05)  # 64 tokens: about 3 s
    try:
        assert asyncio.run(over_grpc() if how == "grpc-cancel" else over_http())
    finally:
        generator.runner = fast


def test_tritonclient_aio_clients_on_an_encoder(encoder, bert) -> None:
    """Requests of different lengths sent together from one loop (the batcher joins them)
    over both aio clients: each row ONNX Runtime's own output for it."""
    import onnxruntime as ort
    import tritonclient.grpc.aio as ga
    import tritonclient.http.aio as ha

    session = ort.InferenceSession(str(bert), providers=["CPUExecutionProvider"])
    feeds = [feeds_for(n, seed=n) for n in (5, 9, 16, 31)]

    def inputs(module, feed: dict) -> list:
        made = []
        for name, array in feed.items():
            made.append(module.InferInput(name, list(array.shape), "INT64"))
            made[-1].set_data_from_numpy(array)
        return made

    async def main():
        clients = (ga.InferenceServerClient(f"127.0.0.1:{encoder.port}"),
                   ha.InferenceServerClient(f"127.0.0.1:{encoder.http_port}"))
        answers = await asyncio.gather(*(c.infer(encoder.slot.name, inputs(m, f))
                                         for c, m in zip(clients, (ga, ha)) for f in feeds))
        for c in clients:
            await c.close()
        return [a.as_numpy("last_hidden_state") for a in answers]

    got = asyncio.run(main())
    for k, feed in enumerate(feeds * 2):
        want = session.run(["last_hidden_state"], feed)[0]
        np.testing.assert_allclose(got[k], want, atol=1e-4)
