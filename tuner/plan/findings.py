"""Shape findings: docs/design.md's guidelines applied to one model on one device.

Each finding says what to change and why, in one line. Rules only propose; the tuner
measures (a padded shape is a candidate, never a promise).
"""

from __future__ import annotations

from dataclasses import replace

from tuner.graph.ort_fused import STANDARD_FUSED
from tuner.graph.paddable import unpadded_reason
from tuner.graph.shape import Finding, ModelShape
from tuner.hardware.facts import (ORT_FUSED_HEAD_DIMS, DeviceFacts, device_facts,
                                  largest_power_of_two_dividing, next_multiple, waves)

# ONNX Runtime's fused attention kernels (CUDA) exist for these head dims only.
LOW_WAVE_EFFICIENCY = 0.75


def _vocab(shape: ModelShape) -> list[Finding]:
    v = shape.vocab_size
    if not v or v % 64 == 0:
        return []
    tied = " and the tied embedding" if shape.sites.tied else ""
    return [Finding("vocab-multiple-64", "warning",
                    f"vocab {v} is not a multiple of 64: pad the LM head{tied} to "
                    f"{next_multiple(v, 64)} (exact: the extra logits are sliced off) so the "
                    "largest GEMM fits tensor-core tiles")]


def _head_dim(shape: ModelShape) -> list[Finding]:
    d = shape.head_dim
    if not d:
        return []
    # the hardware's view stands; where the heads keep their shape, the remedy is not ours
    kept = unpadded_reason(shape)
    not_here = f"; not padded here: {kept}" if kept else ""
    out = []
    if d % 8:
        fix = (f"pad each head to {next_multiple(d, 8)} (exact, zero columns in Q/K/V, scale "
               "kept at 1/sqrt(d))")
        out.append(Finding("head-dim-multiple-8", "error",
                           f"head dim {d} is not a multiple of 8: fp16 tensor cores cannot run the "
                           f"attention GEMMs" + (not_here if kept else f"; {fix}")))
    elif d % 64:
        fix = f"candidate: pad each head to {next_multiple(d, 64)} (exact) and measure"
        out.append(Finding("head-dim-multiple-64", "warning",
                           f"head dim {d} is a multiple of only "
                           f"{largest_power_of_two_dividing(d)}: GEMM efficiency rises with powers "
                           f"of two up to 64" + (not_here if kept else f"; {fix}")))
    if d not in ORT_FUSED_HEAD_DIMS:
        better = next((x for x in ORT_FUSED_HEAD_DIMS if x > d), None)
        hint = f"pad to {better} to get one" if better else "no larger fused size exists"
        hint = f"not padded here: {kept}" if kept else hint
        out.append(Finding("attention-kernel", "warning",
                           f"head dim {d} has no ONNX Runtime fused attention kernel "
                           f"({'/'.join(map(str, ORT_FUSED_HEAD_DIMS))}): {hint}; FlashAttention "
                           f"would round it up to {next_multiple(d, 32)} internally"))
    return out


def _ffn(shape: ModelShape) -> list[Finding]:
    f = shape.ffn_size
    if not f or f % 64 == 0:
        return []
    near = ""
    if shape.ffn_gated and shape.hidden_size:
        near = f" (SwiGLU: search widths near 8/3*h = {8 * shape.hidden_size // 3}, not the literal value)"
    return [Finding("ffn-multiple-64", "warning",
                    f"FFN width {f} is not a multiple of 64: pad it to {next_multiple(f, 64)} "
                    f"(exact: zero up/gate columns, zero down rows){near}")]


def _hidden(shape: ModelShape) -> list[Finding]:
    h = shape.hidden_size
    if not h or h % 64 == 0:
        return []
    return [Finding("hidden-never-padded", "info",
                    f"hidden size {h} is not a multiple of 64, but it is never padded: "
                    "LayerNorm/RMSNorm statistics would change; only a retrained model fixes it")]


def _experts(shape: ModelShape) -> list[Finding]:
    widths = sorted({e.width for e in shape.sites.experts if e.width % 64})
    if not widths:
        return []
    return [Finding("experts-not-padded", "info",
                    f"expert FFN width {', '.join(map(str, widths))} is not a multiple of 64, "
                    f"but the experts ({shape.sites.experts[0].count} per block) are not "
                    "padded: no rewrite widens them yet")]


