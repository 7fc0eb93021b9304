"""The floor for bench/serve_latency.py: the least a Python gRPC server can add around the same
ONNX Runtime call. A bare grpcio servicer (same generated stubs, same session settings) that
answers ModelInfer with no validation, batching, statistics or metrics: raw bytes in
(np.frombuffer), session.run, raw bytes out. Whatever it adds over the in-process call is
gRPC, the loopback and the two processes' wake-ups on this machine; whatever `tuner serve`
adds beyond it is our own code.

    python bench/serve_floor_server.py MODEL.onnx PORT SETTINGS_JSON

Started and stopped (SIGTERM) by bench/serve_latency.py; not a server for anything else.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
from serving.datatypes import DATATYPES, datatype_of  # noqa: E402
from serving.wire._generated import inference_pb2 as pb  # noqa: E402
from serving.wire._generated import inference_pb2_grpc as pb_grpc  # noqa: E402
from tuner.runtime.base import SessionSettings  # noqa: E402
from tuner.runtime.ort import load_cpu  # noqa: E402


class FloorServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, session) -> None:
        self.session = session
        self.outputs = [o.name for o in session.get_outputs()]

    def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=True)

    def ModelInfer(self, request, context):
        feeds = {t.name: np.frombuffer(raw, DATATYPES[t.datatype]).reshape(tuple(t.shape))
                 for t, raw in zip(request.inputs, request.raw_input_contents)}
        response = pb.ModelInferResponse(model_name=request.model_name, model_version="1")
        for name, array in zip(self.outputs, self.session.run(self.outputs, feeds)):
            response.outputs.add(name=name, datatype=datatype_of(array.dtype), shape=array.shape)
            response.raw_output_contents.append(array.tobytes())
        return response


def main() -> int:
    model, port, settings = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    session = load_cpu(model, SessionSettings(**settings))
    server = grpc.server(ThreadPoolExecutor(8), options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(FloorServicer(session), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.wait(0.2):
        pass
    server.stop(5).wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
