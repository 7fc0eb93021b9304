"""models/venvs.py, the tool environments (Optimum, onnxruntime-genai, the LLM benchmarking
tools): a caller waits for a build under way in another process instead of making a copy of
its own (how the suite's background builder and the tests share them), a made environment
is not started again, and a build pip refuses leaves nothing behind."""

from __future__ import annotations

import subprocess
import time

import pytest

from models import venvs

PIP_ONLY = ["pip"]  # in every new environment already: nothing to download


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SHAPETUNER_CACHE", str(tmp_path))  # the builder process inherits it
    return tmp_path / "venvs"


def _under_way(cache, root, timeout: float = 60) -> None:
    """Until another process is building `root` (its temporary folder is there)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.is_dir() for p in cache.glob(f".{root.name}.*")):
            return
        time.sleep(0.02)
    raise AssertionError("the background builder never started")


def test_a_second_caller_waits_for_the_build_under_way(cache, monkeypatch) -> None:
    root = venvs.venv_dir("probe", PIP_ONLY)
    builder = venvs.build_in_background([("probe", PIP_ONLY)])
    assert builder is not None
    _under_way(cache, root)

    def second_build(*args):
        raise AssertionError("ensure_venv built a second copy instead of waiting")

    monkeypatch.setattr(venvs, "_build", second_build)
    python = venvs.ensure_venv("probe", PIP_ONLY)
    assert builder.wait(120) == 0
    assert subprocess.run([str(python), "-c", "import pip"]).returncode == 0
    assert sorted(p.name for p in cache.iterdir()) == sorted([root.name, f".{root.name}.lock"])
    assert venvs.build_in_background([("probe", PIP_ONLY)]) is None  # made: nothing to start


def test_a_build_pip_refuses_leaves_nothing(cache, tmp_path) -> None:
    missing = str(tmp_path / "no-such-package")  # a local path: pip refuses it at once
    with pytest.raises(RuntimeError, match="pip could not install"):
        venvs.ensure_venv("broken", [missing])
    assert [p.name for p in cache.iterdir()] == [f".{venvs.venv_dir('broken', [missing]).name}"
                                                 ".lock"]
