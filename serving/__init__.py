"""`tuner serve`: the KServe v2 / Open Inference Protocol gRPC server (see serving/server.py).

Layers, each importable alone: wire/ (protocol: protobuf <-> numpy and the error table;
servicer: the thin KServe v2 servicer; the generated stubs), batcher (dynamic batching into
buckets), model (artifact -> runners, accuracy gate), engine (validation, batching, shadow
checks), metrics, server (process, signals). Only wire/ and server import grpc.
"""

try:
    from importlib.metadata import version as _version

    __version__ = _version("shapetuner")
except Exception:  # noqa: BLE001 - running from a source tree that is not installed
    __version__ = "0.0.0"
