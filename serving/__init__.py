"""`tuner serve`: the KServe v2 / Open Inference Protocol gRPC server (see serving/server.py).

Layers, each importable alone: wire/ (protocol: protobuf <-> numpy and the error table;
servicer: the thin KServe v2 servicer; generation: its half for decoders; the generated stubs),
batcher (dynamic batching into buckets), model (artifact -> runners, accuracy gate), engine
(validation, batching, shadow checks), kv (a cache model's plain forward), metrics, server
(process, signals); for decoders, generate (the in-flight batching scheduler), sampling,
tokenizer and decoder (the decoder's engine). Only wire/ and server import grpc.
"""

try:
    from importlib.metadata import version as _version

    __version__ = _version("shapetuner")
except Exception:  # noqa: BLE001 - running from a source tree that is not installed
    __version__ = "0.0.0"