def gemm_shapes(shape: ModelShape) -> list[tuple[str, int, int]]:
    """(name, K, N) of one layer's GEMMs and the LM head, with N the output width."""
    h, a, kv, d, f = (shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
                      shape.ffn_size)
    out: list[tuple[str, int, int]] = []
    fused = any(l.attention is not None and l.attention.qkv for l in shape.sites.layers)
    if h and a and d and fused:
        out += [("qkv", h, (a + 2 * (kv or a)) * d), ("o", a * d, h)]
    elif h and a and d:
        out += [("q", h, a * d), ("k/v", h, (kv or a) * d), ("o", a * d, h)]
    if h and f:
        out += [("up", h, f), ("down", f, h)]
    if h and shape.vocab_size:
        out.append(("lm_head", h, shape.vocab_size))
    return out


def _waves(shape: ModelShape, dev: DeviceFacts, tokens: int) -> list[Finding]:
    if dev.sm_count is None or tokens <= 0:
        return []
    out, idle = [], []
    for name, _k, n in gemm_shapes(shape):
        w = waves(tokens, n, dev)
        if w is None or w.efficiency >= LOW_WAVE_EFFICIENCY:
            continue
        if w.waves < 1:
            idle.append(f"{name} N={n}: {w.tiles} tiles")
            continue
        better = next((m for m in range(next_multiple(n, 64), n + n // 4 + 64, 64)
                       if (wm := waves(tokens, m, dev)) is not None
                       and wm.efficiency >= LOW_WAVE_EFFICIENCY), None)
        hint = (f"N={better} would fill the last wave" if better and better != n
                else "change the tokens per batch (bucket) rather than the width")
        out.append(Finding("wave-quantization", "warning",
                           f"{name} GEMM at M={tokens}, N={n}: {w.tiles} tiles on {dev.sm_count} "
                           f"SMs of {dev.name} = {w.waves:.2f} waves, {w.efficiency:.0%} busy; "
                           f"{hint}"))
    if idle:
        out.append(Finding("wave-quantization", "info",
                           f"at M={tokens} these GEMMs fill less than one wave of the "
                           f"{dev.sm_count} SMs of {dev.name} ({'; '.join(idle)}): batch more "
                           "tokens per call (bigger buckets); padding widths cannot help"))
    return out


def head_share(shape: ModelShape) -> float | None:
    """The LM head's share of one position's GEMM multiply-adds (every layer's projections,
    k and v apart, gate and up apart, then the head), None without the dims to count."""
    gemms = gemm_shapes(shape)
    head = next((k * n for name, k, n in gemms if name == "lm_head"), None)
    if head is None or not shape.num_layers:
        return None
    twice = {"k/v"} | ({"up"} if shape.ffn_gated else set())
    layer = sum(k * n * (2 if name in twice else 1) for name, k, n in gemms if name != "lm_head")
    return head / (shape.num_layers * layer + head)


def _last_logits(shape: ModelShape) -> list[Finding]:
    share = head_share(shape)
    if shape.cache is None or share is None or shape.sites.logits_to_keep or \
            shape.cross_attention:
        return []
    return [Finding("logits-every-position", "info",
                    f"the LM head projects every position onto the vocabulary ({share:.0%} of a "
                    "prompt token's GEMM work) where generation reads one per row: `tuner "
                    "optimize` serves it cut to the last (logits_to_keep, exact)")]


def _slot_positions(shape: ModelShape) -> list[Finding]:
    if shape.sites.slot_positions is None:
        return []
    return [Finding("positions-from-cache-length", "warning",
                    "the graph takes no position ids and counts its rotary positions from "
                    "its cache's length: a row padded or moved beside longer ones would get "
                    "other positions than alone, so a server runs one stream at a time; "
                    "`tuner optimize` serves it with the input position_ids (exact), "
                    "and its streams batched")]


def _windowed(shape: ModelShape) -> list[Finding]:
    c = shape.cache
    if c is None or not c.windowed_layers:
        return []
    return [Finding("windowed-cache", "info",
                    f"{len(c.windowed_layers)} layer(s) keep only their last {c.window} "
                    "positions in their cache (onnxruntime-genai's windowed cache): `tuner "
                    "optimize` makes every cache full-length first (exact, checked by running), "
                    "so one cache serves every layer; the sliding layers' cache memory then "
                    "grows with the sequence")]


def _encoder_decoder(shape: ModelShape) -> list[Finding]:
    if not shape.cross_attention:
        return []
    return [Finding("encoder-decoder", "info",
                    f"an encoder-decoder's decoder ({shape.cross_attention} cross-attention "
                    "blocks): `tuner pad` pads its FFN width and vocabulary exactly, and `tuner "
                    "pad EXPORT_FOLDER` an Optimum export's encoder and decoders together (a "
                    "folder Optimum's ORTModelForSeq2SeqLM loads); its heads are not padded; "
                    + ("`tuner optimize` does not take a with-past step (one token against a "
                       "cache, not what its forward passes measure)" if shape.cache else
                       "`tuner optimize` and `tuner serve` take it as a tensor model (one "
                       "forward pass per request)")
                    + "; `tuner serve EXPORT_FOLDER` generates from the folder's three graphs")]


QUANTIZED_OPS = ("MatMulNBits", "MatMulBnb4", "DynamicQuantizeMatMul", "MatMulIntegerToFloat",
                 "MatMulInteger", "QLinearMatMul", "DequantizeLinear")


def _fused(shape: ModelShape) -> list[Finding]:
    quantized = [k for k in shape.fused_ops if k.rsplit(".", 1)[-1] in QUANTIZED_OPS]
    fused = [k for k in shape.fused_ops if k not in quantized]
    out = []
    if fused and all(k in STANDARD_FUSED for k in fused):
        out.append(Finding("onnx-fused-ops", "info",
                           f"ONNX's own fused ops ({', '.join(fused)}; torch's export at opset "
                           "23): every padding goes through them, the Attention op's scale "
                           "written explicitly when the head dim grows (it defaults to "
                           "1/sqrt(head size))"))
    elif fused:
        who = "ONNX Runtime's optimizer" if shape.optimized else "the exporter"
        out.append(Finding("already-fused", "info",
                           f"graph already fused by {who} ({', '.join(fused)}): run the tuner on "
                           "the unfused export for padding rewrites; fused attention ops default "
                           "their scale to 1/sqrt(head size), so head padding must write it "
                           "explicitly"))
    if shape.lengths_mask:
        out.append(Finding("mask-as-lengths", "warning",
                           f"{shape.lengths_mask} reads the attention mask as each row's count "
                           "of ones (ONNX Runtime's optimizer's default mask format): a "
                           "left-padded or holed mask gives wrong outputs, so `tuner serve` "
                           "refuses one; `tuner optimize` the unfused export instead (its "
                           "fusion feeds the raw mask)"))
    if shape.one_row_rotary:
        out.append(Finding("rotary-caches-one-row", "warning",
                           f"{len(shape.one_row_rotary)} RotaryEmbedding node(s) take cos/sin "
                           "caches of one row (torch's opset-23 export of a model that computes "
                           "its own positions), which ONNX Runtime does not broadcast: the "
                           "graph runs at batch 1 only; `tuner optimize` and `tuner pad` expand "
                           "them to the batch first (exact, checked row by row), `tuner "
                           "rebatch` writes that graph alone"))
    if quantized:
        out.append(Finding("quantized-weights", "info",
                           f"weights are quantized ({', '.join(quantized)}): vocabulary and FFN "
                           "padding go through them exactly (new entries hold the zero point); "
                           "for head dim and heads pad the float model, then quantize"))
    return out


def audit(shape: ModelShape, device_facts: DeviceFacts, tokens: int) -> tuple[Finding, ...]:
    """Every finding for `shape` on `device_facts` with `tokens` (= b*s) rows per GEMM."""
    return tuple(_vocab(shape) + _head_dim(shape) + _ffn(shape) + _hidden(shape)
                 + _waves(shape, device_facts, tokens) + _fused(shape) + _last_logits(shape)
                 + _slot_positions(shape) + _experts(shape) + _windowed(shape)
                 + _encoder_decoder(shape))


def audited(shape: ModelShape, device: str = "cpu", tokens: int = 4096) -> ModelShape:
    """`shape` with the findings of the hardware rules for `device` (a tuner.hardware.facts
    DEVICES key) at `tokens` rows per GEMM."""
    return replace(shape, findings=audit(shape, device_facts(device), tokens))
