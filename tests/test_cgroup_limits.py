"""The memory and CPU time a container's limits leave (tuner/hardware/cgroup.py): trees in the
formats the kernel writes (cgroup v2 with its ancestors, a cgroup namespace, v1's bind mount,
no limit, nothing readable), then real cgroups where this machine lets the suite make them: a
server moved into one limited to 1 GiB sizes its KV cache from that limit and says so in its
ready line; one limited to 1 CPU's time runs its model on one thread."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from llm_support import decoder_artifact, llama  # noqa: F401

from tuner.hardware.cgroup import Paths, cpu_limit, room_bytes

GiB, MiB = 1 << 30, 1 << 20
V1_UNLIMITED = 9223372036854771712  # what v1 writes for "no limit"


def _write(folder: Path, **files: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (folder / name.replace("_", ".", 1)).write_text(f"{value}\n")


def _membership(tmp: Path, text: str) -> Path:
    (tmp / "cgroup").write_text(text)
    return tmp / "cgroup"


def test_v2_takes_the_least_room_of_the_cgroup_and_its_ancestors(tmp_path) -> None:
    root = tmp_path / "fs"
    _write(root / "kubepods" / "pod1" / "ctr", memory_max=2 * GiB, memory_current=GiB,
           memory_stat=f"anon 900\ninactive_file {100 * MiB}\n")
    _write(root / "kubepods" / "pod1", memory_max=3 * GiB // 2, memory_current=GiB + GiB // 4,
           memory_stat="inactive_file 0\n")
    _write(root / "kubepods", memory_max="max", memory_current=5 * GiB)
    paths = Paths(root, _membership(tmp_path, "0::/kubepods/pod1/ctr\n"))
    assert room_bytes(paths) == GiB // 4  # the pod's limit, not the container's 1.1 GiB
    _write(root / "kubepods" / "pod1", memory_max="max")
    assert room_bytes(paths) == GiB + 100 * MiB  # the container's, its idle file pages free


def test_v2_in_a_cgroup_namespace_reads_the_mount_itself(tmp_path) -> None:
    root = tmp_path / "fs"
    _write(root, memory_max=GiB, memory_current=GiB // 2, memory_stat="inactive_file 0\n")
    assert room_bytes(Paths(root, _membership(tmp_path, "0::/\n"))) == GiB // 2
    # a host path the container cannot see: the mount is its cgroup
    assert room_bytes(Paths(root, _membership(tmp_path, "0::/system.slice/x.scope\n"))) \
        == GiB // 2
    _write(root, memory_max="max")
    assert room_bytes(Paths(root, _membership(tmp_path, "0::/\n"))) is None
    (root / "memory.max").unlink()  # the host's root cgroup has no limit file at all
    assert room_bytes(Paths(root, _membership(tmp_path, "0::/\n"))) is None


def test_v1_reads_the_memory_controllers_hierarchical_limit(tmp_path) -> None:
    root = tmp_path / "fs"
    stat = (f"cache 5\nhierarchical_memory_limit {GiB}\ninactive_file 7\n"
            f"total_inactive_file {50 * MiB}\n")
    # docker on v1 bind-mounts the container's cgroup at the mount; the membership line
    # names the host path, which does not exist inside
    _write(root / "memory", memory_limit_in_bytes=2 * GiB, memory_usage_in_bytes=400 * MiB,
           memory_stat=stat)
    membership = _membership(tmp_path, "9:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert room_bytes(Paths(root, membership)) == GiB - 400 * MiB + 50 * MiB
    _write(root / "memory", memory_stat=f"hierarchical_memory_limit {V1_UNLIMITED}\n")
    assert room_bytes(Paths(root, membership)) is None


def test_nothing_readable_is_no_limit(tmp_path) -> None:
    assert room_bytes(Paths(tmp_path, tmp_path / "absent")) is None
    garbage = _membership(tmp_path, "0::/\n")
    _write(tmp_path / "fs", memory_max="lots", memory_current=1)
    assert room_bytes(Paths(tmp_path / "fs", garbage)) is None
    _write(tmp_path / "fs", memory_max=GiB, memory_current=2 * GiB)
    assert room_bytes(Paths(tmp_path / "fs", garbage)) == 0  # past the limit: no room


def test_cpu_quotas_in_v2_and_v1(tmp_path) -> None:
    root = tmp_path / "fs"
    _write(root / "pod" / "ctr", cpu_max="400000 100000")
    _write(root / "pod", cpu_max="150000 100000")
    v2 = Paths(root, _membership(tmp_path, "0::/pod/ctr\n"))
    assert cpu_limit(v2) == 1.5  # the pod's quota holds the container's 4
    _write(root / "pod", cpu_max="max 100000")
    assert cpu_limit(v2) == 4.0
    _write(root / "pod" / "ctr", cpu_max="max 100000")
    assert cpu_limit(v2) is None
    # v1 mounts cpu with cpuacct; the membership names both
    _write(root / "cpu,cpuacct", cpu_cfs_quota_us=250000, cpu_cfs_period_us=100000)
    v1 = Paths(root, _membership(tmp_path, "3:cpu,cpuacct:/docker/abc\n0::/\n"))
    assert cpu_limit(v1) == 2.5
    _write(root / "cpu,cpuacct", cpu_cfs_quota_us=-1)
    assert cpu_limit(v1) is None


# ----------------------------------------------------------------- real cgroups, if allowed

def _child_cgroup(tmp_name: str, controller: str, limits: dict[str, str]) -> Path:
    """A child cgroup of this process's own under `controller` (v1's mount, else v2's
    unified tree), with `limits` written: its folder, whose cgroup.procs a pid joins. Skips
    where the machine does not allow it."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if controller in ln.split(":")[1].split(",")),
              None)
    if v1 is not None:
        mount = Path("/sys/fs/cgroup") / controller
        own = mount / v1.lstrip("/")
    else:
        mount = Path("/sys/fs/cgroup")
        own = mount / next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")),
                           "/").lstrip("/")
        limits = {"memory": {"memory.max": limits.get("memory.limit_in_bytes", "")},
                  "cpu": {"cpu.max": f"{limits.get('cpu.cfs_quota_us')} 100000"}}[controller]
    folder = (own if own.is_dir() else mount) / tmp_name
    try:
        folder.mkdir()
        for name, value in limits.items():
            (folder / name).write_text(value)
    except OSError as e:
        if folder.is_dir():
            folder.rmdir()
        pytest.skip(f"this machine does not let the suite make a {controller} cgroup ({e})")
    return folder


