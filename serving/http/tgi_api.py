"""Hugging Face Text Generation Inference's generate API, for the clients written against it:
`huggingface_hub.InferenceClient.text_generation` (and the LangChain / LlamaIndex classes
on it), AIPerf's `huggingface_generate` endpoint type. A decoder artifact with a tokenizer:

  POST /generate         {"inputs": str, "parameters": {...}} -> {"generated_text", "details"?}
  POST /generate_stream  the same, as Server-Sent Events: one per token
                         ({"index", "token": {id, text, logprob, special}, "generated_text",
                         "details", "top_tokens"}), the text and details on the last
  POST /                 either, as the body's `stream` says (a non-streamed answer is a
                         list of one, as TGI answers there)

TGI's parameters map onto the same generation requests as the OpenAI API's
(serving/http/openai_requests.py): max_new_tokens (100 by default, as TGI), do_sample
(greedy unless it or temperature / top_k / top_p / typical_p asks for sampling, as TGI
decides), typical_p (locally typical sampling: LangChain's TGI classes send 0.95), seed,
stop, repetition_penalty, frequency_penalty, top_n_tokens, details, return_full_text,
truncate (the prompt's last N tokens), grammar (`json` / `json_schema` / `regex`), and
vLLM's ignore_eos, which benchmarking tools add. best_of, as TGI takes it: sampled only, not
streamed, not with a seed, at most --max-streams; that many sequences are sampled and the one
with the highest log-probability per token answers, the others in the details'
`best_of_sequences`. An unseeded request is given a seed, which the details report (each
sequence reproducible with its own). decoder_input_details (not streamed, as TGI): the
details' `prefill` holds each prompt token's id, text and log-probability under the model
(the first's null), what evaluation harnesses read to score a continuation through TGI.
watermark and adapters are refused rather than ignored.

The same `POST /` body is what huggingface_hub's InferenceClient.summarization and
.translation send (Hugging Face's Inference API, transformers' pipelines): an encoder-
decoder's answer there also carries their keys, `summary_text` and `translation_text`, and
their parameters are read: `generate_parameters` (the names above), `truncation` (the source
cut to the model's length, special tokens kept, as transformers cuts it; "do_not_truncate"
refuses a longer one), `clean_up_tokenization_spaces`; `src_lang` / `tgt_lang` are refused.
Errors are TGI's `{"error", "error_type"}`, 422 for a request it cannot take. `GET /info` and
`POST /` are routed by serving/http/hf_routes.py (TEI's for an encoder artifact)."""

from __future__ import annotations

import secrets
import uuid
from functools import lru_cache

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

import serving
from serving.decoder import DecoderEngine
from serving.errors import ContextTooLong, InvalidArgument
from serving.http.codec import http_status_for
from serving.http.openai_requests import MAX_STOPS, body_value, generations_for, text_generator
from serving.http.streams import ChunkStream, ChunkStreams, until_disconnect
from serving.http.triton_generate import SSE_HEADERS, sse
from serving.sampling import Chunk, GenerationRequest, best_chunks, join_chunks
from serving.seq2seq import Seq2SeqEngine
from serving.tokenizer import cutting

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's
_REFUSED = {"watermark": False, "adapter_id": None}
_GRAMMARS = {"json": "guided_json", "json_schema": "guided_json", "regex": "guided_regex"}
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "seed": "seed", "stop": "stop",
                 "repetition_penalty": "repetition_penalty",
                 "frequency_penalty": "frequency_penalty", "top_k": "top_k", "top_p": "top_p",
                 "temperature": "temperature", "typical_p": "typical_p",
                 "ignore_eos": "ignore_eos"}  # vLLM's, as
# AIPerf sends it; other names TGI does not know are ignored, as TGI ignores them
# the keys of transformers' summarization and translation pipelines' answers (the Inference
# API's), which InferenceClient.summarization / .translation read from an encoder-decoder's
_TASK_KEYS = ("summary_text", "translation_text")
_CUTS = ("longest_first", "only_first", "only_second")  # the pipelines' `truncation` values


