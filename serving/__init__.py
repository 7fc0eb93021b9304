"""`tuner serve`: the KServe v2 / Open Inference Protocol gRPC server (see serving/server.py).

Layers, each importable alone: protocol (protobuf <-> numpy, error table), batcher (dynamic
batching into buckets), model (artifact -> runners, accuracy gate), engine (validation,
batching, shadow checks), metrics, service (the thin servicer), server (process, signals);
for decoders, generate (in-flight batching scheduler), sampling, tokenizer, decoder (the
decoder's engine) and generation_service (its half of the servicer).
Only protocol, service, generation_service and server import grpc (or its messages).
"""

try:
    from importlib.metadata import version as _version

    __version__ = _version("shapetuner")
except Exception:  # noqa: BLE001 - running from a source tree that is not installed
    __version__ = "0.0.0"
