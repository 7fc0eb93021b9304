"""Shared memory is this host's: a server bound to the network (0.0.0.0) takes a region's
registration only from a client on this host. The real tritonclient, connected through this
machine's own non-loopback address (as a remote client's packets would arrive), is refused
over gRPC and HTTP with nothing opened; the same client through 127.0.0.1 registers."""

from __future__ import annotations

import socket
import uuid

import grpc
import pytest
import tritonclient.grpc as tg
import tritonclient.http as th
import tritonclient.utils.shared_memory as shm
from llm_support import start
from serving_support import make_artifact
from tritonclient.utils import InferenceServerException

from serving.wire.extensions import peer_host


def _own_address() -> str:
    """This machine's IPv4 address on an interface other than loopback (Linux's
    SIOCGIFADDR per interface); skips where there is none."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name[:15].encode()))
        except OSError:  # no IPv4 address on it
            continue
        finally:
            probe.close()
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return address
    pytest.skip("this machine has no non-loopback address to connect through")


def test_peer_strings_of_grpc() -> None:
    assert peer_host("ipv4:127.0.0.1:5000") == "127.0.0.1"
    assert peer_host("ipv6:%5B::1%5D:5000") == "::1"
    assert peer_host("ipv4:192.0.2.2:41000") == "192.0.2.2"
    assert peer_host("unix:/tmp/s.sock") is None


def test_a_client_not_on_this_host_cannot_register(reference_model, tmp_path) -> None:
    address = _own_address()
    server = start(make_artifact(tmp_path / "art", reference_model("bert", "small",
                                                                   "torchscript")),
                   host="0.0.0.0")
    key = f"/tuner_test_{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key[1:], key, 64)
    try:
        remote_grpc = tg.InferenceServerClient(f"{address}:{server.port}")
        with pytest.raises(InferenceServerException) as e:
            remote_grpc.register_system_shared_memory("r", key, 64)
        assert e.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert "not on it" in e.value.message() and address in e.value.message()
        remote_http = th.InferenceServerClient(f"{address}:{server.http_port}")
        with pytest.raises(InferenceServerException, match="not on it"):
            remote_http.register_system_shared_memory("r", key, 64)
        assert server.slot.regions.status() == []
        local = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        local.register_system_shared_memory("r", key, 64)
        assert [r.name for r in server.slot.regions.status()] == ["r"]
    finally:
        server.slot.regions.unregister()
        shm.destroy_shared_memory_region(handle)
        server.stop(5)
