"""What an LLM client sends a decoder and gets back, in the names Triton's LLM backends use,
so that a client written for either works unchanged (every input optional):

- TensorRT-LLM's ensemble: `text_input`, `max_tokens`, `stream`, `exclude_input_in_output`,
  `min_length`, `end_id`, `pad_id`, `random_seed`, `temperature`, `top_k`, `top_p`
  (`runtime_top_k`, `runtime_top_p` as its core model names them), `repetition_penalty`,
  `presence_penalty`, `frequency_penalty`,
  `stop_words`, `bad_words`, `guided_decoding_guide_type` / `guided_decoding_guide` (json,
  json_schema, regex, ebnf_grammar), `return_log_probs`, `beam_width`,
  `embedding_bias_words` / `_weights`, `num_return_sequences` and beam search's own controls
  (serving/trtllm_core.py); outputs `text_output`, `output_ids`, `sequence_length`,
  `output_log_probs`, `cum_log_probs`. Sampling controls sent as tensors (its names or
  ours) follow its rule: greedy unless a top-k or top-p above 0.
- the vLLM backend: `text_input`, `stream`, `exclude_input_in_output`, `sampling_parameters`
  (a JSON object whose values may be strings or numbers, and `structured_outputs` /
  `guided_decoding` an object as vLLM's; its keys may also come as request
  parameters, which the vLLM backend reads when no `sampling_parameters` tensor comes),
  `return_num_input_tokens`, `return_num_output_tokens`, `return_finish_reason`,
  `return_cumulative_logprob` and `return_logprobs`, each output sent only when asked:
  `num_input_tokens`, `num_output_tokens`, `finish_reason`, `cumulative_logprob`, and
  `logprobs` (per token a JSON object of the sampled id and the `logprobs` most likely, each
  with its log-prob, rank and text, as vLLM's Logprob).
- both: a text prompt whose client turned `stream` off gets the prompt first unless
  `exclude_input_in_output` says otherwise (their default).
- TensorRT-LLM's core model (`tensorrt_llm`): `input_ids` with `request_output_len`, and
  its own names (serving/trtllm_core.py reads them).
- this server's own: `input_ids`, `seed`, `stop_ids`.

Integer controls take any integer width. A name no convention knows is INVALID_ARGUMENT
naming it. No grpc here: tensors come in as numpy arrays (the responses: serving/replies.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from serving import trtllm_core
from serving.errors import InvalidArgument
from serving.model import Signature, TensorSpec
from serving.sampling import (MAX_TOP_LOGPROBS, GenerationRequest, Grammar, Sampling,
                              allowed_ids)

# name -> (python kind, the field of _Controls it sets); TensorRT-LLM names beside ours
_CONTROLS: dict[str, tuple[type, str]] = {
    "max_tokens": (int, "max_tokens"), "min_length": (int, "min_tokens"),
    "temperature": (float, "temperature"),
    "top_k": (int, "top_k"), "runtime_top_k": (int, "top_k"),
    "top_p": (float, "top_p"), "runtime_top_p": (float, "top_p"),
    "seed": (int, "seed"), "random_seed": (int, "seed"),
    "repetition_penalty": (float, "repetition_penalty"),
    "presence_penalty": (float, "presence_penalty"),
    "frequency_penalty": (float, "frequency_penalty"),
    "end_id": (int, "end_id"), "pad_id": (int, "pad_id"), "beam_width": (int, "beam_width"),
    "stream": (bool, "stream"), "exclude_input_in_output": (bool, "exclude_input"),
    "request_output_len": (int, "max_tokens"), "streaming": (bool, "stream"),  # core model's
    "return_log_probs": (bool, "logprobs"),
    "return_num_input_tokens": (bool, "num_input_tokens"),
    "return_num_output_tokens": (bool, "num_output_tokens"),
    "return_finish_reason": (bool, "want_finish_reason"),
    "return_cumulative_logprob": (bool, "want_cumulative_logprob"),
    "return_logprobs": (bool, "want_logprobs"),
}
# outputs each sent only when its return_* input is true, as both backends send them: the
# token counts, and the vLLM backend's additional outputs
COUNTS = ("num_input_tokens", "num_output_tokens")
VLLM_OUTPUTS = ("finish_reason", "cumulative_logprob", "logprobs")
_TEXTS = ("input_ids", "text_input", "stop_ids", "stop_words", "bad_words",
          "sampling_parameters", "guided_decoding_guide_type", "guided_decoding_guide")
# TensorRT-LLM's guided decoding: guide type -> the Grammar kind its guide is read as
_GUIDES = {"json": "json", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
KNOWN_INPUTS = frozenset(_CONTROLS) | frozenset(_TEXTS) | trtllm_core.INPUTS

# the vLLM backend's sampling_parameters keys -> (kind, field)
_VLLM = {"max_tokens": (int, "max_tokens"), "min_tokens": (int, "min_tokens"),
         "temperature": (float, "temperature"), "top_p": (float, "top_p"),
         "top_k": (int, "top_k"), "min_p": (float, "min_p"), "seed": (int, "seed"),
         "ignore_eos": (bool, "ignore_eos"),
         "logprobs": (int, "vllm_logprobs"),
         "repetition_penalty": (float, "repetition_penalty"),
         "presence_penalty": (float, "presence_penalty"),
         "frequency_penalty": (float, "frequency_penalty"),
         "include_stop_str_in_output": (bool, "include_stop"),
         "n": (int, "samples")}  # (serving/samples.py)
_VLLM_LISTS = ("bad_words", "stop", "stop_token_ids", "allowed_token_ids")  # each a list
_PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # both names
_SAMPLING_TENSORS = ("temperature", "runtime_top_k", "runtime_top_p", "top_k", "top_p")


def client_signature(tokenizer: bool) -> Signature:
    """The tensors a client may send and gets back. Every input is optional (ModelConfig
    says so); the datatypes are what the two Triton backends declare, which is what
    perf_analyzer and genai-perf build their tensors from."""
    i, b, f, u, s = "INT32", "BOOL", "FP32", "UINT64", "BYTES"
    inputs = [TensorSpec("input_ids", "INT64", (1, -1))]
    if tokenizer:
        inputs += [TensorSpec("text_input", s, (1,)), TensorSpec("stop_words", s, (-1,)),
                   TensorSpec("bad_words", s, (-1,)), TensorSpec("sampling_parameters", s, (1,)),
                   TensorSpec("guided_decoding_guide_type", s, (1,)),
                   TensorSpec("guided_decoding_guide", s, (1,))]
    inputs += [TensorSpec(n, t, (1,)) for n, t in (
        ("max_tokens", i), ("min_length", i), ("stream", b), ("exclude_input_in_output", b),
        ("end_id", i), ("pad_id", i), ("beam_width", i), ("temperature", f),
        ("runtime_top_k", i), ("runtime_top_p", f), ("random_seed", u),
        ("repetition_penalty", f), ("presence_penalty", f), ("frequency_penalty", f), ("top_k", i),
        ("top_p", f), ("seed", u), ("return_log_probs", b), ("return_num_input_tokens", b),
        ("return_num_output_tokens", b), ("return_finish_reason", b),
        ("return_cumulative_logprob", b), ("return_logprobs", b))]
    inputs.append(TensorSpec("stop_ids", "INT64", (-1,)))
    inputs += trtllm_core.input_specs(tokenizer)
    # (a row per beam: one, or a search's k at its end; the vLLM names' a row per sample)
    outputs = [TensorSpec("output_ids", "INT64", (-1, -1)),
               TensorSpec("sequence_length", i, (-1,)),
               TensorSpec("output_log_probs", f, (-1,)), TensorSpec("cum_log_probs", f, (-1,)),
               TensorSpec("num_input_tokens", "UINT32", (1,)),
               TensorSpec("num_output_tokens", "UINT32", (-1,)),
               TensorSpec("finish_reason", s, (-1,)), TensorSpec("cumulative_logprob", f, (-1,)),
               TensorSpec("logprobs", s, (-1,)), TensorSpec("batch_index", i, (1, 1))]
    if tokenizer:  # first, as both backends declare it: clients read outputs[0] as the text
        outputs.insert(0, TensorSpec("text_output", s, (-1,)))
    return Signature(tuple(inputs), tuple(outputs), "input_ids", None)


@dataclass(frozen=True)
class ClientRequest:
    """A parsed request: what to generate, and how the client wants the answer."""

    generation: GenerationRequest
    stream: bool = True
    prompt_text: str | None = None  # sent first when the client set exclude_input_in_output false
    extras: frozenset[str] = frozenset()  # of VLLM_OUTPUTS and COUNTS: what was asked for
    # the request's `outputs` (KServe v2): only these, in this order; empty: all
    outputs: tuple[str, ...] = ()
    # TensorRT-LLM's core model (serving/trtllm_core.py): its outputs' shapes, and, not
    # streamed, output_ids that start with the prompt's (unless exclude_input_in_output)
    core: bool = False
    prompt_ids_first: bool = False
    batch_index: int | None = None  # its row in a batch of prompts (None: not a batch)
    pad: int = 0  # what fills a search's shorter beams in output_ids: pad_id, else end_id
    transcripts: bool = False  # Triton's TensorRT-LLM Whisper names (serving/whisper_names.py):
    # every response carries the whole text so far as TRANSCRIPTS, and nothing else
    samples: int = 1  # the vLLM backend's n: streams of this prompt (serving/samples.py)


def _one(name: str, value):
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise InvalidArgument(f"input '{name}' must hold one value, not {value.size}")
        value = value.reshape(-1)[0]
        value = value.item() if isinstance(value, np.generic) else value
    return value


def _scalar(name: str, value, kind: type, strings: bool = False):
    """One control's value; `strings`: numbers and booleans may come as strings (the vLLM
    backend's JSON)."""
    value = _one(name, value)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if strings and isinstance(value, str):
        text = value.strip().lower()
        if kind is bool and text in ("true", "false"):
            return text == "true"
        try:
            value = float(text) if kind is float else int(text) if kind is int else value
        except ValueError:
            raise InvalidArgument(f"'{name}' must be a{'n integer' if kind is int else ' number'}"
                                  f", not {value!r}") from None
    if kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidArgument(f"'{name}' must be a BOOL")
        return bool(value)
    if isinstance(value, (bool, str)) or (kind is int and isinstance(value, float)):
        raise InvalidArgument(f"'{name}' must be a{'n integer' if kind is int else ' number'}")
    return kind(value)