def error(exc: BaseException) -> Response:
    """TGI's error; its `error_type` is the exception huggingface_hub's InferenceClient
    raises (ValidationError, OverloadedError for a full server, GenerationError)."""
    status, message = http_status_for(exc)
    status = 422 if status == 400 else status  # TGI answers a request it refuses with 422
    kind = {422: "validation", 429: "overloaded"}.get(status, "generation")
    if isinstance(exc, ContextTooLong):  # TGI's words (LiteLLM reads them as an overflow)
        message = _too_long(exc)
    return JSONResponse({"error": message, "error_type": kind}, status)


def _too_long(e: ContextTooLong) -> str:
    if e.prompt_alone:
        return (f"Input validation error: `inputs` must have less than {e.prompt_limit + 1} "
                f"tokens. Given: {e.prompt_tokens}")
    return (f"Input validation error: `inputs` tokens + `max_new_tokens` must be <= "
            f"{e.context}. Given: {e.prompt_tokens} `inputs` tokens and {e.max_tokens} "
            "`max_new_tokens`")


def _engine(frontend) -> DecoderEngine:
    return text_generator(frontend.slot.find(frontend.slot.name), frontend.slot.name)


def _openai_body(parameters: dict) -> dict:
    """TGI's parameters under the OpenAI API's names (generations_for reads them)."""
    for name, default in _REFUSED.items():
        if parameters.get(name) not in (None, default):
            raise InvalidArgument(f"'{name}' is not supported")
    body = {_OPENAI_NAMES[k]: v for k, v in parameters.items() if k in _OPENAI_NAMES and
            v is not None}
    temperature = body_value(parameters, "temperature", (int, float))
    if temperature is not None and temperature <= 0:
        raise InvalidArgument("'temperature' must be strictly positive")
    sampled = body_value(parameters, "do_sample", (bool,), False) or any(
        k in body for k in ("temperature", "top_k", "top_p", "typical_p"))
    if not sampled:
        body["temperature"] = 0  # greedy: TGI samples only when asked to
    best = _best_of(parameters)
    if best > 1:
        if not sampled:
            raise InvalidArgument("you must use sampling when 'best_of' is > 1")
        if "seed" in body:
            raise InvalidArgument("'seed' must not be set when 'best_of' > 1")
        body["best_of"] = best
    # TGI draws the seed of a request that names none and reports it in the details
    body.setdefault("seed", secrets.randbits(63))
    grammar = body_value(parameters, "grammar", (dict,))
    if grammar is not None:
        if grammar.get("type") not in _GRAMMARS:
            raise InvalidArgument("'grammar' type must be json, json_schema or regex")
        value = grammar.get("value")
        if grammar["type"] == "json_schema" and isinstance(value, dict):
            value = value.get("schema", value)
        body[_GRAMMARS[grammar["type"]]] = value
    return body


def _best_of(parameters: dict) -> int:
    best = body_value(parameters, "best_of", (int,), 1)
    if best < 1:
        raise InvalidArgument(f"'best_of' must be at least 1, not {best}")
    return best


def _prefill_asked(parameters: dict) -> bool:
    return body_value(parameters, "decoder_input_details", (bool,), False)


def _pipeline_parameters(parameters: dict) -> tuple[dict, bool]:
    """The Inference API's summarization / translation parameters read: its
    generate_parameters among TGI's own (those named outside win), and whether `truncation`
    asks the source cut."""
    for name in ("src_lang", "tgt_lang"):
        if parameters.get(name) is not None:
            raise InvalidArgument(f"'{name}' is not supported: this server sets no language "
                                  "tokens (a one-pair translation model needs none)")
    generate = body_value(parameters, "generate_parameters", (dict,), {}) or {}
    unknown = sorted(set(generate) - set(_OPENAI_NAMES) - {"do_sample"})
    if unknown:
        raise InvalidArgument(f"'generate_parameters' {unknown} are not served (these are: "
                              f"{sorted([*_OPENAI_NAMES, 'do_sample'])})")
    truncation = parameters.get("truncation")
    if truncation not in (None, "do_not_truncate", *_CUTS):
        raise InvalidArgument(f"'truncation' must be one of do_not_truncate, "
                              f"{', '.join(_CUTS)}")
    return {**generate, **parameters}, truncation in _CUTS


