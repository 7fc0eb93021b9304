"""bench/big_model.py: each step is weighed alone, the guard kills what would starve the host,
and --smoke runs the whole benchmark (export fp32 and fp16, inspect, pad, verify, optimize)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("big_model", ROOT / "bench" / "big_model.py")
big = importlib.util.module_from_spec(spec)
sys.modules["big_model"] = big  # dataclasses resolve their module through sys.modules
spec.loader.exec_module(big)

ALLOC = "import time; b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); time.sleep({t})"


def test_each_step_reports_its_own_peak_memory():
    # from a fresh, small process, as the bench runs: a child inherits its parent's peak RSS
    # (this pytest process has loaded models), so it cannot be measured from here
    probe = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("big_model", {str(ROOT / "bench" / "big_model.py")!r})
big = importlib.util.module_from_spec(spec); sys.modules["big_model"] = big
spec.loader.exec_module(big)
fat = big.run_step("fat", [sys.executable, "-c", {ALLOC.format(n=300_000_000, t=0)!r}], big.Path("/dev/null"), 60)
thin = big.run_step("thin", [sys.executable, "-c", "pass"], big.Path("/dev/null"), 60)
print(json.dumps([fat.rc, fat.peak_rss_bytes, thin.rc, thin.peak_rss_bytes, big.own_peak_bytes()]))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    fat_rc, fat, thin_rc, thin, parent = json.loads(out.stdout.splitlines()[-1])
    assert fat_rc == 0 and thin_rc == 0
    assert fat > 300e6
    assert thin < 100e6 and parent < 100e6  # not the maximum over every child so far


def test_the_guard_kills_on_timeout_and_on_low_memory(tmp_path):
    slow = big.run_step("slow", [sys.executable, "-c", "import time; time.sleep(30)"],
                        tmp_path / "slow.log", 0.5)
    assert slow.rc == -9 and slow.killed_by == "timeout" and slow.wall_s < 10
    starved = big.run_step("starved", [sys.executable, "-c", "import time; time.sleep(30)"],
                           tmp_path / "starved.log", 60, floor_bytes=10**15)
    assert starved.rc == -9 and starved.killed_by.startswith("memory guard")
    assert "-9 (SIGKILL), memory guard" in starved.row(10**9)


def test_smoke_runs_every_step(tmp_path):
    out = tmp_path / "results.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "big_model.py"), "--smoke",
                        "--workdir", str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    # fp32 and fp16 in one external-data file; fp32 also in the other layouts exporters write
    assert set(report) == {"fp32", "fp16", "fp32 onnx_data", "fp32 per-tensor"}
    for key, res in report.items():
        names = [s["step"] for s in res["steps"]]
        model = Path(res["model"])
        if " " in key:  # pad and verify weighed on each layout
            assert names == [f"export {key}", "inspect", "pad", "verify"]
            data = {p.name for p in model.parent.iterdir()} - {"model.onnx"}
            assert data == {"model.onnx_data"} if key.endswith("onnx_data") else len(data) > 5
        else:
            assert names == [f"export {key}", "inspect", "pad", "verify", "optimize"]
            assert (model.parent / big.DATA_NAME).exists()  # external data, one file
        assert all(s["rc"] == 0 and s["peak_rss_bytes"] > 10e6 for s in res["steps"])
    assert "| export | layout | model GB | pad peak / model | verify peak / model |" in r.stdout
    assert "| step | wall s | peak RSS GB | peak / model | rc |" in r.stdout
    # the second run finds both exports in the cache and builds nothing
    again = subprocess.run([sys.executable, str(ROOT / "bench" / "big_model.py"), "--smoke",
                            "--workdir", str(tmp_path / "work"), "--steps", "inspect"],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "--build" not in again.stdout