def _strings(name: str, array) -> list[str]:
    items = array.reshape(-1).tolist() if isinstance(array, np.ndarray) else list(array)
    try:
        return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in items]
    except UnicodeDecodeError:
        raise InvalidArgument(f"'{name}' is not valid UTF-8") from None


def _list(name: str, value) -> list:
    if not isinstance(value, list):
        raise InvalidArgument(f"sampling parameter '{name}' must be a list")
    return value


def _vllm(raw, values: dict, stops: list[str], bad: list[str]) -> None:
    """The vLLM backend's `sampling_parameters` JSON, into `values`, `stops` and `bad`."""
    text = _strings("sampling_parameters", raw)
    if len(text) != 1:
        raise InvalidArgument("'sampling_parameters' must hold one JSON string")
    try:
        given = json.loads(text[0])
    except ValueError as e:
        raise InvalidArgument(f"'sampling_parameters' is not JSON: {e}") from None
    if not isinstance(given, dict):
        raise InvalidArgument("'sampling_parameters' must be a JSON object")
    for key, value in given.items():
        if key in ("stop", "bad_words"):
            (stops if key == "stop" else bad).extend(
                [value] if isinstance(value, str) else _strings(key, value))
        elif key in ("structured_outputs", "guided_decoding"):
            values["grammar"] = Grammar.from_vllm(value)
        elif key in ("stop_token_ids", "allowed_token_ids"):
            values[key] = [int(_scalar(key, v, int, True)) for v in _list(key, value)]
        elif key in _VLLM:
            kind, target = _VLLM[key]
            values[target] = _scalar(key, value, kind, strings=True)
        else:
            raise InvalidArgument(f"sampling parameter '{key}' is not supported; this server "
                                  f"takes {sorted(_VLLM) + list(_VLLM_LISTS)} and "
                                  "structured_outputs (guided_decoding)")
    if values.get("top_k") == -1:  # vLLM's "no cut"
        values["top_k"] = 0


