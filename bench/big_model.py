"""Benchmark: the tuner's commands on a model past protobuf's 2 GB limit, timed and weighed.

    .venv/bin/python bench/big_model.py                      # Pythia-2.8B shape, 8 layers (~3.5 GB)
    .venv/bin/python bench/big_model.py --dtypes fp16        # the ~1.8 GB half-precision export
    .venv/bin/python bench/big_model.py --smoke              # the same steps on a tiny shape
    .venv/bin/python bench/big_model.py --layouts per-tensor --steps pad verify

Each external-data layout exporters write (LAYOUTS: one `model.onnx.data` file, one
`model.onnx_data` file, one file per tensor) gets its own fp32 copy of the export and its
own rows for inspect, pad and verify, and a last table puts their peaks side by side.

Builds an 8-layer slice of Pythia-2.8B's shape (GPT-NeoX: hidden 2560, 32 heads of head dim 80,
FFN 10240, vocab 50277, partial rotary 0.25) with random weights, exports it with
torch.onnx.export (TorchScript) to external data (one `model.onnx.data` file beside the graph),
cached under --workdir by config, then runs `tuner inspect`, `pad`, `verify` and `optimize`,
each in its own process, and prints per step the wall time, the peak resident memory of that
process (os.wait4's rusage, so each step is weighed alone), the peak over the model's bytes
and the exit code (negative: killed by that signal; -9 is usually the OOM killer, or this
script's own guard, which kills a step when the machine's available memory runs low).

Measured on the project's 2-core, 24 GB machine (shared, so wall times vary by ~30%),
`bench/big_model.py --workdir /tmp/shapetuner-big` (optimize: 5 rounds, seq <= 64, batch 1):

    step       fp32 3.55 GB, before     fp32 after           fp16 1.77 GB, after
    inspect    1.8 s    0.84 GB         5.0 s    0.49 GB     2.6 s    0.49 GB
    pad        32.4 s   9.29 GB (2.6x)  61.4 s   4.47 GB     50.8 s   4.54 GB
    verify     15.8 s   7.94 GB (2.2x)  34.5 s   4.42 GB     22.0 s   4.44 GB
    optimize   SIGKILL (ORT fusion)     150.7 s  10.30 GB    178.2 s  13.63 GB

"Before" is the code before the memory work: pad and verify held the original's and the
variant's sessions at once, and optimize ran ORT's fusion in-process (its peak is ~10x the
model: one layer of this shape, 1.34 GB, peaked at 13.3 GB). With the gate alone fixed, fp16
optimize still died at 23.2 GB: the fusion's freed memory stayed in the process, then four
sessions were loaded. "After": one session at a time in the gate, fusion skipped when it
cannot fit (fp32: "needs about 36.5 GB ... 21.7 GB is available") or run in a child process
(fp16: fused, and selected at 1.24x [1.20, 1.40]), and the variants' sessions loaded only
while they fit (tuner/runtime/memory.py). Wall times follow the load on the shared machine
(load average 3.7 on 2 cores during the "after" run); the changes add no inference work, and
verify with and without the big-model session options ran 25.1 s and 18.8 s back to back,
at the same peak. ONNX Runtime's CPU provider casts fp16 weights to fp32, so an fp16 session
weighs about 2.5x its file.
Over 400 lines on purpose: a benchmark is one file a user runs and reads top to bottom.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parent.parent
SEED = 0
DATA_NAME = "model.onnx.data"
STEPS = ("inspect", "pad", "verify", "optimize")
# How the weights lie beside the graph, as exporters write them: one file (onnx's
# `model.onnx.data`, this bench's own), `model.onnx_data` (torch's dynamo exporter, Optimum),
# one file per tensor (torch.onnx.export's TorchScript path past 2 GB). pad and verify are
# weighed on each; optimize on the first.
LAYOUTS = ("one-file", "onnx_data", "per-tensor")
LAYOUT_STEPS = ("inspect", "pad", "verify")
IR_VERSION = 10  # onnxruntime >= 1.20 reads IR 10 (models/build.py)

# GPT-NeoX configs: Pythia-2.8B's shape (hidden 2560, 32 x 80 heads), cut to 8 layers; the
# smoke shape keeps head dim 80, partial rotary and an odd vocabulary, at a few MB.
CONFIGS: dict[str, dict[str, Any]] = {
    "pythia-2.8b-8l": dict(num_hidden_layers=8, hidden_size=2560, num_attention_heads=32,
                           intermediate_size=10240, vocab_size=50277, rotary_pct=0.25,
                           max_position_embeddings=2048, tie_word_embeddings=False),
    # between the two: a few hundred MB, where peak / model is already the big run's story
    "mid": dict(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16,
                intermediate_size=4096, vocab_size=50277, rotary_pct=0.25,
                max_position_embeddings=2048, tie_word_embeddings=False),
    "smoke": dict(num_hidden_layers=2, hidden_size=160, num_attention_heads=2,
                  intermediate_size=640, vocab_size=1003, rotary_pct=0.25,
                  max_position_embeddings=256, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class StepResult:
    step: str
    wall_s: float
    peak_rss_bytes: int
    rc: int
    log: str  # where its stdout and stderr went
    killed_by: str = ""  # the bench's own guard: "timeout" or "memory guard: ..."

    def row(self, model_bytes: int) -> str:
        rc = str(self.rc) if self.rc >= 0 else f"{self.rc} ({signal.Signals(-self.rc).name})"
        rc += f", {self.killed_by}" if self.killed_by else ""
        gb = self.peak_rss_bytes / 1e9
        return (f"| {self.step} | {self.wall_s:.1f} | {gb:.2f} | "
                f"{self.peak_rss_bytes / max(model_bytes, 1):.2f}x | {rc} |")


# ---------------------------------------------------------------------------------------------
# Export


def export_key(config: dict[str, Any], dtype: str) -> str:
    """The cache key of one export: config, dtype, seed, torch and transformers versions
    (read from the installed metadata: importing torch would weigh this process, whose
    children's memory is measured, by half a GB)."""
    from importlib.metadata import version

    payload = json.dumps([config, dtype, SEED, version("torch"), version("transformers")],
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def model_bytes(path: Path) -> int:
    """The graph file and every external data file beside it."""
    return sum(p.stat().st_size for p in path.parent.iterdir() if p.is_file())


def _torch_model(config: dict[str, Any]):
    import torch
    import transformers

    torch.manual_seed(SEED)
    cfg = transformers.GPTNeoXConfig(**config)
    return transformers.GPTNeoXForCausalLM(cfg).eval().float()


class _LogitsOnly:
    """(input_ids, attention_mask) -> logits, no cache: the signature the tuner's gate feeds."""

    def __new__(cls, model):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask):
                return self.model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False, return_dict=True).logits

        return Wrapped().eval()


