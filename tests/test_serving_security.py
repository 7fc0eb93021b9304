"""Bearer token on every call, TLS, the message size limit, the loopback default, and the
CLI's answers to bad arguments."""

from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tg
from serving_support import feeds_for, infer_inputs, make_artifact
from tritonclient.utils import InferenceServerException

from serving.server import Server, ServerOptions
from serving.wire import protocol
from serving.wire._generated import inference_pb2 as pb
from serving.wire._generated import inference_pb2_grpc as pb_grpc
from tuner.errors import BadInput

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def artifact(reference_model, tmp_path_factory):
    return make_artifact(tmp_path_factory.mktemp("sec"), reference_model("bert", "small"))


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def secure(artifact, cert):
    """TLS + token + a 64 KiB message limit, in one server."""
    server = Server(artifact, ServerOptions(port=0, metrics_port=None, tls_cert=cert[0],
                                            tls_key=cert[1], token=TOKEN,
                                            max_message_bytes=64 * 1024),
                    say=lambda line: None).start()
    assert server.wait_ready(120)
    yield server, cert[0]
    server.stop(5)


def _client(server, cert) -> tg.InferenceServerClient:
    return tg.InferenceServerClient(f"localhost:{server.port}", ssl=True,
                                    root_certificates=str(cert))


def test_token_is_required_on_every_call(secure) -> None:
    server, cert = secure
    client = _client(server, cert)
    with pytest.raises(InferenceServerException, match="bearer token"):
        client.is_server_live()
    with pytest.raises(InferenceServerException, match="bearer token"):
        client.infer(server.slot.name, infer_inputs(feeds_for(4)))
    with pytest.raises(InferenceServerException, match="bearer token"):
        client.is_server_live(headers={"authorization": "Bearer wrong"})
    good = {"authorization": f"Bearer {TOKEN}"}
    assert client.is_server_live(headers=good)
    result = client.infer(server.slot.name, infer_inputs(feeds_for(4)), headers=good)
    assert result.as_numpy("last_hidden_state").shape == (1, 4, 64)


