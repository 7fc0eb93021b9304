"""Ollama's generation options (`options`, `format`, `logprobs`) as a generation request:
what a request leaves out is Ollama's runner's default (temperature 0.8, top_k 40, top_p
0.9, repeat_penalty 1.1 over the last 64 ids), so a client gets what it got from Ollama;
each option maps onto the OpenAI API's name for it (serving/http/openai_requests.py reads
those); mirostat, typical_p and tfs_z, which would change the output, are refused unless at
their defaults; options that only tune Ollama's runtime (num_ctx, num_gpu, ...) are
ignored, as Ollama ignores those it does not know."""

from __future__ import annotations

import dataclasses
import uuid

from serving.decoder import DecoderEngine
from serving.errors import InvalidArgument
from serving.http.ollama_context import predict_of
from serving.http.openai_requests import body_value, generations_for, top_count
from serving.http.reasoning import Thinking
from serving.sampling import GenerationRequest

# Ollama's runner's defaults, for what a request's options leave out
_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1,
             "repeat_last_n": 64}
_OPENAI_NAMES = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
                 "min_p": "min_p", "seed": "seed", "stop": "stop",
                 "repeat_penalty": "repetition_penalty", "presence_penalty":
                 "presence_penalty", "frequency_penalty": "frequency_penalty"}
_REFUSED = {"mirostat": 0, "typical_p": 1, "tfs_z": 1}  # each changes the output otherwise


def _openai_body(body: dict, most: int) -> dict:
    """A request's options and format under the OpenAI API's names; num_predict cut to the
    `most` the prompt and --max-tokens leave (Ollama, which has neither bound, would shift
    its window and go on)."""
    options = {**_DEFAULTS, **(body_value(body, "options", (dict,), {}) or {})}
    for name, default in _REFUSED.items():
        if options.get(name) not in (None, default):
            raise InvalidArgument(f"option '{name}' is not supported (only {default})")
    out = {_OPENAI_NAMES[k]: v for k, v in options.items() if k in _OPENAI_NAMES
           and v is not None}
    predict = predict_of(body)
    if predict is not None:
        out["max_tokens"] = max(1, min(predict, most))
    if isinstance(out.get("seed"), int) and out["seed"] < 0:  # Ollama's -1: a random seed
        del out["seed"]
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt}}
    elif fmt not in (None, ""):
        raise InvalidArgument("'format' must be \"json\" or a JSON schema")
    return out


def generation_of(engine: DecoderEngine, body: dict, prompt: tuple[int, ...],
                thinking: Thinking | None) -> GenerationRequest:
    logprobs = body_value(body, "logprobs", (bool,), False)
    top = top_count("top_logprobs", body_value(body, "top_logprobs", (int,), 0))
    most = min(engine.generator.room(len(prompt)), engine.options.max_tokens)
    (generation,) = generations_for(engine, _openai_body(body, most), prompt,
                                    top if logprobs or top else None,
                                    "ollama-" + uuid.uuid4().hex)
    last_n = body_value(body.get("options") or {}, "repeat_last_n", (int,),
                        _DEFAULTS["repeat_last_n"])
    if last_n < -1:
        raise InvalidArgument("'repeat_last_n' must be -1 (all), 0 (off) or a count")
    sampling = generation.sampling
    sampling = dataclasses.replace(sampling, penalty_last_n=max(last_n, 0)) if last_n else \
        dataclasses.replace(sampling, repetition_penalty=1.0)
    grammar = generation.grammar if thinking is None else thinking.constrain(generation.grammar)
    return dataclasses.replace(generation, sampling=sampling, grammar=grammar)
