"""Triton's system shared memory: the regions clients register (a span of a POSIX shared
memory object), and the reads and writes of tensors in them. No transport here: the gRPC
servicer and the HTTP frontend convert their messages to these calls and back.

Every client input is untrusted, so:
- a key is a plain POSIX shm name ("/name": one leading '/', no other, no "..", not
  Triton's reserved prefix for its own backends' objects) and is opened in /dev/shm only
  (as shm_open does), never through a symlink, and only when it is a regular file: no
  other file can be reached;
- a region's offset and byte size are checked against the object's real size when it is
  registered, and every tensor's span against the region's (INVALID_ARGUMENT past it);
- the object is read and written with pread/pwrite on the descriptor kept open, not
  through a mapping: an object the client truncates later gives a short read (refused),
  where a mapping would give SIGBUS and take the server down;
- a region's descriptor is closed on unregister and on server stop, under the region's
  lock, so that no read or write can meet a descriptor number reused by another file;
- shared memory is this host's, so only a client on this host (a loopback peer, or a Unix
  socket) may register a region: a server bound to the network never lets a remote client
  open this host's shared memory objects (Triton does not ask).
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Mapping

from serving.errors import (AlreadyExists, InvalidArgument, NotFound, ResourceExhausted,
                            Unavailable)

SHM_FOLDER = "/dev/shm"  # where glibc's shm_open creates and finds objects
# "/" then a name of the characters shm names use in practice; 255 is NAME_MAX
_KEY = re.compile(r"/[A-Za-z0-9_.:@+\-]{1,255}")
# Triton's Python-based backends (its vLLM backend among them) keep their own requests in shm
# objects of this prefix; Triton refuses it as a client's key, and so does this server, which
# may run beside a Triton on one host
RESERVED_PREFIX = "triton_python_backend_shm_region_"
MAX_REGIONS = 256  # each holds a descriptor: a client must not exhaust the server's
MAX_TENSOR_BYTES = 256 * 1024 * 1024  # as --max-message-mb's default: no larger read


@dataclass(frozen=True)
class RegionStatus:
    """A registered region, as the status RPC and route report it."""

    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True)
class Place:
    """Where one tensor lives: `byte_size` bytes at `offset` within a registered region."""

    region: str
    offset: int
    byte_size: int


def place_of(params: Mapping[str, object], what: str) -> Place | None:
    """The shared memory place a tensor's parameters name (Triton's `shared_memory_region`,
    `shared_memory_offset`, `shared_memory_byte_size`), or None when they name none."""
    region = params.get("shared_memory_region")
    if region is None:
        return None
    if not isinstance(region, str) or not region:
        raise InvalidArgument(f"{what}: 'shared_memory_region' must be a region's name")
    offset = params.get("shared_memory_offset", 0)
    size = params.get("shared_memory_byte_size")
    for key, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(f"{what}: '{key}' must be an integer >= 0, not {value!r}")
    return Place(region, offset, size)


def _check_key(name: str, key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or ".." in key or key == "/.":
        raise InvalidArgument(
            f"cannot register shared memory region '{name}': invalid shm key {key!r} (a "
            "POSIX shared memory name: '/' then letters, digits, '_', '.', '-', with no "
            "other '/' and no '..')")
    if key[1:].startswith(RESERVED_PREFIX):
        raise InvalidArgument(
            f"cannot register shared memory region '{name}' with key '{key}' as the key "
            f"contains the reserved prefix '{RESERVED_PREFIX}'")
    return key[1:]


def _open_object(name: str, key: str) -> tuple[int, int]:
    """The object's descriptor and size: opened in SHM_FOLDER only, never through a
    symlink (O_NOFOLLOW), without blocking on a special file, and kept only when it is a
    regular file."""
    base = _check_key(name, key)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(os.path.join(SHM_FOLDER, base), flags)
    except OSError as e:
        raise InvalidArgument(f"Unable to open shared memory region: '{key}' "
                              f"({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise InvalidArgument(f"Invalid shared memory region: '{key}' is not a shared "
                              "memory object")
    return fd, info.st_size


class _Region:
    """One registered region: its descriptor, and a lock that keeps it open during I/O."""

    def __init__(self, status: RegionStatus, fd: int) -> None:
        self.status, self._fd = status, fd
        self._lock = threading.Lock()

    def read(self, place: Place, what: str) -> bytes:
        with self._lock:
            if self._fd < 0:
                raise NotFound(f"Unable to find shared memory region: '{place.region}'")
            data = os.pread(self._fd, place.byte_size, self.status.offset + place.offset)
        if len(data) != place.byte_size:  # the client truncated the object since
            raise InvalidArgument(f"{what}: shared memory region '{place.region}' is shorter "
                                  "than when it was registered")
        return data

    def write(self, place: Place, data: bytes) -> None:
        view, at = memoryview(data), self.status.offset + place.offset
        with self._lock:
            if self._fd < 0:
                raise NotFound(f"Unable to find shared memory region: '{place.region}'")
            while view:  # pwrite may write less than asked
                n = os.pwrite(self._fd, view, at)
                view, at = view[n:], at + n

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def check_same_host(host: str | None, name: str) -> None:
    """InvalidArgument unless `host` (the client's address; None: a Unix socket) is this
    host's loopback: shared memory is only shared with a process on the same host."""
    if host is None:
        return
    try:
        local = ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        local = host == "localhost"
    if not local:
        raise InvalidArgument(f"cannot register shared memory region '{name}': shared memory "
                              f"is this host's, and the client ({host}) is not on it (connect "
                              "through 127.0.0.1 or ::1)")


class SystemRegions:
    """The server's registered system shared memory regions, by name (thread-safe)."""

    def __init__(self, max_tensor_bytes: int = MAX_TENSOR_BYTES) -> None:
        self.max_tensor_bytes = max_tensor_bytes
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int,
                 client: str | None) -> None:
        """`client`: the caller's address (None: a Unix socket), which must be this host's."""
        check_same_host(client, name)
        if not name:
            raise InvalidArgument("'region name' is necessary to register system shared "
                                  "memory region")
        if byte_size <= 0:
            raise InvalidArgument(f"failed to register shared memory region '{name}': "
                                  "byte_size must be above 0")
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            if len(self._regions) >= MAX_REGIONS:
                raise ResourceExhausted(f"cannot register shared memory region '{name}': "
                                        f"{MAX_REGIONS} regions are registered already")
            fd, size = _open_object(name, key)
            if offset + byte_size > size:
                os.close(fd)
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': offset {offset} + "
                    f"byte_size {byte_size} runs past the end of '{key}' ({size} bytes)")
            self._regions[name] = _Region(RegionStatus(name, key, offset, byte_size), fd)

    def unregister(self, name: str = "") -> None:
        """Unregister `name` (empty: every region); an unknown name is no error, as Triton."""
        with self._lock:
            names = [name] if name else list(self._regions)
            gone = [self._regions.pop(n) for n in names if n in self._regions]
        for region in gone:
            region.close()

    def close(self) -> None:
        self.unregister()

    def status(self, name: str = "") -> list[RegionStatus]:
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values()]
            if name not in self._regions:
                raise NotFound(f"Unable to find system shared memory region: '{name}'")
            return [self._regions[name].status]

    def _find(self, place: Place, what: str) -> _Region:
        """The region of `place`, once its span is checked against the region's."""
        with self._lock:
            region = self._regions.get(place.region)
        if region is None:
            raise NotFound(f"{what}: Unable to find shared memory region: '{place.region}'")
        size = region.status.byte_size
        if place.offset >= size or place.offset + place.byte_size > size:
            raise InvalidArgument(
                f"{what}: shared_memory_offset {place.offset} + shared_memory_byte_size "
                f"{place.byte_size} runs past the {size} bytes of shared memory region "
                f"'{place.region}'")
        return region

    def check(self, place: Place, what: str) -> None:
        """NotFound or InvalidArgument now, before a model runs, for a place that cannot be
        written later."""
        self._find(place, what)

    def read(self, place: Place, what: str) -> bytes:
        """A tensor's raw bytes (KServe's raw format, as in raw_input_contents)."""
        region = self._find(place, what)
        if place.byte_size > self.max_tensor_bytes:
            raise InvalidArgument(f"{what}: shared_memory_byte_size {place.byte_size} is over "
                                  f"this server's limit of {self.max_tensor_bytes} bytes")
        return region.read(place, what)

    def write(self, place: Place, data: bytes, what: str) -> None:
        """An output's raw bytes into its place (InvalidArgument when they do not fit)."""
        region = self._find(place, what)
        if len(data) > place.byte_size:
            raise InvalidArgument(
                f"shared memory size specified with the request for {what} "
                f"({place.byte_size} bytes) should be at least {len(data)} bytes to hold "
                "the results")
        region.write(place, data)


def no_cuda() -> None:
    """CUDA shared memory's calls, answered on every port: refused, naming the alternative."""
    raise Unavailable("CUDA shared memory is not supported by this server (it runs no GPU "
                      "memory); use system shared memory instead (Triton's "
                      "system_shared_memory extension, tritonclient.utils.shared_memory)")