def parse_request(tensors: Mapping[str, np.ndarray], parameters: Mapping[str, object],
                  tokenizer=None, default_max_tokens: int = 16, request_id: str = "",
                  eos_ids: Sequence[int] = (), max_beams: int = 1) -> ClientRequest:
    """A ClientRequest from decoded request tensors and request parameters (a tensor wins
    over `sampling_parameters`, which wins over a request parameter of the same name).
    `eos_ids`: the model's end tokens, which the vLLM convention stops at unless
    `ignore_eos`; `max_beams`: the widest `beam_width` the engine searches. InvalidArgument,
    saying what is wrong, for anything else."""
    for name in tensors:
        if name not in KNOWN_INPUTS:
            raise InvalidArgument(f"unexpected input '{name}'; a decoder takes "
                                  f"{sorted(KNOWN_INPUTS)}")
    values = {_VLLM[k][1]: _scalar(k, v, _VLLM[k][0], strings=True)
              for k, v in parameters.items() if k in _VLLM and k not in _CONTROLS}
    # request parameters may come as strings (the vLLM backend's own test client sends
    # "temperature": "0" both in sampling_parameters and as parameters)
    values.update({_CONTROLS[k][1]: _scalar(k, v, _CONTROLS[k][0], strings=True)
                   for k, v in parameters.items() if k in _CONTROLS})
    stops: list[str] = []
    bad: list[str] = []  # the vLLM backend's bad words
    vllm = "sampling_parameters" in tensors
    if vllm:
        _vllm(tensors["sampling_parameters"], values, stops, bad)
    values.update({_CONTROLS[k][1]: _scalar(k, v, _CONTROLS[k][0]) for k, v in tensors.items()
                   if k in _CONTROLS})
    beams = values.get("beam_width")
    if beams is not None and not 1 <= beams <= max_beams:
        raise InvalidArgument(f"beam_width {beams} is not supported: "
                              + ("only 1" if max_beams == 1 else f"1 to {max_beams}"))
    if "stop_words" in tensors:
        stops += [w for w in _strings("stop_words", tensors["stop_words"]) if w]
    trtllm_bad = _strings("bad_words", tensors["bad_words"]) if "bad_words" in tensors else []
    bad_words = bad_word_ids(tokenizer, trtllm_bad) + bad_word_ids(tokenizer, bad, vllm=True)
    trtllm_core.refuse_unsupported(tensors, beams or 1)
    core = trtllm_core.read(tensors) if trtllm_core.is_core(tensors) else None
    prompt = core.prompt if core else _prompt(tensors, tokenizer)
    # sampling asked for in tensors (TensorRT-LLM's names, or ours) follows TensorRT-LLM's
    # rule: its clients send temperature 1 and expect greedy; vLLM's JSON keeps vLLM's
    if core or (not vllm and any(n in tensors for n in _SAMPLING_TENSORS)):
        values = trtllm_core.sampling_rule(values)
    stop_ids = set(values.get("stop_token_ids", ())) | _stop_ids(tensors, parameters)
    if "end_id" in values:
        stop_ids.add(values["end_id"])
    if vllm and not values.get("ignore_eos", False):
        stop_ids |= set(eos_ids)
    if stops and tokenizer is None:
        raise InvalidArgument("stop strings need a tokenizer (no tokenizer.json in this "
                              "artifact): send stop token ids instead")
    sampling = Sampling(values.get("temperature", 0.0), values.get("top_k", 0),
                        values.get("top_p", 1.0), values.get("seed"),
                        min_p=values.get("min_p", 0.0),
                        allowed_ids=allowed_ids(values.get("allowed_token_ids")),
                        logit_bias=trtllm_core.logit_bias(core, tensors, tokenizer),
                        **{k: values[k] for k in _PENALTIES if k in values})
    extras = frozenset([name for name in VLLM_OUTPUTS if values.get("want_" + name)]
                       + [name for name in COUNTS if values.get(name)])
    top = _vllm_logprobs(values) if "logprobs" in extras else None  # None: "null"
    generation = GenerationRequest(
        prompt, values.get("max_tokens", default_max_tokens), sampling, frozenset(stop_ids),
        request_id, min_tokens=values.get("min_tokens", 0), stop_strings=tuple(stops),
        include_stop=values.get("include_stop", False),
        logprobs=values.get("logprobs", False) or "cumulative_logprob" in extras
        or top is not None, top_logprobs=top or 0, ranks=top is not None,
        bad_words=bad_words + (core.bad_words if core else ()),
        grammar=_trtllm_guide(tensors) or values.get("grammar"),
        stop_sequences=core.stop_sequences if core else (), beams=beams,
        **trtllm_core.search_settings(tensors, beams or 1))
    pad = values.get("pad_id", values.get("end_id", 0))
    if core:  # not streamed unless asked, as there; output_ids carry the prompt's ids first
        stream = values.get("stream", False)
        return ClientRequest(generation, stream, extras=extras, core=True,
                             prompt_ids_first=not stream and not values.get("exclude_input"),
                             pad=pad)
    # the prompt text first: when asked, or, as both Triton LLM backends do, when the client
    # turned streaming off for a text prompt and did not say (their default prepends it)
    text_prompt_whole = values.get("stream") is False and "text_input" in tensors
    echo = tokenizer is not None and not values.get("exclude_input", not text_prompt_whole)
    return ClientRequest(generation, values.get("stream", True),
                         _text_of(tensors, prompt, tokenizer) if echo else None, extras, pad=pad,
                         samples=values.get("samples", 1))


