"""Each cached model, folder or environment is built by one process at a time.

The test suite runs in two worker processes (pytest-xdist), which often want the same export
first. Without a lock both would build it, and two folders renamed onto one path collide. With
one, the second waits for the first's build and then finds it there."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Callable


def build_once(target: Path, ready: Callable[[], bool], build: Callable[[], object]) -> None:
    """Run `build` unless `ready()`, holding a lock file beside `target` (the file or folder
    `build` writes, whole or not at all) so that another process asking meanwhile waits for
    this build instead of starting its own."""
    if ready():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not ready():  # nobody built it while we waited
            build()
