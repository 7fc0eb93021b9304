"""Files: folders the user names, atomic writes, and the one file hash.

Output folders (-o, --cache-dir) are checked before any work, so that a folder we cannot write
is bad input (exit 2, one line) found in a second, not an OSError traceback at the final rename
after minutes of measuring. Every file we write appears whole or not at all: it is written
beside its target and renamed over it (atomic on one file system).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

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


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def atomic_write(path: str | os.PathLike, data: bytes | memoryview | str,
                 fsync: bool = False) -> Path:
    """Write `data` to `path` through a temporary file beside it and a rename, so `path` is
    either the old file or the complete new one. The file gets the usual mode (mkstemp's 0600
    would hide an artifact from a serving user). `fsync` for files that must survive a crash
    (the manifest)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def swap_dir_into_place(tmp: Path, out: Path) -> None:
    """Rename a finished staging folder to `out`, replacing an old `out` only now."""
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp made it private; OUT gets the usual mode
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sha256_files(paths: Iterable[str | os.PathLike]) -> str:
    """sha256 over the bytes of the given files in order (a graph and its external data)."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    return sha256_files([path])
