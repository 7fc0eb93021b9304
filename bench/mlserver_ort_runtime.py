"""A minimal onnxruntime runtime for MLServer 1.7, used by bench/serve_throughput.py to serve
the same ONNX model for comparison. Runs inside MLServer's own venv (never imported by
shapetuner). model-settings.json: {"implementation": "mlserver_ort_runtime.OrtRuntime",
"parameters": {"uri": "/path/model.onnx"}}."""

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OrtRuntime(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.inter_op_num_threads = 1  # as tuner's SessionSettings default
        extra = self.settings.parameters.extra or {}
        if "intra_op_threads" in extra:  # bench/serve_throughput.py's "2 workers x 1 thread"
            options.intra_op_num_threads = int(extra["intra_op_threads"])
        options.log_severity_level = 3
        self._session = ort.InferenceSession(self.settings.parameters.uri, options,
                                             providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        outs = self._session.run(self._outputs, feeds)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(n, o) for n, o in zip(self._outputs, outs)])
