"""The engine the servicer sees for a decoder artifact: request tensors and parameters ->
GenerationRequest, Chunk -> response tensors, the generator built from the loaded model with
the artifact's buckets and the model's limits, and its statistics and metrics. No grpc here.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

from serving.datatypes import DATATYPES
from serving.engine import Engine
from serving.errors import InvalidArgument
from serving.generation import GenerateOptions, GenerationStats, Generator
from serving.metrics import GenerationMetrics, Metrics, Stats
from serving.model import LoadedModel, Signature, TensorSpec
from serving.sampling import Chunk, GenerationRequest, Sampling
from serving.tokenizer import load_tokenizer
from tuner.errors import BadInput
from tuner.graph.cache_record import CacheRecord

VERSION = "1"



def decoder_vocab(signature: Signature, record: CacheRecord) -> int:
    """The real vocabulary (token ids [0, vocab); padded logits columns are cut off);
    ValueError when it is unknown."""
    outputs = {s.name: s for s in signature.outputs}
    vocab = signature.vocab_size or record.vocab or outputs[record.logits].shape[-1]
    if vocab is None or vocab < 1:
        raise ValueError("the vocabulary size is unknown (no embedding table, dynamic logits)")
    return int(vocab)


# ---------------------------------------------------------------------- request tensors


def client_signature(tokenizer: bool) -> Signature:
    """The tensors a client sends and receives (Triton's names for LLM models); every input
    but the prompt is optional and may come as a request parameter instead."""
    inputs = [TensorSpec("input_ids", "INT64", (1, -1))]
    if tokenizer:
        inputs.append(TensorSpec("text_input", "BYTES", (1,)))
    inputs += [TensorSpec("max_tokens", "INT32", (1,)), TensorSpec("temperature", "FP32", (1,)),
               TensorSpec("top_k", "INT32", (1,)), TensorSpec("top_p", "FP32", (1,)),
               TensorSpec("seed", "UINT64", (1,)), TensorSpec("stop_ids", "INT64", (-1,)),
               TensorSpec("end_id", "INT64", (1,)), TensorSpec("stream", "BOOL", (1,))]
    outputs = [TensorSpec("output_ids", "INT64", (1, -1))]
    if tokenizer:
        outputs.append(TensorSpec("text_output", "BYTES", (1,)))
    return Signature(tuple(inputs), tuple(outputs), "input_ids", None)


_SCALARS = {"max_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int,
            "end_id": int, "stream": bool}


def _scalar(name: str, value, kind: type):
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise InvalidArgument(f"input '{name}' must hold one value, not {value.size}")
        value = value.reshape(-1)[0].item()
    if kind is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise InvalidArgument(f"'{name}' must be a BOOL")
        return bool(value)
    if isinstance(value, (bool, str, bytes)) or (kind is int and isinstance(value, float)):
        raise InvalidArgument(f"'{name}' must be a{'n integer' if kind is int else ' number'}")
    return kind(value)


def parse_request(tensors: Mapping[str, np.ndarray], parameters: Mapping[str, object],
                  tokenizer=None, default_max_tokens: int = 16, request_id: str = ""
                  ) -> tuple[GenerationRequest, bool]:
    """A GenerationRequest (and whether to stream) from decoded request tensors and request
    parameters (a tensor wins over a parameter of the same name). InvalidArgument, saying
    what is wrong, for anything else."""
    known = set(_SCALARS) | {"input_ids", "text_input", "stop_ids"}
    for name in tensors:
        if name not in known:
            raise InvalidArgument(f"unexpected input '{name}'; a decoder takes "
                                  f"{sorted(known)}")
    values = {k: _scalar(k, v, _SCALARS[k]) for k, v in parameters.items() if k in _SCALARS}
    values.update({k: _scalar(k, v, _SCALARS[k]) for k, v in tensors.items() if k in _SCALARS})
    prompt = _prompt(tensors, tokenizer)
    stops = set()
    if "stop_ids" in tensors:
        stops |= {int(x) for x in np.asarray(tensors["stop_ids"]).reshape(-1)}
    elif "stop_ids" in parameters:  # a string parameter: "2, 13"
        try:
            stops |= {int(x) for x in str(parameters["stop_ids"]).replace(",", " ").split()}
        except ValueError:
            raise InvalidArgument("parameter 'stop_ids' must be token ids separated by commas "
                                  f"or spaces, not {parameters['stop_ids']!r}") from None
    if "end_id" in values:
        stops.add(values["end_id"])
    sampling = Sampling(values.get("temperature", 0.0), values.get("top_k", 0),
                        values.get("top_p", 1.0), values.get("seed"))
    request = GenerationRequest(prompt, values.get("max_tokens", default_max_tokens), sampling,
                                frozenset(stops), request_id)
    return request, values.get("stream", True)


def _prompt(tensors: Mapping[str, np.ndarray], tokenizer) -> tuple[int, ...]:
    if ("input_ids" in tensors) == ("text_input" in tensors):
        raise InvalidArgument("send the prompt as exactly one of 'input_ids' (INT64 [1, n]) "
                              "or 'text_input' (BYTES [1])")
    if "input_ids" in tensors:
        ids = tensors["input_ids"]
        if ids.dtype != np.int64 or ids.ndim != 2 or ids.shape[0] != 1:
            raise InvalidArgument(f"'input_ids' must be INT64 [1, n], not {ids.dtype} "
                                  f"{list(ids.shape)}")
        return tuple(int(x) for x in ids[0])
    if tokenizer is None:
        raise InvalidArgument("this model has no tokenizer (no tokenizer.json in its "
                              "artifact): send 'input_ids'")
    text = tensors["text_input"].reshape(-1)
    if text.size != 1:
        raise InvalidArgument(f"'text_input' must hold one string, not {text.size}")
    raw = text[0] if isinstance(text[0], bytes) else str(text[0]).encode()
    try:
        return tuple(tokenizer.encode(raw.decode("utf-8")).ids)
    except UnicodeDecodeError:
        raise InvalidArgument("'text_input' is not valid UTF-8") from None


def chunk_outputs(chunk: Chunk, with_text: bool) -> dict[str, np.ndarray]:
    """The response tensors of one chunk: output_ids [1, k] and text_output [1]."""
    out = {"output_ids": np.array([chunk.ids], np.int64).reshape(1, len(chunk.ids))}
    if with_text:
        out["text_output"] = np.array([(chunk.text or "").encode()], dtype=object)
    return out


def join_chunks(chunks: Sequence[Chunk]) -> Chunk:
    """The whole sequence as one final chunk (the unary call's answer)."""
    ids = tuple(t for c in chunks for t in c.ids)
    texts = [c.text for c in chunks if c.text is not None]
    last = chunks[-1]
    return Chunk(ids, "".join(texts) if texts else None, True, last.reason, last.detail)


def _stats_for(stats: Stats, metrics: Metrics | None, gm: GenerationMetrics | None
               ) -> GenerationStats:
    """The generator's callbacks, feeding ModelStatistics (one request per stream, one
    execution per model run) and the Prometheus series."""

    def on_token(ttft: float | None, itl: float | None) -> None:
        if gm is None:
            return
        gm.tokens.inc()
        if ttft is not None:
            gm.first_token.observe(ttft)
        if itl is not None:
            gm.inter_token.observe(itl)

    def on_step(rows: int, seconds: float) -> None:
        stats.record_batch(rows, seconds)
        if metrics is not None:
            metrics.observe_batch(rows)

    def on_streams(active: int, queued: int) -> None:
        if gm is not None:
            gm.active.set(active)
            gm.queued.set(queued)

    def on_end(reason: str, seconds: float) -> None:
        if reason in ("length", "stop"):
            stats.record_success(seconds, 0.0, 0.0, 1)
        else:
            stats.record_failure({"cancelled": "CANCELED", "shutdown": "REJECTED"}.get(
                reason, "BACKEND"), seconds)

    def on_prefix(looked_up: int, hit: int) -> None:
        if gm is not None:
            gm.prefix_looked_up.inc(looked_up)
            gm.prefix_hit.inc(hit)

    def on_preempt() -> None:
        if gm is not None:
            gm.preempted.inc()

    return GenerationStats(on_token, on_step, on_streams, on_end, on_prefix, on_preempt)


class DecoderEngine:
    """A decoder served by generation: what service.py needs (name, version, signature,
    stats, parse, submit) around one Generator."""

    decoupled = True

    def __init__(self, model: LoadedModel, options: GenerateOptions, stats: Stats,
                 metrics: Metrics | None = None, gen_metrics: GenerationMetrics | None = None,
                 forward: Engine | None = None) -> None:
        self.model, self.options, self.stats = model, options, stats
        # a request that brings its own past (DESIGN.md: a client may pass past) runs as one
        # plain forward through serving.engine instead of being generated
        self.forward = forward
        self.name, self.version = model.name, VERSION
        self.tokenizer = _tokenizer(model)
        pad_to = options.pad_to
        if pad_to == "auto":  # as serving.engine: any shape runs on a CPU, and costs there
            pad_to = "longest" if model.backend.endswith("cpu") else "bucket"
        self.pad_to = pad_to
        self.signature = client_signature(self.tokenizer is not None)
        if not options.cache_buckets and model.buckets.past:  # the cache lengths optimize chose
            options = dataclasses.replace(options, cache_buckets=tuple(model.buckets.past))
            self.options = options
        try:
            self.generator = Generator(model.runner, model.cache,
                                       decoder_vocab(model.signature, model.cache), options,
                                       max_positions=_max_positions(model),
                                       batch_buckets=model.buckets.batch,
                                       tokenizer=self.tokenizer,
                                       stats=_stats_for(stats, metrics, gen_metrics),
                                       pad_to=self.pad_to)
        except (ValueError, BadInput) as e:
            raise BadInput(f"{model.name}: {e}") from None

    def parse(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, object],
              request_id: str = "") -> tuple[GenerationRequest, bool]:
        return parse_request(tensors, parameters, self.tokenizer,
                             self.options.default_max_tokens, request_id)

    def submit(self, request: GenerationRequest, on_chunk):
        return self.generator.submit(request, on_chunk)

    def active(self) -> int:
        """Streams running (decoding or prefilling)."""
        return self.generator.active

    def note(self) -> str:
        g = self.generator
        return (f"generation: up to {self.options.max_streams} streams in flight "
                f"(queue {self.options.max_queue}), cache length up to {g.max_cache_len} "
                f"(buckets {list(g.cache_buckets)}), batch buckets {list(g.batch_buckets)}, "
                f"padding to the {self.pad_to}, "
                f"tokenizer {'yes' if self.tokenizer is not None else 'none'}")

    def drain(self, grace_s: float) -> None:
        self.generator.drain(grace_s)

    def takes_forward(self, names) -> bool:
        """Whether a request with these input names is a plain forward (it carries a past)."""
        past = set(self.model.cache.past) if self.model.cache is not None else set()
        return self.forward is not None and bool(past & set(names))

    def close(self) -> None:
        self.generator.close()
        if self.forward is not None:
            self.forward.close()


def _tokenizer(model: LoadedModel):
    """tokenizer.json in the artifact folder (where `optimize` copies it)."""
    return load_tokenizer(model.folder) if model.folder is not None else None


def _max_positions(model: LoadedModel) -> int | None:
    """The model's positions: its position table's rows, or, for rotary families (no table
    in the graph), `max_position_embeddings` / `n_positions` of a config.json in the
    artifact (Hugging Face's, copied by `optimize` like the tokenizer)."""
    if model.max_positions is not None or model.folder is None:
        return model.max_positions
    path = model.folder / "config.json"
    if not path.is_file():
        return None
    import json

    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = config.get("max_position_embeddings") or config.get("n_positions")
    return value if isinstance(value, int) and value > 0 else None