@lru_cache(maxsize=4)
def _cutting_tokenizer(engine: DecoderEngine):
    return cutting(engine.tokenizer, engine.generator.max_prompt)


def _source_ids(engine: DecoderEngine, inputs: str, cut: bool) -> tuple[int, ...]:
    """The prompt's ids; with `cut`, no more than the model reads."""
    tokenizer = _cutting_tokenizer(engine) if cut else engine.tokenizer
    return tuple(tokenizer.encode(inputs).ids)


def _request(frontend, body: dict) -> tuple[DecoderEngine, list[GenerationRequest], dict, str]:
    """The engine, the generations a body asks for (best_of's candidates, else one), its
    parameters and its prompt."""
    engine = _engine(frontend)
    inputs = body.get("inputs")
    if not isinstance(inputs, str) or not inputs:
        raise InvalidArgument("'inputs' must be a non-empty string")
    parameters, cut = _pipeline_parameters(body_value(body, "parameters", (dict,), {}) or {})
    prompt = _source_ids(engine, inputs, cut)
    truncate = body_value(parameters, "truncate", (int,))
    if truncate is not None:
        if truncate < 1:
            raise InvalidArgument("'truncate' must be a positive integer")
        prompt = prompt[-truncate:]
    top = body_value(parameters, "top_n_tokens", (int,), 0) or 0
    # TGI's default, held to what the cache and --max-tokens leave room for (a number the
    # request names is refused when it does not fit, as TGI refuses it)
    room = engine.generator.room(len(prompt))
    default = max(1, min(DEFAULT_MAX_NEW_TOKENS, engine.options.max_tokens, room))
    generations = generations_for(engine, _openai_body(parameters), prompt, top,
                                  "tgi-" + uuid.uuid4().hex, default_max_tokens=default,
                                  echo=_prefill_asked(parameters))
    return engine, generations, parameters, inputs


def _token(engine: DecoderEngine, token: int, logprob: float) -> dict:
    """TGI's token object (the token's own text)."""
    return {"id": token, "text": engine.tokenizer.decode([token], skip_special_tokens=False),
            "logprob": float(logprob), "special": token in engine.text.eos_ids}


def _tokens(engine: DecoderEngine, chunk: Chunk) -> list[dict]:
    return [_token(engine, t, p)
            for t, p in zip(chunk.ids, chunk.logprobs or [0.0] * len(chunk.ids))]


def _top_tokens(engine: DecoderEngine, chunk: Chunk) -> list[list[dict]]:
    return [[_token(engine, t, p) for t, p in top] for top in chunk.top_logprobs or ()]


def _finish(chunk: Chunk) -> str:
    if chunk.reason == "length":
        return "length"
    return "stop_sequence" if chunk.stop is not None else "eos_token"


def _text(parameters: dict, prompt: str, generated: str) -> str:
    return prompt + generated if body_value(parameters, "return_full_text", (bool,),
                                            False) else generated


async def generate(frontend, request: Request) -> Response:
    answer = await _generated(frontend, await frontend.json(request), request)
    return answer if isinstance(answer, Response) else JSONResponse(answer)


async def _generated(frontend, body: dict, request: Request) -> dict | Response:
    engine, generations, parameters, inputs = _request(frontend, body)
    streams = ChunkStreams(engine, generations)
    chunks = await until_disconnect(request.receive, streams.collect(), streams.close)
    if chunks is None:
        return Response(status_code=499)
    for c in chunks:
        if c[-1].reason == "error":
            raise RuntimeError(c[-1].detail)
    wholes = [join_chunks(c) for c in chunks]
    (best,) = best_chunks(wholes, 1, len(wholes))
    at = next(k for k, w in enumerate(wholes) if w is best)

    def text(whole: Chunk) -> str:  # a stop sequence included, as TGI writes it
        return _text(parameters, inputs, engine.tokenizer.decode(whole.ids))

    if not body_value(parameters, "details", (bool,), False):
        return {"generated_text": text(best)}
    details = _details(engine, best, generations[at])
    if len(wholes) > 1:  # the others, in the order they were sampled, as TGI lists them
        details["best_of_sequences"] = [{"generated_text": text(w), **_details(engine, w, g)}
                                        for k, (w, g) in enumerate(zip(wholes, generations))
                                        if k != at]
    return {"generated_text": text(best), "details": details}


