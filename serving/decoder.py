"""The engine the servicer sees for a decoder artifact: request tensors and parameters ->
GenerationRequest, Chunk -> response tensors, the generator built from the loaded model with
the artifact's buckets and the model's limits, and its statistics and metrics. No grpc here.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

# the request-parsing half lives in serving.conventions (Triton's LLM names)
from serving import samples, trtllm_core
from serving.conventions import ClientRequest, client_signature, parse_request
from serving.engine import Engine
from serving.errors import InvalidArgument
from serving.generation import GenerateOptions, GenerationStats, Generator
from serving.generation.beam_decode import MAX_BEAMS
from serving.generation.beams import BeamConfig
from serving.metrics import GenerationMetrics, Metrics, Stats
from serving.model import LoadedModel, Signature
from serving.sampling import GenerationRequest
from serving.text_config import load_text_config, read_dict
from serving.tokenizer import load_tokenizer
from tuner.errors import BadInput
from tuner.gate.row_moves import tolerance_for
from tuner.graph.cache_record import CacheRecord
from tuner.runtime.registry import get_backend

VERSION = "1"



def decoder_vocab(signature: Signature, record: CacheRecord) -> int:
    """The real vocabulary (token ids [0, vocab); padded logits columns are cut off);
    ValueError when it is unknown."""
    outputs = {s.name: s for s in signature.outputs}
    vocab = signature.vocab_size or record.vocab or outputs[record.logits].shape[-1]
    if vocab is None or vocab < 1:
        raise ValueError("the vocabulary size is unknown (no embedding table, dynamic logits)")
    return int(vocab)


def stats_for(stats: Stats, metrics: Metrics | None, gm: GenerationMetrics | None
               ) -> GenerationStats:
    """The generator's callbacks, feeding ModelStatistics (one request per stream, one
    execution per model run) and the Prometheus series."""

    def on_step(rows: int, seconds: float) -> None:
        stats.record_batch(rows, seconds)
        if metrics is not None:
            metrics.observe_batch(rows)

    def on_end(reason: str, seconds: float) -> None:
        if reason in ("length", "stop"):
            stats.record_success(seconds, 0.0, 0.0, 1)
        else:
            stats.record_failure({"cancelled": "CANCELED", "shutdown": "REJECTED"}.get(
                reason, "BACKEND"), seconds)
        if gm is not None:
            gm.finished(reason).inc()
            gm.request_latency.observe(seconds)

    if gm is None:
        return GenerationStats(on_step=on_step, on_end=on_end)

    def on_token(ttft: float | None, itl: float | None) -> None:
        gm.tokens.inc()
        if ttft is not None:
            gm.first_token.observe(ttft)
        if itl is not None:
            gm.inter_token.observe(itl)

    def on_streams(active: int, queued: int) -> None:
        gm.active.set(active)
        gm.queued.set(queued)

    def on_prefix(looked_up: int, hit: int) -> None:
        gm.prefix_looked_up.inc(looked_up)
        gm.prefix_hit.inc(hit)

    def on_draft(drafts: int, accepted: int) -> None:
        gm.drafts.inc()
        gm.draft_tokens.inc(drafts)
        gm.accepted_tokens.inc(accepted)

    return GenerationStats(on_token=on_token, on_prompt=gm.prompt_tokens.inc,
                           on_step=on_step, on_streams=on_streams,
                           on_cache_usage=gm.cache_usage.set, on_end=on_end,
                           on_prefix=on_prefix, on_preempt=gm.preempted.inc,
                           on_draft=on_draft)


class DecoderEngine:
    """A decoder served by generation: what service.py needs (name, version, signature,
    stats, parse, submit) around one Generator."""

    decoupled = True
    max_beams = MAX_BEAMS  # beam search (serving.generation.beam_decode)

    def __init__(self, model: LoadedModel, options: GenerateOptions, stats: Stats,
                 metrics: Metrics | None = None, gen_metrics: GenerationMetrics | None = None,
                 forward: Engine | None = None) -> None:
        self.model, self.options, self.stats = model, options, stats
        # a request that brings its own past (docs/design.md: a client may pass past) runs as one
        # plain forward through serving.engine instead of being generated
        self.forward = forward
        self.name, self.version = model.name, VERSION
        self.tokenizer = _tokenizer(model)
        self.text = load_text_config(model.folder, self.tokenizer)  # end tokens, chat template
        pad_to = options.pad_to
        if pad_to == "auto":  # as serving.engine: any shape runs on a CPU, and costs there
            pad_to = "longest" if model.backend.endswith("cpu") else "bucket"
        self.pad_to = pad_to
        self.signature = client_signature(self.tokenizer is not None)
        if not options.cache_buckets and model.buckets.past:  # the cache lengths optimize chose
            options = dataclasses.replace(options, cache_buckets=tuple(model.buckets.past))
            self.options = options
        # a graph that reads its mask as lengths (onnxruntime-genai's GroupQueryAttention)
        # is fed its rows from position 0 (tuner.gate.decode_step: CacheRecord.rows_at_start)
        try:
            self.generator = Generator(model.runner, model.cache,
                                       decoder_vocab(model.signature, model.cache), options,
                                       max_positions=_max_positions(model),
                                       batch_buckets=model.buckets.batch,
                                       tokenizer=self.tokenizer, eos_ids=self.text.eos_ids,
                                       stats=stats_for(stats, metrics, gen_metrics),
                                       pad_to=self.pad_to,
                                       search=BeamConfig(1, self.text.length_penalty,
                                                         self.text.early_stopping),
                                       rows_tolerance=tolerance_for(
                                           model.backend, get_backend(model.backend).precision,
                                           model.signature.precision))
        except (ValueError, BadInput) as e:
            raise BadInput(f"{model.name}: {e}") from None
        if gen_metrics is not None:  # (a server without a prefix cache: blocks of one entry)
            cache = self.generator.cache
            block = cache.prefix.block if cache.prefix is not None else 1
            gen_metrics.cache_config(block, cache.budget_tokens // block)

    def parse(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, object],
              request_id: str = "", outputs: Sequence[str] = ()) -> ClientRequest:
        """`outputs`: the request's own list (KServe v2: its responses carry only those); a
        name this model never answers with is INVALID_ARGUMENT before anything runs."""
        batch = self.parse_rows(tensors, parameters, request_id, outputs)
        if len(batch) > 1:
            raise InvalidArgument(f"a batch of {len(batch)} prompts is answered on a stream "
                                  "(ModelStreamInfer), one response per row and token, as "
                                  "TensorRT-LLM's decoupled models answer it")
        return batch[0]

    def parse_rows(self, tensors: Mapping[str, np.ndarray], parameters: Mapping[str, object],
                   request_id: str = "", outputs: Sequence[str] = ()) -> list[ClientRequest]:
        """parse(), one ClientRequest per prompt of a batch (serving/trtllm_core.rows); each of
        a batch's answers carries its `batch_index`."""
        known = {spec.name for spec in self.signature.outputs}
        for name in outputs:
            if name not in known:
                raise InvalidArgument(f"unexpected inference output '{name}' for model "
                                      f"'{self.name}'")
        rows = trtllm_core.rows(tensors)
        parsed = [dataclasses.replace(
            parse_request(row, parameters, self.tokenizer, self.options.default_max_tokens,
                          request_id, self.text.eos_ids, self.max_beams),
            outputs=tuple(outputs), batch_index=i if len(rows) > 1 else None)
            for i, row in enumerate(rows)]
        for request in parsed:
            samples.check(request, self.options.max_streams, len(parsed))
        return parsed

    def active(self) -> int:
        """Streams being decoded now (each holds a slot and its cache)."""
        return self.generator.active

    def submit(self, request: GenerationRequest, on_chunk):
        return self.generator.submit(request, on_chunk)

    def submit_all(self, streams):
        """A request's streams, queued whole or not at all (Admission.submit_all)."""
        return self.generator.submit_all(streams)

    def stop(self, request_id: str) -> int:
        """TensorRT-LLM's `stop` request: cancel the running request with this id (how many
        streams it had; 0 when it has ended, which is no error there either)."""
        if not request_id:
            raise InvalidArgument("A request id must be provided for request cancellation")
        return self.generator.cancel(request_id)

    def note(self) -> str:
        g = self.generator
        alone = f" ({g.rows_stay})" if g.rows_stay else ""
        return (f"generation: up to {g.options.max_streams} streams in flight{alone} "
                f"(queue {self.options.max_queue}), cache length up to {g.max_cache_len} "
                f"(buckets {list(g.cache_buckets)}), batch buckets {list(g.batch_buckets)}, "
                f"padding to the {self.pad_to}, KV cache budget "
                f"{g.budget.bytes / 1e9:.2f} GB ({g.budget.why}), "
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
    """The model's positions: what the graph bounds (a position table's rows, a fused rotary
    operator's cos cache), else `max_position_embeddings` / `n_positions` of a config.json in
    the artifact (Hugging Face's, copied by `optimize` like the tokenizer), else
    onnxruntime-genai's `context_length` in genai_config.json."""
    if model.max_positions is not None or model.folder is None:
        return model.max_positions
    config = read_dict(model.folder / "config.json")
    genai = read_dict(model.folder / "genai_config.json").get("model")
    for value in (config.get("max_position_embeddings"), config.get("n_positions"),
                  genai.get("context_length") if isinstance(genai, dict) else None):
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
