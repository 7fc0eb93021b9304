"""`tuner optimize` for a decoder exported with its KV cache: two workloads, measured apart
(docs/design.md, "Decoders with a KV cache").

- prefill: the prompt, b x s against an empty cache (past 0);
- decode: one new token per stream, b x 1 against a cache of P positions. Decode is where
  serving time goes (one step per generated token) and it is memory-bound, so padding and
  batching act differently on it.

Traffic (`--requests`, JSONL): one object per request, {"prompt_tokens": 120,
"output_tokens": 40, "batch": 1} ("seq" is taken for the prompt when `prompt_tokens` is
absent; `output_tokens` defaults to DEFAULT_OUTPUT_TOKENS). Other request formats give the
prompt lengths, with the default output. The decode steps of a request run at past lengths
prompt, prompt + 1, ..., prompt + output - 1: their distribution chooses the cache-length
buckets as prompt lengths choose the sequence buckets.

The selection rule weighs the phases by tokens: the expected time of one request is one
prefill at its prompt bucket plus (mean output tokens) decode steps at the median cache
bucket, at the batch of `--streams` (the server's in-flight batch) where that is larger
than the traffic's; speedups are paired ratios of that sum, round by round.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from tuner.artifact.codec import manifest_to_json
from tuner.artifact.records import Manifest, shape_key
from tuner.artifact.report_html import PhaseRow
from tuner.errors import BadInput
from tuner.gate.kv_feeds import decode_feeds, prefill_feeds
from tuner.graph.cache_record import CacheRecord
from tuner.gate.kv_gate import WidenedRunner
from tuner.graph.kv_cache import KvCache, widened_cache
from tuner.graph.load import load_model
from tuner.jobs.workload import Phase, Shape, Traffic, memo
from tuner.measure.bench import Measurements, Target
from tuner.measure.buckets import (Requests, batch_buckets, fit_bucket, default_seq_buckets,
                                   load_requests, seq_grid, uniform_requests)
from tuner.measure.stats import RatioCI, paired_ratio_ci, weighted_totals

DEFAULT_OUTPUT_TOKENS = 32
RULE = ("expected time per request = prefill(batch, prompt bucket) + mean output tokens x "
        "decode(batch x 1, median cache-length bucket); variants are compared on that sum, "
        "paired round by round (prefill weighed once per request, decode once per generated "
        "token)")


@dataclass(frozen=True)
class DecoderTraffic:
    prompts: Requests  # (batch, prompt tokens)
    past: Requests  # (batch, cache length) of every decode step
    mean_output: float  # generated tokens per request
    prompt_grid: tuple[int, ...]
    past_grid: tuple[int, ...]
    batch: tuple[int, ...]
    note: str | None = None


def _subsample(grid: tuple[int, ...], n: int = 8) -> tuple[int, ...]:
    if len(grid) <= n:
        return grid
    return tuple(grid[i] for i in sorted({round(k * (len(grid) - 1) / (n - 1)) for k in range(n)}))


def token_requests(path: Path) -> list[tuple[int, int, int]] | None:
    """(batch, prompt, output) per line when the file is JSONL that names prompt/output
    tokens; None when it does not (then it is an ordinary requests file)."""
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        return None
    rows, named = [], False
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise BadInput(f"{path.name} line {i}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise BadInput(f"{path.name} line {i}: expected an object")
        named = named or "prompt_tokens" in obj or "output_tokens" in obj
        vals = []
        for key, default in (("batch", 1), ("prompt_tokens", obj.get("seq")),
                             ("output_tokens", DEFAULT_OUTPUT_TOKENS)):
            v = obj.get(key, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadInput(f"{path.name} line {i}: {key} must be a positive integer, "
                               f"not {v!r}")
            vals.append(v)
        rows.append(tuple(vals))
    return rows if named else None


def decoder_traffic(requests: Path | None, max_seq: int | None, max_batch: int,
                    positions: int | None) -> DecoderTraffic:
    """Prompt and cache-length distributions from the traffic file (or uniform prompts up to
    the model's positions, capped at 256, with DEFAULT_OUTPUT_TOKENS each)."""
    rows = token_requests(requests) if requests is not None else None
    note = None
    if rows is None:
        if requests is not None:
            req = load_requests(requests)
            note = (f"{requests.name} has no output_tokens: {DEFAULT_OUTPUT_TOKENS} per "
                    "request assumed")
        else:
            top = min(max_seq or positions or 256, 256 if not max_seq else max_seq)
            req = uniform_requests(max(top - DEFAULT_OUTPUT_TOKENS, 1))
            note = (f"no requests file: prompts uniform up to {req.max_seq}, "
                    f"{DEFAULT_OUTPUT_TOKENS} output tokens each")
        rows = [(b, s, DEFAULT_OUTPUT_TOKENS) for (b, s), w in req.weights.items()
                for _ in range(max(int(round(w)), 1))]
    prompts: dict[tuple[int, int], float] = {}
    past: dict[tuple[int, int], float] = {}
    for b, p, o in rows:
        prompts[(b, p)] = prompts.get((b, p), 0.0) + 1
        for k in range(o):
            past[(b, p + k)] = past.get((b, p + k), 0.0) + 1
    source = str(requests) if requests is not None else "default"
    preq, dreq = Requests(prompts, source, len(rows)), Requests(past, source, len(rows))
    limit = max_seq or positions
    if limit and dreq.max_seq + 1 > limit:
        raise BadInput(f"prompt + output tokens reach {dreq.max_seq + 1}, past the model's "
                       f"{limit} positions")
    prompt_grid = seq_grid(preq, limit) if requests is not None else _subsample(
        default_seq_buckets(preq.max_seq))
    past_grid = _subsample(default_seq_buckets(dreq.max_seq))
    batch = batch_buckets(max(preq.max_batch, 1) if requests is not None else max_batch)
    mean_output = float(np.mean([o for _, _, o in rows]))
    return DecoderTraffic(preq, dreq, mean_output, tuple(prompt_grid), tuple(past_grid),
                          tuple(batch), note)


def decode_shape(t: DecoderTraffic, prefill_shape: tuple[int, int], streams: int = 1
                 ) -> tuple[int, int]:
    """(batch, cache length) where variants are compared for decode: the selection's batch,
    or the batch bucket of the server's streams decoding at once (whichever is larger), and
    the bucket of the median cache length."""
    batch = prefill_shape[0]
    if streams > batch:
        batch = min((b for b in t.batch if b >= streams), default=max(t.batch))
    return batch, fit_bucket(t.past.seq_quantile(0.5), t.past_grid)


def prefill_feeds_for(roles: CacheRecord, vocab: int, shape: tuple[int, int],
                      seed: int = 1) -> dict[str, np.ndarray]:
    b, s = shape
    ids = np.random.default_rng(seed).integers(0, vocab, (b, s))
    return dict(prefill_feeds(roles, ids).arrays)


def decode_feeds_for(roles: CacheRecord, vocab: int, shape: tuple[int, int],
                     seed: int = 1) -> dict[str, np.ndarray]:
    b, past = shape
    return dict(decode_feeds(roles, b, past, 1, vocab, seed=seed).arrays)


def decode_key(batch: int, past: int) -> str:
    """The key of a decode shape in `latency_decode` maps: "1x1@128" (batch x 1 at past)."""
    return f"{int(batch)}x1@{int(past)}"


def combined_totals(prefill: Mapping, decode: Mapping, mean_output: float) -> np.ndarray:
    """Per-round expected time of one request (ms): prefill totals + mean_output x decode."""
    p = weighted_totals(prefill, {s: 1.0 for s in prefill})
    d = weighted_totals(decode, {s: 1.0 for s in decode})
    return p + mean_output * d


def _cache_shape(cache: KvCache, widened: Mapping, name: str) -> list:
    """The shape of past tensor `name` as fed (a value's head dim is the values' own)."""
    letters = {"b": "batch", "h": cache.num_kv_heads, "s": "past", "d": cache.dim_of(name)}
    shape = [letters[x] for x in cache.layout]
    for axis, _pos, new in widened.get(name, ()):
        shape[axis] = new
    return shape


def cache_section(cache: KvCache, served_path: Path, served: str, policy: str) -> dict[str, Any]:
    """The manifest's `cache`: what clients (or a server owning the cache) feed as past."""
    widened = widened_cache(load_model(served_path)) if served != "original" else {}
    key = cache.layers[0].past_key  # the shapes are the keys'; value_head_dim: the values'
    return {"layers": cache.num_layers, "kv_heads": cache.num_kv_heads,
            "head_dim": cache.head_dim, "value_head_dim": cache.value_head_dim,
            "layout": cache.layout, "dtype": cache.dtype,
            "bytes_per_token": cache.bytes_per_token, "policy": policy,
            "widened": bool(widened), "original_shape": _cache_shape(cache, {}, key),
            "served_shape": _cache_shape(cache, widened, key), "served_variant": served,
            "past": [n for layer in cache.layers for n in (layer.past_key, layer.past_value)],
            "present": [n for layer in cache.layers
                        for n in (layer.present_key, layer.present_value)]}


def phase_rows(manifest: Manifest) -> list[PhaseRow]:
    """report.html's decoder table: each variant's prefill and decode step side by side, at
    the shapes the variants were compared on."""
    ph = manifest.phases or {}
    prefill, decode = ph.get("prefill", {}).get("shapes", []), ph.get("decode", {}).get("shapes", [])
    rows = []
    for v in manifest.variants:
        for pk, dk in zip(prefill, decode):
            rows.append(PhaseRow(v.name, pk, v.latency.get(pk), v.latency_decode.get(dk),
                                 int(dk.split("@")[1])))
    return rows


def report_section(manifest_json: Mapping[str, Any]) -> str:
    """report.md's decoder part: the cache, both phases per variant, the rule."""
    c, ph = manifest_json["cache"], manifest_json["phases"]
    lines = ["", "## Decoder: prefill and decode", "",
             f"- cache: {c['layers']} layers, {c['kv_heads']} kv heads of {c['head_dim']}"
             + (f" (values {c['value_head_dim']})" if c.get("value_head_dim") else "") + ", "
             f"layout {c['layout']}, {c['dtype']}; policy `{c['policy']}`; shape as served "
             f"{c['served_shape']} (original {c['original_shape']})",
             f"- selection: {ph['rule']}; mean output tokens {ph['mean_output_tokens']:.1f}",
             f"- cache-length buckets: {manifest_json['buckets'].get('past', [])}", "",
             "| variant | prefill shape | prefill ms (median, IQR) | decode shape | decode ms "
             "(median, IQR) | speedup per request [95% CI] |", "|---|---|---|---|---|---|"]
    pk, dk = ph["prefill"]["shapes"][0], ph["decode"]["shapes"][0]
    for v in manifest_json["variants"]:
        p, d = v["latency"].get(pk), v.get("latency_decode", {}).get(dk)
        sp = v.get("speedup")
        lines.append(
            f"| {v['name']} | {pk} | {p['median_ms']:.3f} ({p['spread_ms']:.3f}) | {dk} | "
            f"{d['median_ms']:.3f} ({d['spread_ms']:.3f}) | "
            + (f"{sp['ratio']:.3f}x [{sp['low']:.3f}, {sp['high']:.3f}]" if sp else "-") + " |"
            if p and d else f"| {v['name']} | {pk} | - | {dk} | - | - |")
    return "\n".join(lines) + "\n"


class DecoderWorkload:
    """Prefill (b x s against past 0) and decode (b x 1 against a cache of P), measured apart
    and weighed by tokens (RULE); variants with a widened cache are fed wider pasts."""

    generates = True

    def __init__(self, cfg, roles: CacheRecord, cache: KvCache, vocab: int,
                 positions: int | None) -> None:
        self.roles, self.cache, self.vocab = roles, cache, vocab
        self.streams = cfg.streams
        self.decoder = decoder_traffic(cfg.requests, cfg.max_seq,
                                       max(cfg.max_batch, self.streams), positions)
        d = self.decoder
        self.traffic = Traffic(d.prompts, d.prompt_grid, d.batch, d.note)

    def phases(self, selection: Sequence[Shape]) -> tuple[Phase, ...]:
        d = self.decoder
        prefill = Phase("prefill", tuple(selection), d.prompts, d.prompt_grid,
                        memo(lambda s: prefill_feeds_for(self.roles, self.vocab, s)))
        decode = Phase("decode", (decode_shape(d, selection[0], self.streams),), d.past,
                       d.past_grid,
                       memo(lambda s: decode_feeds_for(self.roles, self.vocab, s)),
                       key=decode_key, latency_field="latency_decode", bucket_field="past",
                       settings={"phase": "decode"})
        return prefill, decode

    def wrap(self, targets: list[Target], paths: Mapping[str, Path]) -> list[Target]:
        """A widened cache interface is fed wider pasts (zeros in the new entries)."""
        out = []
        for t in targets:
            widened = widened_cache(load_model(paths[t.name]))
            out.append(replace(t, runner=WidenedRunner(t.runner, widened)) if widened else t)
        return out

    def speedups(self, measured: Mapping[str, Measurements], names: Sequence[str],
                 phases: Sequence[Phase]) -> dict[str, RatioCI]:
        prefill, decode = (measured[p.name] for p in phases)

        def per_request(n: str) -> np.ndarray:
            return combined_totals(prefill.by_shape(n), decode.by_shape(n),
                                   self.decoder.mean_output)
        return {n: paired_ratio_ci(per_request("original"), per_request(n))
                for n in names if n != "original"}

    def manifest_parts(self, selected_path: Path, selected: str, policy: str,
                       phases: Sequence[Phase]) -> dict[str, Any]:
        prefill, decode = phases
        return {"cache": cache_section(self.cache, selected_path, selected, policy),
                "phases": {"rule": RULE, "mean_output_tokens": self.decoder.mean_output,
                           "prefill": {"shapes": [shape_key(*s) for s in prefill.compare_at],
                                       "weight": 1.0, "per": "request"},
                           "decode": {"shapes": [decode_key(*s) for s in decode.compare_at],
                                      "weight": self.decoder.mean_output,
                                      "per": "generated token"}}}

    def phase_rows(self, manifest: Manifest) -> list[PhaseRow]:
        return phase_rows(manifest)

    def report_section(self, manifest: Manifest) -> str:
        return report_section(manifest_to_json(manifest))