def _save_one_data_file(proto, out: Path) -> None:
    import onnx

    proto.ir_version = min(proto.ir_version, IR_VERSION)
    onnx.save_model(proto, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=DATA_NAME, size_threshold=1024)


def _torch_export(config: dict[str, Any], out: Path) -> None:
    """fp32 through torch.onnx.export (TorchScript), rewritten as one graph + one data file
    (past 2 GB torch writes a file per tensor)."""
    import onnx
    import torch

    model = _LogitsOnly(_torch_model(config))
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, config["vocab_size"], (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.int64)
    raw = out.parent.parent / "raw" / "model.onnx"
    raw.parent.mkdir()
    with torch.no_grad():
        torch.onnx.export(model, (ids, mask), str(raw), dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], do_constant_folding=True,
                          dynamic_axes={"input_ids": {0: "batch", 1: "sequence"},
                                        "attention_mask": {0: "batch", 1: "sequence"},
                                        "logits": {0: "batch", 1: "sequence"}})
    del model
    _save_one_data_file(onnx.load(str(raw), load_external_data=True), out)
    shutil.rmtree(raw.parent)  # the disk holds one more copy at a time, not two


def _half(fp32: Path, out: Path) -> None:
    """fp16 from the fp32 export with ONNX Runtime's converter: torch's TorchScript export of
    a .half() GPT-NeoX on the CPU mixes float and float16 at LayerNormalization, which ONNX
    Runtime refuses to load."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = onnx.load(str(fp32), load_external_data=True)
    _save_one_data_file(convert_float_to_float16(proto, keep_io_types=False,
                                                 disable_shape_infer=True), out)


def export_path(config: dict[str, Any], dtype: str, workdir: Path,
                layout: str = LAYOUTS[0]) -> Path:
    tail = "" if layout == LAYOUTS[0] else f"-{layout}"
    return workdir / f"neox-{dtype}-{export_key(config, dtype)}{tail}" / "model.onnx"


def _relayout(source: Path, layout: str, out: Path) -> None:
    """The one-file export's weights written in another external-data layout."""
    import onnx

    proto = onnx.load(str(source), load_external_data=True)
    if layout == "per-tensor":
        onnx.save_model(proto, str(out), save_as_external_data=True,
                        all_tensors_to_one_file=False, size_threshold=1024)
    else:
        onnx.save_model(proto, str(out), save_as_external_data=True,
                        all_tensors_to_one_file=True, location="model.onnx_data",
                        size_threshold=1024)