def _trtllm_guide(tensors: Mapping[str, np.ndarray]) -> Grammar | None:
    """TensorRT-LLM's guided decoding: `guided_decoding_guide_type` (json: any JSON value;
    json_schema, regex, ebnf_grammar: the `guided_decoding_guide`)."""
    if "guided_decoding_guide_type" not in tensors:
        if "guided_decoding_guide" in tensors:
            raise InvalidArgument("'guided_decoding_guide' needs 'guided_decoding_guide_type'")
        return None
    kind = _strings("guided_decoding_guide_type", tensors["guided_decoding_guide_type"])
    if len(kind) != 1 or kind[0] not in _GUIDES:
        raise InvalidArgument(f"'guided_decoding_guide_type' must be one of {list(_GUIDES)}, "
                              f"not {kind}")
    if kind[0] == "json":
        return Grammar.of("json", {})
    guide = _strings("guided_decoding_guide", tensors.get("guided_decoding_guide", []))
    if len(guide) != 1:
        raise InvalidArgument(f"guide type {kind[0]!r} needs one 'guided_decoding_guide'")
    return Grammar.of(_GUIDES[kind[0]], guide[0])


def _vllm_logprobs(values: dict) -> int | None:
    """vLLM's `logprobs`: how many of the most likely ids each token lists besides itself
    (None: the listing is "null", as vLLM sends when it was not set)."""
    k = values.get("vllm_logprobs")
    if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"sampling parameter 'logprobs' must be between 0 and "
                              f"{MAX_TOP_LOGPROBS}, not {k}")
    return k


