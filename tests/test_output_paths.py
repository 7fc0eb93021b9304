"""Output places a user names (-o, --cache-dir) that cannot be written are bad input found
before any work: exit 2 and one line, not an OSError traceback (exit 1) at the end."""

from __future__ import annotations

import pytest

from tuner.cli import main
from tuner.errors import BadInput
from tuner.util.files import ensure_writable_dir


def test_ensure_writable_dir(tmp_path):
    (tmp_path / "f").write_text("x")
    assert ensure_writable_dir(tmp_path / "a" / "b", "thing") == tmp_path / "a" / "b"
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    with pytest.raises(BadInput, match="is a file, not a folder: cannot write the thing there"):
        ensure_writable_dir(tmp_path / "f", "thing")
    with pytest.raises(BadInput, match=r"cannot write the thing there \(.*\) \(hint\)"):
        ensure_writable_dir(tmp_path / "f" / "sub", "thing", " (hint)")


@pytest.mark.parametrize("cmd, message", [
    ("optimize-out", "cannot write the artifact o/ there"),
    ("optimize-cache", "cannot write the results cache there"),
    ("design-out", "cannot write the design report there"),
])
def test_unwritable_outputs_exit_2(reference_model, tmp_path, capsys, cmd, message):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    src = str(reference_model("bert", "small", "torchscript"))
    argv = {
        "optimize-out": ["optimize", src, "-o", str(blocker / "o"), "--no-cache", "-q"],
        "optimize-cache": ["optimize", src, "-o", str(tmp_path / "o"), "--cache-dir",
                           str(blocker), "-q"],
        "design-out": ["design", "--params", "1.25e8", "-o", str(blocker), "--quiet"],
    }[cmd]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]
