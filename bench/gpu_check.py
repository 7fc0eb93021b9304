"""GPU check: do the padded shapes win on this GPU? One table, under 8 minutes.

    .venv/bin/python bench/gpu_check.py              # on a machine with an NVIDIA GPU
    .venv/bin/python bench/gpu_check.py --smoke      # the same code paths on a CPU, tiny shapes

Parts, each run where its libraries are present (the others print why they were skipped):

1. GEMM probe (torch with CUDA; tuner.plan.probe, torch.matmul timed with CUDA events, fp16): the
   GEMMs of GPT-2 small and of a Pythia-2.8B-shaped model, original against padded dims:
   vocab 50257 vs 50304, head dim 80 vs 128 (Pythia-2.8B: h=2560, a=32), FFN widths
   (SwiGLU 8/3*h for h=4096: 10922 vs 10944 vs 11008). Shapes are timed interleaved in
   rounds; the ratio is time(original) / time(padded) per round (> 1: padded is faster),
   reported as the median with the range over rounds. "useful TF/s" counts the original's
   FLOPs for both, so it is comparable across the pair.
2. End to end (torch + transformers to export; each tuner GPU backend whose check passes):
   a GPT-2-small-shaped model exported with vocab 50257 and with 50304 (random weights: this
   compares time only), timed interleaved at one bucket on ort-cuda, ort-cuda-fp16, ort-trt,
   trt, trt-fp16.
3. End to end in torch (torch with CUDA + transformers; no export, no ONNX Runtime): the
   models themselves with random weights in fp16, eval, inference mode, SDPA attention, each
   forward timed with CUDA events, the pair interleaved (alternating which goes first) over
   the same rounds: GPT-2 small (12 layers + LM head, batch 8 x seq 512) with vocab 50257 vs
   50304, and a Pythia-2.8B layer stack (h=2560, FFN 10240, 4 of its 32 layers, no head,
   batch 4 x seq 2048) with 32 heads of 80 vs 20 heads of 128. This is the part that runs on
   a GPU machine with CPU-only onnxruntime and no TensorRT, where part 2 is skipped.

Works without a package registry: it needs only what is installed. Time on an H200 (by
estimate from its ~800 TFLOP/s fp16 GEMMs: part 1 is ~40 unique GEMMs x 16 samples of
>= 2 ms; part 3 is ~4 ms (GPT-2) and ~25 ms (4 Pythia layers) per forward, samples of
>= 20 ms, plus building four models on the GPU): about 10 s + 10 s + the CUDA and import
start-up, so well under a minute when part 2 is skipped; part 2's backends stop starting
after --budget-s (420 s), which keeps the whole under 8 minutes where they all run.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
NEOX_LAYERS = 4  # of Pythia-2.8B's 32: the ratio is per layer; 4 keep part 3 to seconds


@dataclass
class Row:
    part: str
    model: str
    what: str
    original: str
    padded: str
    orig_ms: float | None = None
    pad_ms: float | None = None
    ratio: tuple[float, float, float] | None = None  # median, low, high
    note: str = ""


def _ratio(orig: list[float], pad: list[float]) -> tuple[float, float, float]:
    r = [o / p for o, p in zip(orig, pad)]
    return statistics.median(r), min(r), max(r)


def _shape(h, a, d, f, v, gated=False):
    return SimpleNamespace(hidden_size=h, num_heads=a, num_kv_heads=a, head_dim=d, ffn_size=f,
                           ffn_gated=gated, vocab_size=v)


def probe_pairs(smoke: bool):
    """(model, what, original label, padded label, [gemms orig], [gemms padded]) per pair."""
    from tuner.plan.probe import model_gemms

    b, s = (1, 16) if smoke else (8, 512)
    pairs = []

    def pick(shape, labels):
        return [g for g in model_gemms(shape, b, s) if g.label in labels]

    if smoke:
        base = _shape(64, 4, 16, 250, 1000)
        pairs.append(("tiny", "vocab (lm_head)", "1000", "1024",
                      pick(base, {"lm_head"}), pick(_shape(64, 4, 16, 250, 1024), {"lm_head"})))
        pairs.append(("tiny", "ffn (up, down)", "250", "256",
                      pick(base, {"up", "down"}), pick(_shape(64, 4, 16, 256, 1000), {"up", "down"})))
        return pairs, (b, s)
    gpt2 = _shape(768, 12, 64, 3072, 50257)
    pairs.append(("gpt2-small", "vocab (lm_head)", "50257", "50304",
                  pick(gpt2, {"lm_head"}), pick(_shape(768, 12, 64, 3072, 50304), {"lm_head"})))
    pythia = _shape(2560, 32, 80, 10240, 50257)
    padded = _shape(2560, 32, 128, 10240, 50257)
    attn = {"qkv", "scores", "context", "out"}
    pairs.append(("pythia-2.8b", "head dim (qkv, scores, context, out)", "80", "128",
                  pick(pythia, attn), pick(padded, attn)))
    pairs.append(("pythia-2.8b", "vocab (lm_head)", "50257", "50304",
                  pick(pythia, {"lm_head"}), pick(_shape(2560, 32, 80, 10240, 50304), {"lm_head"})))
    for f in (10944, 11008):
        pairs.append(("swiglu h=4096", "ffn (up, gate, down)", "10922", str(f),
                      pick(_shape(4096, 32, 128, 10922, None, True), {"up", "gate", "down"}),
                      pick(_shape(4096, 32, 128, f, None, True), {"up", "gate", "down"})))
    return pairs, (b, s)


def run_probe(smoke: bool, rounds: int) -> tuple[list[Row], list[str]]:
    try:
        from tuner.plan.probe import backend_unavailable, probe
    except ImportError as e:
        return [], [f"skipped GEMM probe: tuner.plan.probe not importable ({e})"]
    backend = "ort-cpu" if smoke else "torch-cuda"
    reason = backend_unavailable(backend)
    if reason:
        return [], [f"skipped GEMM probe: {reason}"]
    pairs, (b, s) = probe_pairs(smoke)
    shapes = [g for p in pairs for g in p[4] + p[5]]
    results = probe(shapes, backend=backend, rounds=rounds, dtype="fp16")
    by_id = {id(g): r for g, r in zip(shapes, results)}
    rows = []
    for model, what, o, p, orig, pad in pairs:
        # whole-pair time per round: the sum of its GEMMs, paired round by round
        o_s = [sum(x) for x in zip(*(by_id[id(g)].samples_ms for g in orig))]
        p_s = [sum(x) for x in zip(*(by_id[id(g)].samples_ms for g in pad))]
        useful = sum(g.flops for g in orig)
        waves = [by_id[id(g)].waves for g in orig + pad if g.label in ("lm_head", "up", "qkv")]
        note = f"useful TF/s {useful / statistics.median(o_s) / 1e9:.3g} -> " \
               f"{useful / statistics.median(p_s) / 1e9:.3g}"
        if all(w is not None for w in waves) and len(waves) == 2:
            note += f"; tiles {waves[0].tiles}->{waves[1].tiles} (wave eff. " \
                    f"{waves[0].efficiency:.2f}->{waves[1].efficiency:.2f})"
        rows.append(Row("probe", model, what, o, p, statistics.median(o_s),
                        statistics.median(p_s), _ratio(o_s, p_s), f"M={b}x{s}; {note}"))
    return rows, []


def export_pair(out: Path, smoke: bool) -> tuple[Path, Path]:
    """A GPT-2-small-shaped model (tiny with --smoke) with the original and the padded vocab."""
    from models.build import _gpt2, export

    dims = (2, 64, 4, 256) if smoke else (12, 768, 12, 3072)
    vocabs = (1000, 1024) if smoke else (50257, 50304)
    return tuple(export(_gpt2(*dims, vocab=v), "torchscript", out / f"gpt2-v{v}.onnx")
                 for v in vocabs)


def _time(runner, feed, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        runner.infer(feed)
    return (time.perf_counter() - t0) * 1e3 / reps


def run_e2e(smoke: bool, rounds: int, deadline: float,
            backends: list[str]) -> tuple[list[Row], list[str]]:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return [], [f"skipped end to end: exporting needs torch and transformers ({e.name} missing)"]
    from tuner.gate.feeds import make_feeds
    from tuner.runtime.base import SessionSettings
    from tuner.runtime.registry import get_backend

    skipped, usable = [], []
    for name in backends:
        ok, reason = get_backend(name).available()
        (usable.append(name) if ok else skipped.append(f"skipped end to end {name}: {reason}"))
    if not usable:
        return [], skipped
    bucket = (1, 32) if smoke else (4, 256)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        orig, pad = export_pair(Path(tmp), smoke)
        for name in usable:
            if time.monotonic() > deadline:
                skipped.append(f"skipped end to end {name}: out of the time budget")
                continue
            b = get_backend(name)
            cache = Path(tmp) / "cache"
            try:
                ro = b.load(orig, SessionSettings(), [bucket], cache)
                rp = b.load(pad, SessionSettings(), [bucket], cache)
            except Exception as e:  # noqa: BLE001 - report and go on with the next backend
                skipped.append(f"failed end to end {name}: {type(e).__name__}: {e}")
                continue
            fo = make_feeds(orig, 1000, [bucket])[0]
            reps = max(1, int(0.05 / max(_time(ro, fo, 1) * 1e-3, 1e-5)))  # ~50 ms a sample
            o_s, p_s = [], []
            for r in range(rounds):  # alternate which goes first
                pair = [(ro, o_s), (rp, p_s)] if r % 2 == 0 else [(rp, p_s), (ro, o_s)]
                for runner, out in pair:
                    out.append(_time(runner, fo, reps))
            info = getattr(ro, "info", {})
            note = ", ".join(f"{k}={v}" for k, v in info.items()
                             if k in ("cuda_graph", "cuda_graph_off", "profiles", "built"))
            rows.append(Row("e2e", "gpt2-small" if not smoke else "tiny", f"vocab on {name}",
                            str(1000 if smoke else 50257), str(1024 if smoke else 50304),
                            statistics.median(o_s), statistics.median(p_s), _ratio(o_s, p_s),
                            f"bucket {bucket[0]}x{bucket[1]}; {note}".rstrip("; ")))
    return rows, skipped


# ---------------------------------------------------------------------------------------------
# Part 3: whole models in torch (transformers, random weights), no export, no ONNX Runtime


@dataclass(frozen=True)
class TorchPair:
    model: str
    what: str
    original: str
    padded: str
    build: Callable[[str], Any]  # label (original or padded) -> module, on torch's default device
    batch: int
    seq: int
    vocab: int  # input ids are drawn below this (the smaller vocab of the pair)
    note: str


def torch_pairs(smoke: bool) -> list[TorchPair]:
    """GPT-2 small with vocab 50257 vs 50304; a Pythia-2.8B layer stack with 32 heads of 80
    vs 20 heads of 128 (same h, same parameter count). Tiny versions with --smoke."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXModel

    g_h, g_l, g_a = (64, 2, 4) if smoke else (768, 12, 12)
    n_h, n_l, n_f, n_v = (64, 2, 256, 1024) if smoke else (2560, NEOX_LAYERS, 10240, 50304)
    heads = ("4", "2") if smoke else ("32", "20")
    vocabs = ("1000", "1024") if smoke else ("50257", "50304")

    def gpt2(v: str):
        return GPT2LMHeadModel(GPT2Config(vocab_size=int(v), n_embd=g_h, n_layer=g_l, n_head=g_a,
                                          n_positions=1024, attn_implementation="sdpa"))

    def neox(a: str):
        return GPTNeoXModel(GPTNeoXConfig(
            vocab_size=n_v, hidden_size=n_h, num_hidden_layers=n_l, num_attention_heads=int(a),
            intermediate_size=n_f, max_position_embeddings=2048, attn_implementation="sdpa"))

    gb, gs = (1, 16) if smoke else (8, 512)
    nb, ns = (1, 32) if smoke else (4, 2048)
    return [
        TorchPair("tiny" if smoke else "gpt2-small", "vocab, whole LM", *vocabs, gpt2, gb, gs,
                  int(vocabs[0]), f"{g_l} layers + head"),
        TorchPair("tiny" if smoke else "pythia-2.8b", "heads (head dim), layer stack",
                  f"{heads[0]}x{n_h // int(heads[0])}", f"{heads[1]}x{n_h // int(heads[1])}",
                  lambda label: neox(label.split("x")[0]), nb, ns, n_v,
                  f"{n_l} layers, no head" if smoke else f"{n_l} of its 32 layers, no head"),
    ]