def _run_in(folder: Path, args: list[str], **kwargs) -> subprocess.Popen:
    def join() -> None:
        (folder / "cgroup.procs").write_text(str(os.getpid()))
    return subprocess.Popen(args, preexec_fn=join, **kwargs)


def _serve_lines(folder: Path, artifact: Path, *args: str) -> list[str]:
    """`tuner serve` started in `folder`'s cgroup: its lines up to the ready one."""
    serve = _run_in(folder, [sys.executable, "-m", "tuner", "serve", str(artifact), "--port",
                             "0", "--http-port", "0", "--metrics-port", "-1", *args],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in serve.stdout:
            lines.append(line)
            if " ready " in line:
                break
    finally:
        serve.terminate()
        serve.wait(60)
    return lines


def test_a_process_in_a_limited_cgroup_sizes_its_cache_from_the_limit(llama, tmp_path) -> None:
    folder = _child_cgroup(f"shapetuner-test-{os.getpid()}", "memory",
                           {"memory.limit_in_bytes": str(GiB)})
    try:
        probe = ("from serving.generation.options import GenerateOptions, cache_budget\n"
                 "from tuner.runtime.memory import room\n"
                 "r, b = room(), cache_budget(GenerateOptions())\n"
                 "print(r.bytes, r.cgroup_limited, b.bytes, b.why)")
        p = _run_in(folder, [sys.executable, "-c", probe], stdout=subprocess.PIPE,
                    text=True)
        out = p.communicate(timeout=120)[0].split(maxsplit=3)
        assert p.returncode == 0
        got, limited, budget, why = int(out[0]), out[1], int(out[2]), out[3]
        assert 0 < got <= GiB and limited == "True", out
        assert budget == int(got * 0.3) and "memory cgroup limit" in why, out

        ready = _serve_lines(folder, decoder_artifact(tmp_path, llama))[-1]
        assert "under this process's memory cgroup limit" in ready, ready
        shown = float(ready.split("KV cache budget ")[1].split(" GB")[0])
        assert 0 < shown <= 0.3 * GiB / 1e9 + 0.01, ready
    finally:
        folder.rmdir()


def test_a_server_limited_to_one_cpu_runs_on_one_thread(llama, tmp_path) -> None:
    from tuner.hardware.detect import affinity_cores

    if affinity_cores() < 2:
        pytest.skip("one core here: a quota of one CPU changes nothing")
    folder = _child_cgroup(f"shapetuner-test-cpu-{os.getpid()}", "cpu",
                           {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"})
    try:
        probe = "from tuner.hardware.detect import usable_cores; print(usable_cores())"
        p = _run_in(folder, [sys.executable, "-c", probe], stdout=subprocess.PIPE, text=True)
        assert p.communicate(timeout=120)[0].strip() == "1"
        # the artifact was timed with the runtime's default: a thread per core
        artifact = decoder_artifact(tmp_path, llama)
        for args in ((), ("--spin",)):  # (--spin alone takes the threads as without it)
            lines = _serve_lines(folder, artifact, *args)
            assert " ready " in lines[-1], lines
            assert any("running on 1 thread," in line and "may keep 1 core busy" in line
                       for line in lines), (args, lines)
    finally:
        folder.rmdir()