def test_token_guards_health_and_streams_too(secure) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, cert = secure
    creds = grpc.ssl_channel_credentials(cert.read_bytes())
    with grpc.secure_channel(f"localhost:{server.port}", creds) as channel:
        with pytest.raises(grpc.RpcError, match="missing or wrong bearer token") as info:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = protocol.encode_inputs(feeds_for(3), server.slot.name)
        with pytest.raises(grpc.RpcError, match="missing or wrong bearer token") as info:
            list(stub.ModelStreamInfer(iter([request]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        answers = list(stub.ModelStreamInfer(iter([request]), timeout=10,
                                             metadata=[("authorization", f"Bearer {TOKEN}")]))
        assert len(answers) == 1 and not answers[0].error_message


def test_plaintext_clients_cannot_talk_to_a_tls_server(secure) -> None:
    server, _ = secure
    with grpc.insecure_channel(f"localhost:{server.port}") as channel:
        with pytest.raises(grpc.RpcError, match="failed to connect to all addresses") as info:
            pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(),
                                                                 timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_messages_over_the_limit_are_refused_and_the_server_lives_on(secure) -> None:
    server, cert = secure
    client = _client(server, cert)
    good = {"authorization": f"Bearer {TOKEN}"}
    big = {"input_ids": np.zeros((8, 32), np.int64), "attention_mask": np.ones((8, 32), np.int64)}
    big["pad"] = np.zeros(10_000, np.int64)  # 80 kB: over the 64 KiB limit
    with pytest.raises(InferenceServerException,
                       match=r"Received message larger than max \(\d+ vs\. 65536\)") as info:
        client.infer(server.slot.name, infer_inputs(big), headers=good)
    assert "RESOURCE_EXHAUSTED" in str(info.value.status())
    assert client.is_server_live(headers=good)


def _non_loopback_ipv4() -> str | None:
    """An IPv4 address of this machine that is not loopback: from every interface (Linux's
    SIOCGIFADDR), then from the host name; None when the machine has none."""
    import fcntl
    import socket
    import struct

    found = []
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            found.append(socket.inet_ntoa(raw[20:24]))
    try:
        found += [a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return next((a for a in found if not a.startswith("127.")), None)


def test_binds_loopback_by_default(artifact) -> None:
    import socket

    options = ServerOptions()
    assert options.host == "127.0.0.1"
    address = _non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try the listener from")
    with socket.socket() as probe, socket.socket() as c:  # the liar: an all-address listener
        probe.bind(("0.0.0.0", 0))                       # IS reachable there, so a refusal
        probe.listen(1)                                  # below means loopback-only
        c.settimeout(2)
        if c.connect_ex((address, probe.getsockname()[1])) != 0:
            pytest.skip(f"{address} is not reachable from this machine itself")
    server = Server(artifact, ServerOptions(port=0, metrics_port=None),
                    say=lambda line: None).start()
    try:
        assert server.wait_ready(60)
        with socket.socket() as s:  # the listener answers on loopback...
            s.settimeout(2)
            assert s.connect_ex(("127.0.0.1", server.port)) == 0
        with socket.socket() as s:  # ...and not on this machine's other address
            s.settimeout(2)
            assert s.connect_ex((address, server.port)) != 0, f"reachable on {address}"
    finally:
        server.stop(5)


@pytest.mark.parametrize("kwargs, message", [
    ({"tls_cert": "x.pem"}, "--tls-cert and --tls-key go together"),
    ({"token": "has space"}, "no whitespace"),
    ({"port": 70000}, "port must be in"),
    ({"max_message_bytes": 10}, "max message size"),
])
def test_server_options_are_validated(kwargs, message) -> None:
    with pytest.raises(BadInput, match=message):
        ServerOptions(**kwargs)


def _tuner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuner", *args], capture_output=True,
                          text=True, timeout=120)


def test_cli_help_and_bad_artifact(tmp_path) -> None:
    help_text = _tuner("serve", "--help")
    assert help_text.returncode == 0 and "--max-queue-delay-ms" in help_text.stdout
    missing = _tuner("serve", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert "not an artifact folder" in missing.stderr and "Traceback" not in missing.stderr
    bad = _tuner("serve", str(tmp_path), "--shadow-fraction", "2")
    assert bad.returncode == 2 and "shadow fraction must be in [0, 1]" in bad.stderr


def test_cli_exits_2_when_the_artifacts_graph_is_broken(artifact, tmp_path) -> None:
    import shutil as sh

    broken = tmp_path / "broken"
    sh.copytree(artifact, broken)
    (broken / "variants" / "original" / "model.onnx").write_bytes(b"not an onnx graph")
    run = _tuner("serve", str(broken), "--port", "0", "--metrics-port", "-1")
    assert run.returncode == 2, run.stderr
    assert "failed to load" in run.stderr and "Traceback" not in run.stderr


def test_a_port_in_use_is_a_clear_error(artifact) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BadInput, match=f"cannot listen on 127.0.0.1:{port}"):
            Server(artifact, ServerOptions(port=port, metrics_port=None),
                   say=lambda line: None).start()
        with pytest.raises(BadInput, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            Server(artifact, ServerOptions(port=0, metrics_port=port),
                   say=lambda line: None).start()
    first = Server(artifact, ServerOptions(port=0, metrics_port=None), say=lambda line: None)
    first.start(load=False)
    try:  # a second server on the same port is refused, not given half of the calls
        with pytest.raises(BadInput, match=f"cannot listen on 127.0.0.1:{first.port}"):
            Server(artifact, ServerOptions(port=first.port, metrics_port=None),
                   say=lambda line: None).start(load=False)
    finally:
        first.stop(1)


def test_serve_refuses_an_unusable_backend_before_opening_a_port(tmp_path, reference_model, capsys):
    """A backend that cannot run here (no GPU) is bad input: exit 2 with the reason, and no
    "listening" line first (the server binds before it loads, so the check comes earlier)."""
    from serving_support import make_artifact

    from tuner.cli import main

    out = make_artifact(tmp_path / "art", reference_model("bert"))
    assert main(["serve", str(out), "--backend", "ort-cuda", "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert "listening" not in captured.out + captured.err
    assert "backend ort-cuda cannot run here" in captured.err