def _details(engine: DecoderEngine, whole: Chunk, generation: GenerationRequest) -> dict:
    """One sequence's details: why it ended, its tokens, its seed, its prompt's log-probs."""
    return {"finish_reason": _finish(whole), "generated_tokens": len(whole.ids),
            "seed": generation.sampling.seed, "prefill": _prefill(engine, generation, whole),
            "tokens": _tokens(engine, whole), "top_tokens": _top_tokens(engine, whole) or None}


def _prefill(engine: DecoderEngine, generation: GenerationRequest, whole: Chunk) -> list[dict]:
    """TGI's decoder_input_details: each prompt token with its log-probability given the
    tokens before it (the first has none: null, as TGI writes its NaN)."""
    if whole.prompt_logprobs is None:
        return []
    return [{"id": t, "text": engine.tokenizer.decode([t], skip_special_tokens=False),
             "logprob": None if k == 0 else float(whole.prompt_logprobs[k - 1])}
            for k, t in enumerate(generation.prompt)]


async def generate_stream(frontend, request: Request) -> Response:
    return _streamed(frontend, await frontend.json(request))


def _streamed(frontend, body: dict) -> Response:
    parameters = body_value(body, "parameters", (dict,), {}) or {}
    if _best_of(parameters) > 1:
        raise InvalidArgument("'best_of' != 1 is not supported when streaming tokens")
    if _prefill_asked(parameters):
        raise InvalidArgument("'decoder_input_details' == true is not supported when "
                              "streaming tokens")
    engine, (generation,), parameters, inputs = _request(frontend, body)
    stream = ChunkStream(engine, generation)  # refusals answer with a status here
    details = body_value(parameters, "details", (bool,), False)

    async def events():
        # each token's event goes out when the next one is known, so that the last one,
        # which carries the whole text (and the details), is the last token's own
        pending, ids = None, []
        async for chunk in stream:
            if chunk.reason == "error":
                yield sse({"error": chunk.detail or "generation failed",
                           "error_type": "generation"})
                return
            tops = _top_tokens(engine, chunk)
            for k, token in enumerate(_tokens(engine, chunk)):
                if pending is not None:
                    yield sse(pending)
                ids.append(token["id"])
                pending = {"index": len(ids), "token": token, "generated_text": None,
                           "details": None, "top_tokens": tops[k] if tops else None}
            if chunk.final and pending is not None:
                pending["generated_text"] = _text(parameters, inputs,
                                                  engine.tokenizer.decode(ids))
                if details:
                    pending["details"] = {"finish_reason": _finish(chunk),
                                          "generated_tokens": len(ids),
                                          "seed": generation.sampling.seed}
                yield sse(pending)

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def root(frontend, request: Request) -> Response:
    """TGI's `POST /`: the body's `stream` picks; a whole answer is a list of one."""
    body = await frontend.json(request)
    if body_value(body, "stream", (bool,), False):
        return _streamed(frontend, body)
    answer = await _generated(frontend, body, request)
    if isinstance(answer, Response):
        return answer
    if isinstance(_engine(frontend), Seq2SeqEngine):  # the Inference API's task keys too
        answer = {**answer, **{key: answer["generated_text"] for key in _TASK_KEYS}}
    return JSONResponse([answer])


def info(frontend, engine: DecoderEngine) -> dict:
    """TGI's `GET /info` for a decoder artifact: the limits a request meets here."""
    generator = engine.generator
    return {"model_id": frontend.slot.name, "model_sha": None,
            "model_pipeline_tag": "text-generation",
            "max_concurrent_requests": engine.options.max_streams + engine.options.max_queue,
            "max_best_of": engine.options.max_streams, "max_stop_sequences": MAX_STOPS,
            "max_input_tokens": generator.max_prompt,
            "max_total_tokens": generator.max_cache_len, "validation_workers": 1,
            "max_client_batch_size": 1, "router": "text-generation-router",
            "version": serving.__version__, "sha": None, "docker_label": None}


ROUTES = [("/generate", ["POST"], "tgi/generate", generate, error),
          ("/generate_stream", ["POST"], "tgi/generate_stream", generate_stream, error)]
