"""Usage errors from the parser (unknown command or flag, missing argument, value out of range)
are bad input: exit 2 with one line on stderr, never a traceback and exit 1. Found with typer
0.29, which raises its own vendored click exceptions that an isinstance check on click's
classes let through as internal errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tuner.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, expected", [
    (["bogus"], "No such command 'bogus'"),
    (["inspect"], "'model'"),
    (["inspect", "--bogus", "x.onnx"], "No such option: --bogus"),
    (["inspect", "x.onnx", "--tokens", "0"], "--tokens"),
    (["inspect", "x.onnx", "--tokens", "abc"], "--tokens"),
    (["optimize", "x.onnx"], "--out"),
])
def test_usage_errors_exit_2_with_one_line(argv, expected, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tuner: error: ") and expected in lines[0]
    # the help to read: the command's own, or the top level's for a command that does not exist
    command = "" if argv[0] == "bogus" else f" {argv[0]}"
    assert lines[0].endswith(f"(see 'tuner{command} --help')"), lines[0]


def test_bare_tuner_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Commands:" in err and "optimize" in err


def test_help_exits_0(capsys):
    assert main(["inspect", "--help"]) == 0
    assert "--json" in capsys.readouterr().out


def test_version_prints_the_installed_version_and_exits_0(capsys):
    from importlib import metadata

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tuner (shapetuner) {metadata.version('shapetuner')}\n"


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_the_cli_starts_without_the_heavy_packages():
    """Each command imports its work when it runs: `tuner --help` (and any command's start)
    loads none of onnx, onnxruntime, numpy or the server."""
    out = _fresh_python("import sys, tuner.cli; print(sorted(m for m in ('numpy', 'onnx', "
                        "'onnx_ir', 'onnxruntime', 'grpc', 'serving', 'torch') "
                        "if m in sys.modules))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_serving_dependency_that_does_not_import_is_one_line(tmp_path):
    """`tuner serve` with grpc unimportable (as a protobuf too new for the stubs leaves it):
    exit 2 naming the package and the fix, and the other commands still run."""
    code = (f"import sys; sys.modules['grpc'] = None\n"
            f"from tuner.cli import main\n"
            f"assert main(['inspect', '--help']) == 0\n"
            f"sys.exit(main(['serve', {str(tmp_path)!r}]))")
    out = _fresh_python(code)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("tuner: error: tuner serve cannot start: the serving dependency "
                           "grpcio does not import") and "fix: pip install" in line, line
