"""Output folders the user names (-o, --cache-dir): checked before any work, so that a folder
we cannot write is bad input (exit 2, one line) found in a second, not an OSError traceback
at the final rename after minutes of measuring."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tuner.errors import BadInput


def ensure_writable_dir(path: str | os.PathLike, what: str, hint: str = "") -> Path:
    """Create `path` (and its parents) if needed and prove a file can be made in it.

    `what` names what goes there ("artifact out/", "results cache"); `hint` is
    appended to it (say, which flag changes the place). Returns the path."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise BadInput(f"{p}: is a file, not a folder: cannot write the {what} there{hint}")
    try:
        p.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=p, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise BadInput(f"{p}: cannot write the {what} there ({e.strerror or e}){hint}") from None
    return p
