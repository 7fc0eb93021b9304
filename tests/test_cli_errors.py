"""Usage errors from the parser (unknown command or flag, missing argument, value out of range)
are bad input: exit 2 with one line on stderr, never a traceback and exit 1. Found with typer
0.29, which raises its own vendored click exceptions that an isinstance check on click's
classes let through as internal errors."""

from __future__ import annotations

import pytest

from tuner.cli import main


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
