"""Triton's model repository and shared memory RPCs as messages: convert the request, call
the slot (serving.wire.servicer.Slot) or its regions (serving.shared_memory), convert back."""

from __future__ import annotations

from typing import Iterable, Protocol
from urllib.parse import unquote

from serving.shared_memory import SystemRegions
from serving.wire._generated import inference_pb2 as pb


class Repository(Protocol):
    """What the repository RPCs ask of the servicer's Slot (no import back: no circle)."""

    def index(self, ready_only: bool = False) -> list: ...
    def load(self, name: str, parameters: Iterable[str] = ()) -> None: ...
    def unload(self, name: str) -> None: ...


def index(slot: Repository, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
    response = pb.RepositoryIndexResponse()
    for entry in slot.index(request.ready):
        response.models.add(name=entry.name, version=entry.version, state=entry.state,
                            reason=entry.reason)
    return response


def load(slot: Repository, request: pb.RepositoryModelLoadRequest
         ) -> pb.RepositoryModelLoadResponse:
    slot.load(request.model_name, list(request.parameters))
    return pb.RepositoryModelLoadResponse()


def unload(slot: Repository, request: pb.RepositoryModelUnloadRequest
           ) -> pb.RepositoryModelUnloadResponse:
    slot.unload(request.model_name)
    return pb.RepositoryModelUnloadResponse()


def shm_status(regions: SystemRegions, request: pb.SystemSharedMemoryStatusRequest
               ) -> pb.SystemSharedMemoryStatusResponse:
    response = pb.SystemSharedMemoryStatusResponse()
    for r in regions.status(request.name):
        response.regions[r.name].CopyFrom(pb.SystemSharedMemoryStatusResponse.RegionStatus(
            name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size))
    return response


def peer_host(peer: str) -> str | None:
    """The address in gRPC's peer string ("ipv4:127.0.0.1:5000", "ipv6:%5B::1%5D:5000");
    None for a Unix socket (a client on this host)."""
    kind, _, rest = unquote(peer).partition(":")
    if kind.startswith("unix"):
        return None
    host = rest.rsplit(":", 1)[0] if kind in ("ipv4", "ipv6") else rest
    return host.strip("[]")


def shm_register(regions: SystemRegions, request: pb.SystemSharedMemoryRegisterRequest,
                 peer: str) -> pb.SystemSharedMemoryRegisterResponse:
    regions.register(request.name, request.key, request.offset, request.byte_size,
                     peer_host(peer))
    return pb.SystemSharedMemoryRegisterResponse()


def shm_unregister(regions: SystemRegions, request: pb.SystemSharedMemoryUnregisterRequest
                   ) -> pb.SystemSharedMemoryUnregisterResponse:
    regions.unregister(request.name)
    return pb.SystemSharedMemoryUnregisterResponse()