def _forward_timer(model, ids, cuda: bool) -> Callable[[int], float]:
    """ms per forward over `reps` calls: CUDA events on the GPU, the wall clock on the CPU."""
    import torch

    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(reps: int) -> float:
        if not cuda:
            t0 = time.perf_counter()
        else:
            start.record()
        for _ in range(reps):
            model(input_ids=ids, use_cache=False)
        if not cuda:
            return (time.perf_counter() - t0) * 1e3 / reps
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / reps

    return run


def _time_pair(pair: TorchPair, device, dtype, rounds: int, min_sample_ms: float) -> Row:
    import torch

    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, pair.vocab, (pair.batch, pair.seq), generator=gen).to(device)
    timers, impl = [], ""
    for label in (pair.original, pair.padded):
        torch.manual_seed(0)
        with device:  # initialise the random weights where they will run (fast on a GPU)
            model = pair.build(label)
        model = model.to(dtype=dtype).eval()
        impl = getattr(model.config, "_attn_implementation", "") or ""
        timers.append(_forward_timer(model, ids, cuda))
    per_call = min(timers[0](1) for _ in range(3))  # warm-up (kernels picked, memory pooled)
    for _ in range(3):
        timers[1](1)
    reps = max(1, math.ceil(min_sample_ms / max(per_call, 1e-6)))
    o_s, p_s = [], []
    for r in range(rounds):  # alternate which goes first
        order = [(timers[0], o_s), (timers[1], p_s)]
        for timer, out in (order if r % 2 == 0 else order[::-1]):
            out.append(timer(reps))
    tokens = pair.batch * pair.seq
    o_ms, p_ms = statistics.median(o_s), statistics.median(p_s)
    note = (f"{'fp16 CUDA events' if cuda else 'fp32 CPU clock'}, batch {pair.batch}x{pair.seq}, "
            f"{pair.note}, attn {impl}; tok/s {tokens / o_ms * 1e3:.4g} -> {tokens / p_ms * 1e3:.4g}")
    return Row("torch", pair.model, pair.what, pair.original, pair.padded, o_ms, p_ms,
               _ratio(o_s, p_s), note)


