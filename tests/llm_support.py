"""Helpers for the LLM client tests (conventions over gRPC, REST, generate, OpenAI): a decoder
artifact with a byte-level BPE tokenizer, a chat template and an end token, an in-process
server on free ports, and a greedy reference computed with ONNX Runtime directly (the
whole sequence re-run each step, no cache: nothing of the server's is reused). Not a test
module."""

from __future__ import annotations

import dataclasses
import json
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from models.tokenizer import byte_level_bpe
from serving.server import Server, ServerOptions
from serving_support import make_artifact
from tuner.artifact.records import Buckets
from tuner.graph.load import load_model, save_model
from tuner.rewrite.logits_to_keep import add_logits_to_keep

BUCKETS = Buckets(batch=(1, 2, 4, 8), seq=(16, 32, 64))
POSITIONS = 256
VOCAB = 1003
# ChatML, as many instruct models' tokenizer_config.json carry it
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role']"
                 " + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a chat turn, and the body extra that has generation run its whole length
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a fox."}]
NO_EOS = {"ignore_eos": True}
PROMPT = "The quick brown fox jumps over"  # greedy never meets the end token in 32 tokens
EOS_PROMPT = "Café, naïve"  # greedy meets the end token after a few tokens


# ChatML that names the tools in a system turn, as tool-calling models' templates do (theirs
# write whole schemas, too long for this model's 256 positions)
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} "
                  "{{ t.function.name | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
                  + CHAT_TEMPLATE)
TOOL_CHAT = [{"role": "user", "content": "Weather in Oslo?"}]  # a turn the tools answer
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": [
                 "UTC", "CET"]}}, "required": ["zone"], "additionalProperties": False}}}]


@lru_cache(maxsize=1)
def tokenizer():
    return byte_level_bpe(VOCAB)


@lru_cache(maxsize=2)
def _session(model: Path):
    import onnxruntime as ort

    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])


