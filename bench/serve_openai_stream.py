"""Tokens/s of one generation stream over the OpenAI endpoint (POST /v1/completions,
`stream: true`, read by the `openai` client), over Anthropic's Messages API (POST
/v1/messages, read by the `anthropic` client's stream helper) and over Ollama's API (POST
/api/generate, NDJSON, read by the `ollama` client) against the same stream over gRPC
(ModelStreamInfer, read by tritonclient.grpc), from one `tuner serve` process (its own
process: the client's GIL stays out of the server). Goal: OpenAI >= 0.95x gRPC (and the
Messages and Ollama APIs, held to the same).

    .venv/bin/python bench/serve_openai_stream.py [--tokens 128] [--rounds 7]

The decoder is the llama-kv reference export with random weights and a byte-level BPE
(models/tokenizer.py) and a ChatML template; greedy, end token ignored, so every stream is
as many tokens (the Messages API's prompt is the chat the template renders). Rounds rotate
which protocol goes first; the ratios are taken per round (the same minutes of machine
load) and reported as median [min-max].
"""

from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or with -m
from serve_common import (MODEL_NAME, decoder_artifact, free_port, load_note, start_tuner,
                          stop)

PROMPT = "The quick brown fox jumps over"


def over_grpc(port: int, tokens: int) -> tuple[int, float]:
    """(tokens received, seconds from sending to the final response)."""
    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    text = tg.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], object))
    n = tg.InferInput("max_tokens", [1], "INT32")
    n.set_data_from_numpy(np.array([tokens], np.int32))
    count, start = 0, time.perf_counter()
    client.async_stream_infer(MODEL_NAME, [text, n])
    while True:
        result, error = got.get(timeout=120)
        if error is not None:
            raise error
        count += result.as_numpy("output_ids").size
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    seconds = time.perf_counter() - start
    client.stop_stream()
    client.close()
    return count, seconds


def over_openai(port: int, tokens: int) -> tuple[int, float]:
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0)
    count, start = 0, time.perf_counter()
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=tokens,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    seconds = time.perf_counter() - start
    client.close()
    return count, seconds


def over_messages(port: int, tokens: int) -> tuple[int, float]:
    import anthropic

    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused",
                                 max_retries=0)
    start = time.perf_counter()
    with client.messages.stream(model=MODEL_NAME, max_tokens=tokens, messages=[
            {"role": "user", "content": PROMPT}], extra_body={"temperature": 0,
                                                              "ignore_eos": True}) as stream:
        for _ in stream.text_stream:
            pass
        count = stream.get_final_message().usage.output_tokens
    seconds = time.perf_counter() - start
    client.close()
    return count, seconds


def over_ollama(port: int, tokens: int) -> tuple[int, float]:
    import ollama

    client = ollama.Client(host=f"http://127.0.0.1:{port}", timeout=120)
    count, start = 0, time.perf_counter()
    for line in client.generate(model=MODEL_NAME, prompt=PROMPT, raw=True, stream=True,
                                options={"temperature": 0, "repeat_penalty": 1,
                                         "num_predict": tokens}):
        if line.done:
            count = line.eval_count
    seconds = time.perf_counter() - start
    return count, seconds


PATHS = (("gRPC (tritonclient)", over_grpc), ("OpenAI (openai)", over_openai),
         ("Messages (anthropic)", over_messages), ("Ollama (ollama)", over_ollama))


def run(tokens: int, rounds: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = decoder_artifact(Path(tmp))
        port, http_port = free_port(), free_port()
        proc = start_tuner(out, port, http_port=http_port)
        try:
            ports = {over_grpc: port, over_openai: http_port, over_messages: http_port,
                     over_ollama: http_port}
            for _, fn in PATHS:
                fn(ports[fn], 8)  # warm-up
            rates: dict[str, list[float]] = {label: [] for label, _ in PATHS}
            for r in range(rounds):
                k = r % len(PATHS)
                for label, fn in PATHS[k:] + PATHS[:k]:  # each goes first in turn
                    n, seconds = fn(ports[fn], tokens)
                    if n != tokens:
                        raise RuntimeError(f"{label}: {n} tokens, expected {tokens}")
                    rates[label].append(n / seconds)
        finally:
            stop(proc)
    grpc_rate = np.array(rates[PATHS[0][0]])
    lines = [f"one stream of {tokens} tokens, {rounds} rounds (rotating order)",
             f"  {'path':24s} {'tokens/s median':>16s} {'min-max':>16s}"]
    for label, v in rates.items():
        lines.append(f"  {label:24s} {np.median(v):16.1f} {min(v):7.1f}-{max(v):<8.1f}")
    for label, short in ((PATHS[1][0], "OpenAI"), (PATHS[2][0], "Messages"),
                         (PATHS[3][0], "Ollama")):
        ratio = np.array(rates[label]) / grpc_rate
        verdict = "meets" if np.median(ratio) >= 0.95 else "MISSES"
        lines.append(f"  {short} / gRPC per round: {np.median(ratio):.3f}x "
                     f"[{ratio.min():.3f}-{ratio.max():.3f}] -> {verdict} the 0.95x goal")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(load_note())
    print("\n".join(run(args.tokens, args.rounds)), flush=True)
    print(load_note())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
