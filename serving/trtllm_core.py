"""TensorRT-LLM's request names beyond those serving/conventions.py reads: its core model's
(`tensorrt_llm`, the model inside its ensemble, for clients written against it directly:
its example streaming client, its core-model benchmark, perf_analyzer fed token ids), and
what its ensemble shares with it. A request is a core one when it carries
`request_output_len` (the core model requires it); conventions.py reads the names both
share (`end_id`, `temperature`, `runtime_top_k`, `min_length`, `return_log_probs`, ...) and
`streaming` / `request_output_len`; this module the rest:

- `input_ids` [1, n] cut to `input_lengths` [1, 1];
- `stop_words_list` / `bad_words_list` [1, 2, n]: token sequences as TensorRT-LLM packs
  them (row 0 every word's ids one after another, row 1 where each word ends, then -1s);
- `embedding_bias` [1, vocab]: added to the logits (OpenAI's logit_bias, dense; the
  ensemble's `embedding_bias_words` / `embedding_bias_weights` are read here too);
- `stop` true: cancel the running request with this request's id (the servers answer it
  with one empty final response);
- a batch of prompts in one request (`rows`; the ensemble's too): each its own generation,
  each response with its `batch_index`, on a stream;
- greedy unless a top-k or top-p is given, whatever the temperature (`sampling_rule`);
- beam search's own controls (`len_penalty`, the ensemble's `length_penalty`,
  `early_stopping`, `beam_search_diversity_rate`) are taken and change nothing at beam
  width 1, as there; above it the length penalty and early stopping are the search's
  (`search_settings`), and a diversity rate other than 0 is refused by name;
- a beam search answers with every beam, best first, unless `num_return_sequences` asks
  for fewer; without a search more than one sequence is refused, as are top-p decay and
  context / generation logits (in the ensemble's requests too).

And how it answers (serving/replies.py writes it): `output_ids` INT32 [1, 1, n] (streaming:
the new tokens; otherwise the prompt's ids first unless `exclude_input_in_output`),
`sequence_length` INT32 [1, 1] = n, and with `return_log_probs` `output_log_probs` [1, 1, k]
and `cum_log_probs` [1, 1]; a search's k beams as [1, k, n] in one response at its end
(each beam's own length in `sequence_length` [1, k], the rest padded with the end id)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from serving.errors import InvalidArgument
from serving.model import TensorSpec

WORD_LISTS = ("stop_words_list", "bad_words_list")
# names only the core model has (request_output_len and streaming: conventions._CONTROLS)
CORE_ONLY = frozenset(("input_lengths", "stop", "embedding_bias", *WORD_LISTS))
# (len_penalty the core model's name, length_penalty the ensemble's)
BEAM_ONLY = ("len_penalty", "length_penalty", "early_stopping", "beam_search_diversity_rate")
# refused unless they ask for nothing: name -> the value that leaves them off
_OFF = {"runtime_top_p_decay": 1.0, "return_context_logits": False,
        "return_generation_logits": False}
# what a beam search does not do (transformers' diverse beam search is another search)
_SEARCH_OFF = {"beam_search_diversity_rate": 0.0}
_TOP_P_DECAY = ("runtime_top_p_min", "runtime_top_p_reset_ids")  # only read with a decay
BIAS_WORDS = ("embedding_bias_words", "embedding_bias_weights")  # the ensemble's bias
# TensorRT-LLM's names that its ensemble and its core model both take
SHARED = frozenset((*BEAM_ONLY, *_OFF, *_TOP_P_DECAY, *BIAS_WORDS, "num_return_sequences"))
INPUTS = CORE_ONLY | SHARED


def input_specs(tokenizer: bool) -> list[TensorSpec]:
    """The inputs ModelConfig declares for these names (datatypes as TensorRT-LLM's); the
    bias words only with a tokenizer."""
    i, b, f = "INT32", "BOOL", "FP32"
    specs = [TensorSpec("embedding_bias_words", "BYTES", (-1,)),
             TensorSpec("embedding_bias_weights", f, (-1,))] if tokenizer else []
    return specs + [TensorSpec(n, t, shape) for n, t, shape in (
        ("input_lengths", i, (1,)), ("request_output_len", i, (1,)), ("streaming", b, (1,)),
        ("stop", b, (1,)), ("stop_words_list", i, (1, 2, -1)), ("bad_words_list", i, (1, 2, -1)),
        ("embedding_bias", f, (1, -1)), ("len_penalty", f, (1,)), ("length_penalty", f, (1,)),
        ("early_stopping", b, (1,)),
        ("beam_search_diversity_rate", f, (1,)), ("runtime_top_p_min", f, (1,)),
        ("runtime_top_p_decay", f, (1,)), ("runtime_top_p_reset_ids", i, (1,)),
        ("return_context_logits", b, (1,)), ("return_generation_logits", b, (1,)),
        ("num_return_sequences", i, (1,)))]


@dataclass(frozen=True)
class CoreInputs:
    """What the core model's own inputs ask for, beyond the names it shares."""

    prompt: tuple[int, ...]
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()


def is_core(tensors: Mapping[str, np.ndarray]) -> bool:
    """Whether the request is written for the core model; InvalidArgument for one of its
    names without the `request_output_len` it requires."""
    if "request_output_len" in tensors:
        return True
    own = sorted(n for n in tensors if n in CORE_ONLY or n == "streaming")
    if own:
        raise InvalidArgument(f"'{own[0]}' is TensorRT-LLM's core model input: such a request "
                              "needs 'request_output_len' (a value is required for it there)")
    return False


def rows(tensors: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """A request of B prompts as B requests of one, as TensorRT-LLM's ensemble and core model
    take a batch (`text_input` [B, 1] or `input_ids` [B, n]; every other input [B, ...], one
    row each, or [1, ...], the same for all; a 1-D input, which has no batch axis, is the
    same for all); any other request as itself."""
    prompt = tensors.get("text_input", tensors.get("input_ids"))
    shape = np.shape(prompt) if prompt is not None else ()
    if len(shape) != 2 or shape[0] < 2:
        return [dict(tensors)]
    b = shape[0]
    batched = {name for name, array in tensors.items() if np.ndim(array) >= 2}
    for name in sorted(batched):
        if np.shape(tensors[name])[0] not in (1, b):
            raise InvalidArgument(f"'{name}' has {np.shape(tensors[name])[0]} rows for a batch "
                                  f"of {b} prompts: send [{b}, ...] (one row each) or "
                                  "[1, ...] (the same for all)")
    return [{name: np.asarray(array)[i:i + 1] if name in batched and np.shape(array)[0] == b
             else np.asarray(array) for name, array in tensors.items()} for i in range(b)]


def asks_to_stop(tensors: Mapping[str, np.ndarray]) -> bool:
    """A `stop` request: cancel the request with the same id (nothing else is read)."""
    stop = tensors.get("stop")
    return stop is not None and np.asarray(stop).size == 1 and bool(np.asarray(stop).item())


def refuse_unsupported(tensors: Mapping[str, np.ndarray], beams: int = 1) -> None:
    """InvalidArgument, naming it, for a TensorRT-LLM input (ensemble or core) that asks for
    what this server does not do (at a `beams` width above 1, a diverse search too, rather
    than ignored)."""
    off = {**_OFF, **(_SEARCH_OFF if beams > 1 else {})}
    for name, value in off.items():
        if name in tensors and _value(name, tensors[name]) != value:
            raise InvalidArgument(f"'{name}' {_value(name, tensors[name])} is not supported "
                                  f"(only {value})")
    asked = _returns(tensors)
    if asked is not None and not 1 <= asked <= beams:
        raise InvalidArgument(f"'num_return_sequences' {asked} is not supported: "
                              + ("only 1 without a beam search" if beams == 1 else
                                 f"1 to the beam width ({beams})"))


def _returns(tensors: Mapping[str, np.ndarray]) -> int | None:
    if "num_return_sequences" not in tensors:
        return None
    return int(_value("num_return_sequences", _integers("num_return_sequences",
                                                        tensors["num_return_sequences"])))


def search_settings(tensors: Mapping[str, np.ndarray], beams: int = 1) -> dict:
    """A beam search's length penalty and early stopping, where the request names them,
    and how many beams come back: `num_return_sequences`, else every one, as TensorRT-LLM
    answers (serving.sampling.GenerationRequest's fields; nothing changes at width 1)."""
    out: dict = {"returns": _returns(tensors) or beams}
    for name in ("len_penalty", "length_penalty"):
        if name in tensors:
            out["length_penalty"] = float(_value(name, tensors[name]))
    if "early_stopping" in tensors:
        out["early_stopping"] = bool(_value("early_stopping", tensors["early_stopping"]))
    return out


def read(tensors: Mapping[str, np.ndarray]) -> CoreInputs:
    """The core model's own inputs; InvalidArgument, naming the input, for what it cannot
    take."""
    return CoreInputs(_prompt(tensors), _words(tensors, "stop_words_list"),
                      _words(tensors, "bad_words_list"), _bias(tensors))


def bias_of_words(tensors: Mapping[str, np.ndarray], tokenizer) -> dict[int, float]:
    """The ensemble's `embedding_bias_words` (BYTES [-1]) with `embedding_bias_weights`
    (FP32 [-1]): each token of each word (its own tokens, no special ones) gets its word's
    weight added, as TensorRT-LLM's preprocessing adds them."""
    if not any(n in tensors for n in BIAS_WORDS):
        return {}
    if not all(n in tensors for n in BIAS_WORDS):
        raise InvalidArgument("'embedding_bias_words' and 'embedding_bias_weights' come "
                              "together")
    words = [w.decode("utf-8", "replace") if isinstance(w, bytes) else str(w)
             for w in np.asarray(tensors["embedding_bias_words"]).reshape(-1).tolist()]
    weights = np.asarray(tensors["embedding_bias_weights"]).reshape(-1)
    if weights.dtype.kind != "f" or len(weights) != len(words) or not np.isfinite(weights).all():
        raise InvalidArgument(f"'embedding_bias_weights' must be {len(words)} finite floats, "
                              "one per word")
    if tokenizer is None:
        raise InvalidArgument("embedding bias words need a tokenizer (no tokenizer.json in "
                              "this artifact)")
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights.tolist()):
        for token in tokenizer.encode(word, add_special_tokens=False).ids:
            bias[token] = bias.get(token, 0.0) + weight
    return bias


def sampling_rule(values: dict) -> dict:
    """TensorRT-LLM's rule for its sampling controls, ensemble and core model alike
    (`values`: conventions' fields): greedy unless a top-k above 0 or a top-p above 0 is
    given, whatever the temperature (its decoder falls back to top-k 1 when both are 0, their
    defaults), and then at temperature 1 unless given."""
    values = dict(values)
    if values.get("top_p") == 0:
        del values["top_p"]  # its "unset"
    temperature = values.get("temperature", 0.0)
    if values.get("top_k", 0) == 0 and "top_p" not in values and temperature >= 0:
        values["temperature"] = 0.0  # (a bad value is left for Sampling to refuse)
    else:
        values.setdefault("temperature", 1.0)
    return values


def _value(name: str, array) -> object:
    array = np.asarray(array)
    if array.size != 1:
        raise InvalidArgument(f"input '{name}' must hold one value, not {array.size}")
    return array.reshape(-1)[0].item()


def _integers(name: str, array) -> np.ndarray:
    array = np.asarray(array)
    if array.dtype.kind not in "iu":
        raise InvalidArgument(f"'{name}' must be integers, not {array.dtype}")
    return array


def _prompt(tensors: Mapping[str, np.ndarray]) -> tuple[int, ...]:
    if "input_ids" not in tensors or "text_input" in tensors:
        raise InvalidArgument("TensorRT-LLM's core model takes its prompt as 'input_ids' "
                              "(integers [1, n]), not 'text_input'")
    ids = _integers("input_ids", tensors["input_ids"])
    if not (ids.ndim == 1 or (ids.ndim == 2 and ids.shape[0] == 1)):
        raise InvalidArgument(f"'input_ids' must be [1, n] (one request, one prompt), not "
                              f"{list(ids.shape)}")
    ids = ids.reshape(-1)
    if "input_lengths" in tensors:
        n = _value("input_lengths", _integers("input_lengths", tensors["input_lengths"]))
        if not 0 < n <= ids.size:
            raise InvalidArgument(f"'input_lengths' {n} must be between 1 and the "
                                  f"{ids.size} ids of 'input_ids'")
        ids = ids[:n]
    return tuple(int(x) for x in ids)


def _words(tensors: Mapping[str, np.ndarray], name: str) -> tuple[tuple[int, ...], ...]:
    """A packed word list [1, 2, n] (or [2, n]) as token sequences: row 0 the ids, row 1
    each word's end offset into them, -1 where the offsets run out."""
    if name not in tensors:
        return ()
    packed = _integers(name, tensors[name])
    if packed.size == 0:
        return ()
    if packed.ndim == 3 and packed.shape[0] == 1:
        packed = packed[0]
    if packed.ndim != 2 or packed.shape[0] != 2:
        raise InvalidArgument(f"'{name}' must be [1, 2, n] (ids, then end offsets), not "
                              f"{list(np.asarray(tensors[name]).shape)}")
    ids, ends = packed[0].tolist(), [e for e in packed[1].tolist() if e != -1]
    if any(not 0 < e <= len(ids) for e in ends) or ends != sorted(set(ends)):
        raise InvalidArgument(f"'{name}': each word's end offset must be past the one before "
                              f"and at most {len(ids)}, not {ends}")
    return tuple(tuple(ids[a:b]) for a, b in zip([0] + ends, ends))


def _bias(tensors: Mapping[str, np.ndarray]) -> tuple[tuple[int, float], ...]:
    """`embedding_bias` [1, vocab] as (id, bias) pairs where it is not 0."""
    if "embedding_bias" not in tensors:
        return ()
    bias = np.asarray(tensors["embedding_bias"])
    if bias.dtype.kind != "f" or not (bias.ndim == 1 or (bias.ndim == 2 and bias.shape[0] == 1)):
        raise InvalidArgument(f"'embedding_bias' must be floats [1, vocab], not {bias.dtype} "
                              f"{list(bias.shape)}")
    bias = bias.reshape(-1)
    if not np.isfinite(bias).all():
        raise InvalidArgument("'embedding_bias' must be finite")
    return tuple((int(i), float(bias[i])) for i in np.flatnonzero(bias))


def logit_bias(core: CoreInputs | None, tensors: Mapping[str, np.ndarray], tokenizer
               ) -> tuple[tuple[int, float], ...]:
    """The embedding bias of a request: the core model's dense one and the ensemble's
    words, summed per token."""
    bias = bias_of_words(tensors, tokenizer)
    for token, value in core.logit_bias if core else ():
        bias[token] = bias.get(token, 0.0) + value
    return tuple(bias.items())
