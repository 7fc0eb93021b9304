"""Generation over gRPC equals transformers' generate on prompts where that means something:
prompts of real text (models/prompts.py's tokenizer) and random ids, on reference decoders
whose greedy output varies (models/build.py informative_init). Each expected continuation is
first checked to be informative (at least FLOOR distinct tokens, not the prompt's last token
repeated), so that a server which echoes its input, or repeats one token, cannot pass."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as tg
from serving_support import make_artifact
from test_reference_informative import FLOOR

from models.build import build_torch_model, cached, spec
from models.prompts import random_prompts, text_prompts
from serving.server import Server, ServerOptions
from tuner.artifact.records import Buckets

STEPS = 12
FAMILIES = ("gpt2", "llama", "gpt_neox", "mistral", "phi")  # phi: a norm over the keys


def _transformers_greedy(model, prompt: np.ndarray) -> list[int]:
    import torch

    ids = torch.tensor(prompt[None, :])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=STEPS, min_new_tokens=STEPS, pad_token_id=0,
                             eos_token_id=None)
    return out[0, prompt.size:].tolist()


def _served_greedy(server: Server, prompt: np.ndarray) -> list[int]:
    """One streaming request through the real tritonclient, every response collected."""
    responses: queue.Queue = queue.Queue()
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        ids = tg.InferInput("input_ids", [1, prompt.size], "INT64")
        ids.set_data_from_numpy(prompt[None, :].astype(np.int64))
        limit = tg.InferInput("max_tokens", [1], "INT32")
        limit.set_data_from_numpy(np.array([STEPS], np.int32))
        client.async_stream_infer(server.slot.name, [ids, limit], request_id="r")
        tokens: list[int] = []
        while True:
            result, error = responses.get(timeout=60)
            if error is not None:
                raise error
            tokens += result.as_numpy("output_ids").reshape(-1).tolist()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tokens
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_served_greedy_equals_transformers_on_informative_prompts(family, tmp_path):
    model = build_torch_model(spec(f"{family}-kv", "awkward"))
    vocab = model.config.vocab_size
    prompts = text_prompts(vocab, 2) + random_prompts(vocab, (1, 9))
    want = [_transformers_greedy(model, p) for p in prompts]
    for prompt, tokens in zip(prompts, want):  # what the comparison is worth
        assert len(set(tokens)) >= FLOOR and tokens != [int(prompt[-1])] * STEPS, tokens
    out = make_artifact(tmp_path / "art", cached(f"{family}-kv", "awkward", "torchscript"),
                        Buckets(batch=(1, 2, 4), seq=(16, 32, 64)))
    assert served_greedy(out, prompts) == want


def served_greedy(out, prompts: list[np.ndarray]) -> list[list[int]]:
    """Each prompt's greedy tokens from `tuner serve OUT` (positions up to 256), one request
    after another over gRPC."""
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))
    server = Server(out, ServerOptions(port=0, metrics_port=0), say=lambda line: None)
    server.start()
    try:
        assert server.wait_ready(120), server.slot.status
        return [_served_greedy(server, p) for p in prompts]
    finally:
        server.stop(5)