def bad_word_ids(tokenizer, words: Sequence[str], vllm: bool = False
                 ) -> tuple[tuple[int, ...], ...]:
    """Each bad word as the tokens the tokenizer makes of it (no special tokens), as
    TensorRT-LLM's preprocessing makes them, an empty word skipped as there. `vllm`: as the
    vLLM backend, the word without leading spaces, and also after one space where that is
    other tokens of the same count (so it is banned inside a text too)."""
    words = [w for w in words if w]
    if words and tokenizer is None:
        raise InvalidArgument("bad words need a tokenizer (no tokenizer.json in this "
                              "artifact)")
    out = []
    for word in words:
        ids = _tokens(tokenizer, word.lstrip() if vllm else word)
        if not ids:
            raise InvalidArgument(f"bad word {word!r} makes no tokens")
        out.append(ids)
        spaced = _tokens(tokenizer, " " + word.lstrip()) if vllm else ()
        if spaced and spaced[0] != ids[0] and len(spaced) == len(ids):
            out.append(spaced)
    return tuple(out)


def _tokens(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, add_special_tokens=False).ids)


def _stop_ids(tensors: Mapping[str, np.ndarray], parameters: Mapping[str, object]) -> set[int]:
    if "stop_ids" in tensors:
        ids = np.asarray(tensors["stop_ids"])
        if ids.dtype.kind not in "iu":
            raise InvalidArgument(f"'stop_ids' must be integers, not {ids.dtype}")
        return {int(x) for x in ids.reshape(-1)}
    if "stop_ids" in parameters:  # a string parameter: "2, 13"
        try:
            return {int(x) for x in str(parameters["stop_ids"]).replace(",", " ").split()}
        except ValueError:
            raise InvalidArgument("parameter 'stop_ids' must be token ids separated by commas "
                                  f"or spaces, not {parameters['stop_ids']!r}") from None
    return set()


def _prompt(tensors: Mapping[str, np.ndarray], tokenizer) -> tuple[int, ...]:
    if ("input_ids" in tensors) == ("text_input" in tensors):
        raise InvalidArgument("send the prompt as exactly one of 'input_ids' (integers [1, n] "
                              "or [n]) or 'text_input' (BYTES [1])")
    if "input_ids" in tensors:
        ids = np.asarray(tensors["input_ids"])
        if ids.dtype.kind not in "iu" or not (ids.ndim == 1 or (ids.ndim == 2
                                                                and ids.shape[0] == 1)):
            raise InvalidArgument(f"'input_ids' must be integers [1, n] or [n], not {ids.dtype} "
                                  f"{list(ids.shape)}")
        return tuple(int(x) for x in ids.reshape(-1))
    if tokenizer is None:
        raise InvalidArgument("this model has no tokenizer (no tokenizer.json in its "
                              "artifact): send 'input_ids'")
    text = _strings("text_input", tensors["text_input"])
    if len(text) != 1:
        raise InvalidArgument(f"'text_input' must hold one string, not {len(text)}")
    return tuple(tokenizer.encode(text[0]).ids)


def _text_of(tensors, prompt: tuple[int, ...], tokenizer) -> str:
    if "text_input" in tensors:
        return _strings("text_input", tensors["text_input"])[0]
    return tokenizer.decode(list(prompt), skip_special_tokens=False)