def logits_of(model: Path, ids: list[int]) -> np.ndarray:
    """(S, vocab): the raw logits at every position of `ids`, by ONNX Runtime in one run
    from an empty cache."""
    sess, s = _session(model), len(ids)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.array([ids], np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((1, s), np.int64)
        elif i.name == "position_ids":
            feeds[i.name] = np.arange(s, dtype=np.int64)[None]
        else:  # past keys/values: (1, kv_heads, 0, head_dim)
            feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    return sess.run(["logits"], feeds)[0][0]


def greedy(model: Path, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy tokens and the raw logits each was drawn from, by ONNX Runtime on the whole
    sequence each step (past length 0)."""
    ids, logits_seen = list(prompt), []
    for _ in range(n):
        logits = logits_of(model, ids)[-1]
        logits_seen.append(logits)
        ids.append(int(np.argmax(logits)))
    return ids[len(prompt):], logits_seen


def guided_greedy(model, prompt: list[int], grammar: str, eos: int, n: int = 48) -> list[int]:
    """Greedy under a grammar (llguidance's text), masked with llguidance's own numpy
    helpers on ONNX Runtime's logits of the whole sequence; stops at `eos` or when the
    grammar is complete."""
    from llguidance import LLMatcher, LLTokenizer
    from llguidance.numpy import (allocate_token_bitmask, apply_token_bitmask_inplace,
                                  fill_next_token_bitmask)

    twin = LLTokenizer(tokenizer().to_str(), n_vocab=VOCAB, eos_token=[eos])
    matcher, ids, out = LLMatcher(twin, grammar), list(prompt), []
    mask = allocate_token_bitmask(1, twin.vocab_size)
    for _ in range(n):
        row = logits_of(model, ids)[-1:].copy()
        fill_next_token_bitmask(matcher, mask)
        apply_token_bitmask_inplace(row, mask)
        token = int(np.argmax(row[0]))
        if token == eos:
            break
        assert matcher.consume_token(token)
        ids.append(token)
        out.append(token)
        if matcher.is_stopped():
            break
    return out


def schema_grammar(schema: dict) -> str:
    """A JSON schema as llguidance's grammar, compact JSON (as the server constrains it)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))


def rendered(messages: list[dict], template: str = CHAT_TEMPLATE, **kwargs) -> str:
    """The chat as transformers' apply_chat_template renders it with the test tokenizer's
    special tokens (the reference every served chat prompt is checked against)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer(), bos_token="<s>",
                                  eos_token="<|im_end|>")
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                   **{"add_generation_prompt": True, **kwargs})


def rendered_ids(messages: list[dict], template: str = CHAT_TEMPLATE, **kwargs) -> list[int]:
    return tokenizer().encode(rendered(messages, template, **kwargs),
                              add_special_tokens=False).ids


def cut_copy(model: Path, dst: Path) -> Path:
    """`model` with its LM head cut to the positions a step reads, as `tuner optimize`
    serves a decoder (tuner.rewrite.logits_to_keep)."""
    graph = load_model(model)
    add_logits_to_keep(graph)
    return save_model(graph, dst)


def decoder_artifact(tmp: Path, model: Path) -> Path:
    """The llama-kv artifact with tokenizer.json, tokenizer_config.json (chat template, end
    token) and config.json (positions, eos_token_id). It serves the graph as `tuner optimize`
    serves a decoder, its LM head cut (`last-logits`), so that every client test runs the
    cut, prompt log-probs (every position) included."""
    kept = cut_copy(model, tmp / "variants" / "last-logits" / "model.onnx")
    out = make_artifact(tmp, model, BUCKETS, kept, "last-logits")
    tok = tokenizer()
    tok.save(str(out / "tokenizer.json"))
    avoid = set(greedy(model, tok.encode(PROMPT).ids, 32)[0])
    seen = greedy(model, tok.encode(EOS_PROMPT).ids, 16)[0]
    eos = next(t for k, t in enumerate(seen) if k >= 2 and t not in avoid and t not in seen[:k])
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": POSITIONS,
                                                 "eos_token_id": eos}))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "bos_token": "<s>",
        "eos_token": {"content": "<|im_end|>", "special": True}}))
    return out


def tools_artifact(tmp: Path, model: Path) -> Path:
    """decoder_artifact with TOOLS_TEMPLATE for its chat template (the tools' names in a
    system turn, as tool-calling models' templates write them)."""
    out = decoder_artifact(tmp, model)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config,
                                                           "chat_template": TOOLS_TEMPLATE}))
    return out


def hf_tokenizer_folder(artifact: Path, folder: Path) -> Path:
    """The tokenizer folder a Hugging Face model comes with, for clients that load it with
    transformers' AutoTokenizer to count tokens (lm-eval, AIPerf, GuideLLM)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes((artifact / "tokenizer.json").read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}))
    return folder


def end_token_at(out: Path, model: Path, messages: list[dict], at: int) -> int:
    """Make the artifact's end token the one greedy writes `at` tokens into its answer to
    `messages` (so that an answer ends there, at a token it has not written before)."""
    answer = greedy(model, rendered_ids(messages), at + 1)[0]
    end = answer[at]
    assert end not in answer[:at], answer
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "eos_token_id": end}))
    return end


def start(out: Path, **options) -> Server:
    generate = options.pop("generate", {})
    ports = {"port": 0, "http_port": 0, "metrics_port": 0, **options}
    # the generation options as the server's defaults have them, with these changes
    options = dataclasses.replace(ServerOptions().generate, **generate)
    server = Server(out, ServerOptions(generate=options, **ports),
                    say=lambda line: None)
    server.start()
    assert server.wait_ready(120), server.slot.status
    return server


def optimized_encoder(model: Path, out: Path) -> Path:
    """`tuner optimize` of a small encoder export (its folder's config and tokenizer go with
    it), quickly: one bucket round, one variant, no probe, no fusion."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tuner", "optimize", str(model), "-o", str(out),
                        "--max-seq", "128", "--max-batch", "4", "--rounds", "2",
                        "--bucket-rounds", "1", "--max-variants", "1", "--no-probe",
                        "--no-fuse", "--no-cache"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def openai_client(server, key: str = "unused"):
    """The real openai client on a server's HTTP port (no retries: a failure shows)."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key=key,
                         max_retries=0, timeout=60)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


# Fixtures the LLM test modules import (pytest finds fixtures in a module's namespace).


@pytest.fixture(scope="module")
def llama(reference_model) -> Path:
    return reference_model("llama-kv", "awkward", "torchscript")


@pytest.fixture(scope="module")
def decoder(llama, tmp_path_factory):
    """A decoder server (gRPC and HTTP on free ports), 4 streams, max_tokens up to 64."""
    s = start(decoder_artifact(tmp_path_factory.mktemp("decoder"), llama),
              generate={"max_streams": 4, "max_tokens": 64})
    yield s
    s.stop(5)


@pytest.fixture(scope="module")
def bert(reference_model) -> Path:
    return reference_model("bert", "small", "torchscript")


@pytest.fixture(scope="module")
def encoder(bert, tmp_path_factory):
    """A BERT-small encoder server (a tensor model: gRPC and HTTP on free ports)."""
    s = start(make_artifact(tmp_path_factory.mktemp("encoder"), bert))
    yield s
    s.stop(5)