def run_torch(smoke: bool, rounds: int) -> tuple[list[Row], list[str]]:
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        return [], [f"skipped torch end to end: needs torch and transformers ({e.name} missing)"]
    if smoke:
        device, dtype, min_ms = torch.device("cpu"), torch.float32, 5.0
    elif torch.cuda.is_available():
        device, dtype, min_ms = torch.device("cuda"), torch.float16, 20.0
    else:
        return [], [f"skipped torch end to end: no CUDA GPU visible to torch {torch.__version__}"]
    rows, skipped = [], []
    for pair in torch_pairs(smoke):
        try:
            with torch.inference_mode():
                rows.append(_time_pair(pair, device, dtype, rounds, min_ms))
        except Exception as e:  # noqa: BLE001 - report (e.g. out of memory) and go on
            skipped.append(f"failed torch end to end {pair.model} {pair.what}: "
                           f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows, skipped


def render(rows: list[Row], skipped: list[str], header: str) -> str:
    cols = ["part", "model", "what", "orig", "padded", "orig ms", "padded ms",
            "speedup [min, max]", "note"]
    table = []
    for r in rows:
        ratio = "" if r.ratio is None else f"{r.ratio[0]:.3f} [{r.ratio[1]:.3f}, {r.ratio[2]:.3f}]"
        table.append([r.part, r.model, r.what, r.original, r.padded,
                      "" if r.orig_ms is None else f"{r.orig_ms:.4f}",
                      "" if r.pad_ms is None else f"{r.pad_ms:.4f}", ratio, r.note])
    widths = [max([len(c)] + [len(t[i]) for t in table]) for i, c in enumerate(cols)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [header, "", line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(t) for t in table] or ["(no rows: every part was skipped, see below)"]
    out += [""] + [f"- {s}" for s in skipped]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the CPU (ort-cpu): checks the script, measures nothing")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15; 3 smoke)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="stop starting end-to-end backends after this many seconds")
    p.add_argument("--backends", default="ort-cuda,ort-cuda-fp16,ort-trt,trt,trt-fp16",
                   help="end-to-end backends (comma-separated); --smoke uses ort-cpu")
    a = p.parse_args(argv)
    start = time.monotonic()
    rounds = a.rounds or (3 if a.smoke else 15)
    from tuner.hardware.detect import detect

    dev = detect()
    rows, skipped = run_probe(a.smoke, rounds)
    backends = ["ort-cpu"] if a.smoke else [b.strip() for b in a.backends.split(",") if b.strip()]
    torch_rows, torch_skipped = run_torch(a.smoke, rounds)
    e2e_rows, e2e_skipped = run_e2e(a.smoke, rounds, start + a.budget_s, backends)
    when = time.strftime("%Y-%m-%d")
    header = (f"GPU check {when} on {dev.label}; driver {dev.driver}, CUDA {dev.cuda_driver}, "
              f"onnxruntime {dev.onnxruntime}, tensorrt {dev.tensorrt}, torch {dev.torch}; "
              f"{rounds} rounds, {time.monotonic() - start:.0f} s"
              + (" (SMOKE: tiny shapes on the CPU, not a measurement)" if a.smoke else ""))
    print(render(rows + torch_rows + e2e_rows, skipped + torch_skipped + e2e_skipped, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
