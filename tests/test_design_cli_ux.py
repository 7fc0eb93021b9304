"""`tuner design` flags a user gets wrong: an explicit 0 for --seq/--batch/--rounds is refused
(it used to fall back to the default silently), --threads names itself, and a search where no
other shape fits the target says so instead of "no shape measured faster"."""

from __future__ import annotations

import pytest

from tuner.cli import main


@pytest.mark.parametrize("flag, value, message", [
    ("--seq", "0", "seq=0"),
    ("--batch", "0", "batch=0"),
    ("--rounds", "0", "got 0"),
    ("--threads", "-1", "--threads must be >= 0"),
])
def test_explicit_bad_measurement_flags_exit_2(flag, value, message, capsys):
    assert main(["design", "--params", "1.25e8", flag, value, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_only_the_start_measured_says_nothing_else_fits(reference_model, capsys):
    # GPT-2 awkward: 8.6M parameters, most in the 50257 x 160 embedding; no h in multiples of
    # 64 lands within 5% (h=128: -20%, h=192: +20%), so only the start is measured
    src = reference_model("gpt2", "awkward", "torchscript")
    assert main(["design", "--from", str(src), "--rounds", "3", "--seq", "16",
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "the only shape measured" in out and "widen --tolerance" in out
    assert "no shape measured faster" not in out