def _is_built(path: Path) -> bool:
    """The folder is renamed into place whole: a graph there has its data beside it."""
    return path.exists() and any(p != path for p in path.parent.iterdir())


def export(config: dict[str, Any], dtype: str, workdir: Path, layout: str = LAYOUTS[0]) -> Path:
    """The cached export for (config, dtype, layout) under workdir, built on first use (fp16
    from the fp32 one, other layouts from the one-file one)."""
    path = export_path(config, dtype, workdir, layout)
    if _is_built(path):
        return path
    if layout != LAYOUTS[0]:
        source = export(config, dtype, workdir)
    else:
        source = export(config, "fp32", workdir) if dtype == "fp16" else None
    workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir, prefix=".export-") as tmp:
        final = Path(tmp) / "final" / "model.onnx"
        final.parent.mkdir()
        if source is None:
            _torch_export(config, final)
        elif layout != LAYOUTS[0]:
            _relayout(source, layout, final)
        else:
            _half(source, final)
        if path.parent.exists():
            shutil.rmtree(path.parent)
        os.replace(final.parent, path.parent)
    return path


# ---------------------------------------------------------------------------------------------
# Steps


def mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _Guard:
    """Kills the child on timeout, or when the machine's available memory falls below a
    floor: the host is shared, and the kernel's OOM killer might pick someone else."""

    def __init__(self, pid: int, timeout_s: float, floor_bytes: int) -> None:
        self.pid, self.deadline, self.floor = pid, time.monotonic() + timeout_s, floor_bytes
        self.reason = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.25):
            avail = mem_available_bytes()
            if time.monotonic() > self.deadline:
                self.reason = "timeout"
            elif avail is not None and avail < self.floor:
                self.reason = f"memory guard: {avail / 1e9:.1f} GB available"
            else:
                continue
            os.kill(self.pid, signal.SIGKILL)  # not yet reaped: the pid is still the child's
            return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_step(name: str, argv: Sequence[str], log: Path, timeout_s: float,
             floor_bytes: int = 0) -> StepResult:
    """Run one command in a child process; wall time and that child's own peak RSS.

    os.wait4 returns the rusage of exactly this child, unlike getrusage(RUSAGE_CHILDREN),
    which is the maximum over every child waited for so far. The caller must stay small:
    Linux carries the parent's high-water RSS into the child's ru_maxrss at exec (fork or
    spawn alike), so a child weighs at least its parent; this script imports neither torch
    nor onnxruntime for that reason, and `table` prints its own peak as the floor."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with log.open("w") as out:
        actions = [(os.POSIX_SPAWN_DUP2, out.fileno(), 1), (os.POSIX_SPAWN_DUP2, out.fileno(), 2)]
        t0 = time.perf_counter()
        pid = os.posix_spawn(argv[0], list(argv), env, file_actions=actions)
        guard = _Guard(pid, timeout_s, floor_bytes)
        try:
            _, status, usage = os.wait4(pid, 0)
        finally:
            guard.stop()
        wall = time.perf_counter() - t0
    rc = os.waitstatus_to_exitcode(status)
    return StepResult(name, wall, usage.ru_maxrss * 1024, rc, str(log), guard.reason)


def steps(model: Path, dtype: str, work: Path, rounds: int) -> list[tuple[str, list[str]]]:
    """The four commands, as a user would type them."""
    tuner = [sys.executable, "-m", "tuner"]
    padded = work / "padded" / "model.onnx"
    tol = ["--atol", "1e-2", "--rtol", "1e-2"] if dtype == "fp16" else []
    return [
        ("inspect", [*tuner, "inspect", str(model), "--json"]),
        ("pad", [*tuner, "pad", str(model), "-o", str(padded), "--vocab-multiple", "64",
                 "--head-dim", "128", "--force", *tol]),
        ("verify", [*tuner, "verify", str(model), str(padded),
                    *(["--fp16"] if dtype == "fp16" else [])]),
        ("optimize", [*tuner, "optimize", str(model), "-o", str(work / "artifact"), "--force",
                      "--rounds", str(rounds), "--warmup", "1", "--bucket-rounds", "1",
                      "--max-seq", "64", "--max-batch", "1", "--no-cache", *tol]),
    ]


def run_all(model: Path, dtype: str, work: Path, a: argparse.Namespace) -> list[StepResult]:
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: list[StepResult] = []
    for name, argv in steps(model, dtype, work, a.rounds):
        if name not in a.steps:
            continue
        if name == "verify" and not (work / "padded" / "model.onnx").exists():
            continue  # no padded model to verify
        print(f"$ {' '.join(argv)}", flush=True)
        r = run_step(name, argv, logs / f"{name}.log", a.timeout, int(a.min_available_gb * 1e9))
        print(f"  {name}: {r.wall_s:.1f} s, peak {r.peak_rss_bytes / 1e9:.2f} GB, rc {r.rc} "
              f"{r.killed_by}", flush=True)
        results.append(r)
    return results


def own_peak_bytes() -> int:
    """The high-water RSS of this process's own memory (VmHWM), the least any step can
    measure (see run_step). Not ru_maxrss: that includes what this process inherited from
    its own parent at exec."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def table(label: str, size: int, results: Sequence[StepResult]) -> str:
    lines = [f"{label}: model {size / 1e9:.2f} GB (graph + external data); measured from a "
             f"parent of {own_peak_bytes() / 1e9:.2f} GB (the floor of every peak)", "",
             "| step | wall s | peak RSS GB | peak / model | rc |", "|---|---|---|---|---|"]
    lines += [r.row(size) for r in results]
    return "\n".join(lines)


