"""How much more memory this process's cgroup lets it take, and how many CPUs' time.

In a container (`docker run --memory`, a Kubernetes pod's `limits`, the KServe manifest's)
/proc/meminfo is the host's: a server that sized its KV cache as a share of MemAvailable, or
an optimize run that loaded as many sessions as MemAvailable said fit, grew past the
container's limit and was killed. The room under a limit is the limit less what the cgroup
uses, its inactive file pages counted as free (the kernel reclaims them before it kills;
`docker stats` counts the same way).

Both hierarchies are read as the kernel writes them: cgroup v2 (`0::/path` in
/proc/self/cgroup; every ancestor's memory.max holds, so the least room of them does) and v1
(the `memory` controller's line; memory.stat's hierarchical_memory_limit is the least of the
ancestors' limits). A CPU limit (`docker run --cpus`, a pod's `limits: cpu`) is a quota of
CPU time per period, not fewer cores: the process still sees every core of the host, and a
runtime that starts a thread per core is throttled to the quota. Inside a container the cgroup's own folder is usually the mount itself
(a cgroup namespace, or v1's bind mount), which /proc/self/cgroup names by its host path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# v1 writes "no limit" as 2**63 - 1 rounded down to a page; anything this large is none
UNLIMITED = 1 << 60


@dataclass(frozen=True)
class Paths:
    """Where the kernel shows cgroups (tests point these at trees of their own)."""

    root: Path = Path("/sys/fs/cgroup")
    membership: Path = Path("/proc/self/cgroup")


def room_bytes(paths: Paths = Paths()) -> int | None:
    """Bytes this process's memory cgroup still lets it take (0 at the limit); None where no
    limit applies or none can be read."""
    v1, v2 = _memberships(paths)
    try:
        if "memory" in v1:  # the memory controller on v1 (a hybrid machine has both)
            return _v1_room(_folder(paths.root / "memory", v1["memory"]))
        if v2 is not None:
            return _v2_room(_folder(paths.root, v2), paths.root)
    except (OSError, ValueError):
        pass  # a file the kernel did not write as read here: no limit known
    return None


def cpu_limit(paths: Paths = Paths()) -> float | None:
    """CPUs' worth of time per period this process's cgroup allows (1.5: a quota of 150 ms
    per 100 ms); None where no quota applies or none can be read."""
    v1, v2 = _memberships(paths)
    try:
        if "cpu" in v1:
            folder = _folder(paths.root / _v1_mount(paths.root, "cpu"), v1["cpu"])
            quota = int(_text(folder / "cpu.cfs_quota_us") or -1)
            period = int(_text(folder / "cpu.cfs_period_us") or 0)
            return quota / period if quota > 0 and period > 0 else None
        if v2 is not None:
            return _v2_cpus(_folder(paths.root, v2), paths.root)
    except (OSError, ValueError):
        pass
    return None


def _memberships(paths: Paths) -> tuple[dict[str, str], str | None]:
    """/proc/self/cgroup: v1's path by controller, and v2's path (None where absent)."""
    try:
        lines = paths.membership.read_text(encoding="ascii").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}, None
    v1: dict[str, str] = {}
    v2 = None
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, where = rest.partition(":")
        if number == "0" and not controllers:
            v2 = where
        for name in filter(None, controllers.split(",")):
            v1[name] = where
    return v1, v2


def _v1_mount(root: Path, controller: str) -> str:
    """v1 mounts cpu alone or together with cpuacct (`cpu,cpuacct`, linked as `cpu`)."""
    return controller if (root / controller).is_dir() else "cpu,cpuacct"


def _folder(mount: Path, where: str) -> Path:
    """The cgroup's folder: its path under the mount, else the mount itself (a container
    sees its own cgroup at the mount under its host path's name)."""
    inside = mount / where.lstrip("/")
    return inside if where.strip("/") and inside.is_dir() else mount


def _v1_room(folder: Path) -> int | None:
    stat = _stat(folder / "memory.stat")
    limit = stat.get("hierarchical_memory_limit",
                     int(_text(folder / "memory.limit_in_bytes") or UNLIMITED))
    if limit >= UNLIMITED:
        return None
    used = int(_text(folder / "memory.usage_in_bytes"))
    idle = stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return max(0, limit - used + idle)


def _v2_room(folder: Path, root: Path) -> int | None:
    rooms = []
    while True:
        limit = _text(folder / "memory.max")
        if limit is not None and limit != "max":
            used = int(_text(folder / "memory.current"))
            idle = _stat(folder / "memory.stat").get("inactive_file", 0)
            rooms.append(max(0, int(limit) - used + idle))
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    return min(rooms) if rooms else None


def _v2_cpus(folder: Path, root: Path) -> float | None:
    limits = []
    while True:
        quota, _, period = (_text(folder / "cpu.max") or "max").partition(" ")
        if quota != "max" and int(period or 100000) > 0:
            limits.append(int(quota) / int(period or 100000))
        if folder == root or root not in folder.parents:
            break
        folder = folder.parent
    return min(limits) if limits else None


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        return None


def _stat(path: Path) -> dict[str, int]:
    """memory.stat's `key value` lines (empty where the file is not there)."""
    text = _text(path) or ""
    pairs = (line.split() for line in text.splitlines())
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}
