"""Load the variants' sessions for interleaved timing only while they fit in memory.

Interleaved timing keeps every variant's session alive at once. For a model of a few GB that
is several copies of its weights, more when the backend converts them (ONNX Runtime's CPU
provider casts float16 weights to float32: an fp16 Pythia-2.8B slice of 1.8 GB took 4.4 GB
in one session). Measured on bench/big_model.py: four variants of that slice passed 23 GB and
were killed. So the first session is weighed (this process's resident memory before and
after loading it), each next one is predicted from its model's bytes at the same ratio, and
one that would not fit in the memory available is left out, with a note that says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from tuner.hardware import cgroup

T = TypeVar("T")
HEADROOM_BYTES = 1 << 30  # activations of the timed shapes, feeds, Python


def rss_bytes() -> int | None:
    """This process's resident memory now (VmRSS), None where /proc is not there."""
    return _status_field("VmRSS:")


def peak_bytes() -> int | None:
    """This process's resident high-water mark (VmHWM) since the last reset_peak()."""
    return _status_field("VmHWM:")


def reset_peak() -> None:
    """Reset VmHWM to the current resident size (Linux: 5 into clear_refs), so that the next
    peak_bytes() is the peak of what runs in between, not of an earlier phase."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        pass  # then the peak may be an earlier one: the estimate errs high, never low


@dataclass(frozen=True)
class Room:
    """Bytes this process can still take, and whether its cgroup's limit (a container's) is
    what bounds them rather than the machine's MemAvailable."""

    bytes: int
    cgroup_limited: bool

    def describe(self) -> str:
        where = "under this process's memory cgroup limit" if self.cgroup_limited else ""
        return f"{self.bytes / 1e9:.1f} GB available{' ' + where if where else ''}"


def room() -> Room | None:
    """The memory available to this process: the machine's MemAvailable, or less where its
    cgroup leaves less (tuner.hardware.cgroup); None where neither can be read."""
    machine, limited = _proc_field("/proc/meminfo", "MemAvailable:"), cgroup.room_bytes()
    if limited is not None and (machine is None or limited < machine):
        return Room(limited, True)
    return None if machine is None else Room(machine, False)


def mem_available() -> int | None:
    """room()'s bytes, None where unknown."""
    r = room()
    return None if r is None else r.bytes


def _status_field(key: str) -> int | None:
    return _proc_field("/proc/self/status", key)


def _proc_field(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_memory() -> None:
    """Collect garbage, then hand free heap pages back to the system (glibc's malloc_trim):
    freed sessions and weight copies otherwise stay in this process's resident memory, and
    the next sessions are weighed against what the machine has left."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


@dataclass(frozen=True)
class Probes:
    """Where memory is read from (tests substitute their own)."""

    rss: Callable[[], int | None] = rss_bytes
    peak: Callable[[], int | None] = peak_bytes
    reset_peak: Callable[[], None] = reset_peak
    available: Callable[[], int | None] = mem_available


def _weigh(load: Callable[[], T], probes: Probes) -> tuple[T, int | None]:
    """Run a load and return what it made and how far it raised resident memory at its peak
    (loading converts weights, and the transient is what must fit, not the steady size)."""
    probes.reset_peak()
    before = probes.rss()
    made = load()
    peak = probes.peak()
    return made, None if before is None or peak is None else max(peak - before, 0)


def load_fitting(items: Sequence[tuple[str, Path, int]], load: Callable[[str, Path], T],
                 probes: Probes = Probes()) -> tuple[list[tuple[str, T]], list[str]]:
    """Load (name, path, model bytes) in order, the first always; returns what was loaded and
    a note per item left out. The first load sets the bytes of session per byte of model."""
    loaded: list[tuple[str, T]] = []
    notes: list[str] = []
    ratio: float | None = None
    release_memory()  # what the build phase freed, before weighing what is left
    for name, path, size in items:
        if ratio is not None:
            need, avail = int(ratio * size) + HEADROOM_BYTES, probes.available()
            if avail is not None and need > avail:
                notes.append(f"left {name} out of the timing: loading its session would need "
                             f"about {need / 1e9:.1f} GB ({ratio:.1f}x its {size / 1e9:.1f} GB, "
                             f"as the first session took), {avail / 1e9:.1f} GB is available")
                continue
        made, grew = _weigh(lambda: load(name, path), probes)
        loaded.append((name, made))
        if ratio is None and grew is not None and size > 0:
            ratio = grew / size
    return loaded, notes
