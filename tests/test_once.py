"""models/once.py: two processes that want one cached thing build it once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# a process that builds `target` (slowly) unless it is there, counting its builds in `log`
BUILDER = """
import sys, time
from pathlib import Path
from models.once import build_once

target, log = Path(sys.argv[1]), Path(sys.argv[2])

def build():
    with log.open("a") as f:
        f.write("built\\n")
    time.sleep(1.0)
    target.write_text("done")

build_once(target, target.exists, build)
print(target.read_text())
"""


def test_a_second_process_waits_for_the_first_build_and_builds_nothing(tmp_path: Path) -> None:
    target, log = tmp_path / "deep" / "model.onnx", tmp_path / "builds.log"
    root = Path(__file__).resolve().parent.parent
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(target), str(log)], cwd=root,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["done\n", "done\n"]  # the waiting one read the other's build
    assert log.read_text() == "built\n"  # once, not twice


def test_a_failed_build_leaves_the_next_caller_free_to_build(tmp_path: Path) -> None:
    from models.once import build_once

    target = tmp_path / "model.onnx"

    def fail() -> None:
        raise RuntimeError("exporter crashed")

    with pytest.raises(RuntimeError, match="exporter crashed"):
        build_once(target, target.exists, fail)
    build_once(target, target.exists, lambda: target.write_text("x"))
    assert target.read_text() == "x"
    built = []
    build_once(target, target.exists, lambda: built.append(1))  # there now: nothing runs
    assert built == []
