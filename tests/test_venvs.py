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


def test_an_environment_keeps_its_bytecode_where_the_caller_forbids_it(cache, tmp_path) -> None:
    """With PYTHONDONTWRITEBYTECODE set (this machine's and CI's environment) a tool would
    compile torch and transformers again in every process: ours cache theirs all the same."""
    python = venvs.ensure_venv("probe", PIP_ONLY)
    module = tmp_path / "probe_module.py"
    module.write_text("X = 1\n")
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([str(python), "-c", "import probe_module"], cwd=tmp_path, env=env)
    assert run.returncode == 0
    assert list((tmp_path / "__pycache__").glob("probe_module.*.pyc"))
    bare = tmp_path / "bare"  # the same run without the environment's line writes none
    bare.mkdir()
    (bare / "probe_module.py").write_text("X = 1\n")
    subprocess.run([str(python), "-S", "-c", "import probe_module"], cwd=bare, env=env,
                   check=True)
    assert not (bare / "__pycache__").exists()