def _free_gb(path: Path) -> float:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free / 1e9


def _args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "shapetuner-big")
    p.add_argument("--smoke", action="store_true", help="a tiny shape: the same steps in seconds")
    p.add_argument("--mid", action="store_true", help="a ~0.6 GB shape: the ratios in minutes")
    p.add_argument("--dtypes", nargs="+", choices=("fp32", "fp16"), default=["fp32", "fp16"])
    # 5: fewer paired rounds and optimize keeps the original without comparing ("too few")
    p.add_argument("--rounds", type=int, default=5, help="optimize's timing rounds")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per step")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                   help="external-data layouts to weigh pad and verify on (fp32)")
    p.add_argument("--min-available-gb", type=float, default=1.5,
                   help="kill a step when the machine's available memory falls below this")
    p.add_argument("--build", choices=("fp32", "fp16"), help=argparse.SUPPRESS)  # the child
    p.add_argument("--build-layout", choices=LAYOUTS, default=LAYOUTS[0], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _built(config: dict[str, Any], dtype: str, a: argparse.Namespace, logs: Path,
           layout: str = LAYOUTS[0]) -> tuple[Path, StepResult | None]:
    """The export, built in a child process (measured like the steps) unless cached."""
    path = export_path(config, dtype, a.workdir, layout)
    if _is_built(path):
        return path, None
    argv = [sys.executable, str(Path(__file__).resolve()), "--build", dtype, "--build-layout",
            layout, "--workdir", str(a.workdir), *(["--smoke"] if a.smoke else []),
            *(["--mid"] if a.mid else [])]
    what = f"export {dtype}" + ("" if layout == LAYOUTS[0] else f" {layout}")
    print(f"$ {' '.join(argv)}", flush=True)
    r = run_step(what, argv, logs / f"{what.replace(' ', '-')}.log", a.timeout,
                 int(a.min_available_gb * 1e9))
    if r.rc != 0:
        raise SystemExit(f"{what} failed (rc {r.rc}); see {r.log}")
    return path, r


def layout_table(report: dict[str, Any]) -> str:
    """pad's and verify's peaks over the model's bytes, one row per (dtype, layout)."""
    lines = ["| export | layout | model GB | pad peak / model | verify peak / model |",
             "|---|---|---|---|---|"]
    for key, r in report.items():
        peaks = {s["step"]: s["peak_rss_bytes"] / r["model_bytes"] for s in r["steps"]}
        dtype, _, layout = key.partition(" ")
        cells = [f"{peaks[s]:.2f}x" if s in peaks else "-" for s in ("pad", "verify")]
        lines.append(f"| {dtype} | {layout or LAYOUTS[0]} | {r['model_bytes'] / 1e9:.2f} | "
                     f"{' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    a = _args(argv)
    name = "smoke" if a.smoke else "mid" if a.mid else "pythia-2.8b-8l"
    config = CONFIGS[name]
    if a.build:
        print(export(config, a.build, a.workdir, a.build_layout))
        return 0
    # fp32 weights take 4 bytes each; export + consolidation hold about three copies on disk
    need_gb = 0.0 if a.smoke else 3 * 0.7 if a.mid else 3 * 3.6
    if _free_gb(a.workdir) < need_gb:
        print(f"not enough disk under {a.workdir}: {_free_gb(a.workdir):.1f} GB free, "
              f"need about {need_gb:.0f} GB", file=sys.stderr)
        return 2
    logs = a.workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    runs = [(d, LAYOUTS[0]) for d in a.dtypes]
    runs += [("fp32", lay) for lay in a.layouts if lay != LAYOUTS[0] and "fp32" in a.dtypes]
    for dtype, layout in runs:
        model, built = _built(config, dtype, a, logs, layout)
        steps_wanted = a.steps if layout == LAYOUTS[0] else [s for s in a.steps
                                                             if s in LAYOUT_STEPS]
        results = run_all(model, dtype, model.parent.parent / f"{model.parent.name}-run",
                          argparse.Namespace(**{**vars(a), "steps": steps_wanted}))
        results = ([built] if built else []) + results
        size = model_bytes(model)
        key = dtype if layout == LAYOUTS[0] else f"{dtype} {layout}"
        print("\n" + table(f"{name} {key}", size, results) + "\n", flush=True)
        report[key] = {"model": str(model), "model_bytes": size, "layout": layout,
                       "steps": [asdict(r) for r in results]}
    print(layout_table(report) + "\n", flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    failed = [f"{key} {s['step']}: rc {s['rc']} {s['killed_by']} (log {s['log']})"
              for key, r in report.items() for s in r["steps"] if s["rc"] != 0]
    for line in failed:
        print(f"failed: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
