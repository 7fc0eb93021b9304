"""Why a shape is fast or slow, in the paper's terms: head dim, powers of two in h, h/a, f, v and
b*s, tile and wave counts of its GEMMs against the SM count, and where its time went compared
with the starting shape. Plain strings, one fact each, for the table and the markdown report.
"""

from __future__ import annotations

from tuner.design.measure import MeasureSettings, ShapeCost
from tuner.hardware.facts import ORT_FUSED_HEAD_DIMS, DeviceFacts, largest_power_of_two_dividing

# ONNX Runtime's fused attention kernels exist for these head dims (docs/design.md).
GROUPS = {"attention": ("scores", "context"), "qkv+out": ("qkv", "out"),
          "ffn": ("up", "gate", "down"), "lm head": ("lm_head",)}


def pow2(x: int) -> str:
    """'2^6' for 64, 192 (=2^6*3); the largest power of two that divides x."""
    p = largest_power_of_two_dividing(x)
    return f"2^{p.bit_length() - 1}"


def head_dim_note(d: int) -> str:
    if d & (d - 1) == 0 and d >= 64:
        return f"head dim {d} is a power of two >= 64 (the paper's knee)"
    flash = -(-d // 32) * 32
    fused = "has a" if d in ORT_FUSED_HEAD_DIMS else "has no"
    return (f"head dim {d}: only {pow2(d)} divides it (the paper's knee is 64); FlashAttention "
            f"pads it to {flash}, ONNX Runtime {fused} fused attention kernel for it")


def alignment_note(cost: ShapeCost, settings: MeasureSettings) -> str:
    s = cost.candidate.shape
    parts = [f"h={s.hidden_size} ({pow2(s.hidden_size)})", f"f={s.ffn_size} ({pow2(s.ffn_size)})",
             f"v={s.vocab_size} ({pow2(s.vocab_size)})",
             f"b*s={settings.tokens} ({pow2(settings.tokens)})"]
    odd = [p for p, x in zip(parts, (s.hidden_size, s.ffn_size, s.vocab_size, settings.tokens))
           if largest_power_of_two_dividing(x) < 64]
    tail = f"; below 2^6: {', '.join(p.split(' ')[0] for p in odd)}" if odd else ""
    return "powers of two: " + ", ".join(parts) + tail


def waves_note(cost: ShapeCost, dev: DeviceFacts) -> str | None:
    """The tile/wave picture of the model's costliest GEMM (GPU only)."""
    if dev.sm_count is None:
        return None
    g = max(cost.gemms, key=cost.gemm_ms)
    if g.waves is None:
        return None
    w = g.waves
    return (f"costliest GEMM {g.shape.label} {g.shape.describe()}: {w.tiles} tiles of "
            f"{dev.tile[0]}x{dev.tile[1]} = {w.waves:.2f} waves on {dev.sm_count} SMs "
            f"({w.efficiency:.0%} of wave slots used), {g.tflops:.0f} TFLOP/s")


def group_ms(cost: ShapeCost) -> dict[str, float]:
    """Median model time (ms) per GEMM group: attention, qkv+out, ffn, lm head."""
    return {name: sum(cost.gemm_ms(g) for g in cost.gemms if g.shape.label in labels)
            for name, labels in GROUPS.items()}


def versus_note(cost: ShapeCost, base: ShapeCost) -> str | None:
    """Where the time went against the baseline, by GEMM group, biggest change first."""
    if cost is base:
        return None
    mine, theirs = group_ms(cost), group_ms(base)
    changes = sorted(((k, mine[k] - theirs[k]) for k in GROUPS if theirs[k] > 0),
                     key=lambda kv: -abs(kv[1]))
    total = sum(theirs.values())
    parts = [f"{k} {delta / theirs[k]:+.0%}" for k, delta in changes if abs(delta) > 0.01 * total]
    return ("vs baseline, per GEMM group: " + ", ".join(parts)) if parts else None


def efficiency_note(cost: ShapeCost) -> str:
    parts = [f"{g.shape.label} {g.tflops * 1e3:.0f}" if g.tflops < 1 else
             f"{g.shape.label} {g.tflops:.0f}" for g in cost.gemms]
    unit = "GFLOP/s" if max(g.tflops for g in cost.gemms) < 1 else "TFLOP/s"
    return f"achieved {unit}: " + ", ".join(parts)


def explain(cost: ShapeCost, settings: MeasureSettings, dev: DeviceFacts,
            base: ShapeCost | None) -> tuple[str, ...]:
    notes = [head_dim_note(cost.candidate.shape.head_dim), alignment_note(cost, settings)]
    for extra in (waves_note(cost, dev), versus_note(cost, base) if base else None):
        if extra:
            notes.append(extra)
    notes.append(efficiency_note(cost))
    return tuple(notes)
