"""A client written for Triton's TensorRT-LLM Whisper model (tensorrtllm_backend's
whisper_bls: `WAV`, `WAV_LENS`, `TEXT_PREFIX` in, `TRANSCRIPTS` out) transcribes from a
Whisper export folder unchanged: the real tritonclient over gRPC (unary and streamed) and
HTTP, its tensors built as that backend's example client builds them (the samples
zero-padded to a 10-s multiple, their count in WAV_LENS, the prefix as text with its
special tokens spelled out). The text is the loop's own greedy tokens from the same audio."""

from __future__ import annotations

import queue
from pathlib import Path

import numpy as np
import pytest

from models import optimum
from models.whisper import PREFIX, RATE, named_special_tokens, tone, whisper_copy
from serving.audio import FeatureConfig, log_mel
from serving.sampling import GenerationRequest, Sampling
from serving.whisper_names import transcript
from tests.audio_support import loop
from tests.llm_support import start

@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    export = optimum.export_all([("whisper", optimum.SEQ2SEQ_TASKS[1])])[0].parent
    return named_special_tokens(whisper_copy(export, tmp_path_factory.mktemp("bls") / "whisper"))


def _bls_inputs(client_module, audio: np.ndarray, prefix: str):
    """The tensors as tensorrtllm_backend's Whisper client builds them."""
    from tritonclient.utils import np_to_triton_dtype

    samples = np.zeros((1, 10 * RATE * (int(len(audio) / RATE // 10) + 1)), np.float32)
    samples[0, :len(audio)] = audio
    lengths = np.array([[len(audio)]], np.int32)
    inputs = [client_module.InferInput("WAV", samples.shape, np_to_triton_dtype(samples.dtype)),
              client_module.InferInput("WAV_LENS", lengths.shape,
                                       np_to_triton_dtype(lengths.dtype)),
              client_module.InferInput("TEXT_PREFIX", [1, 1], "BYTES")]
    inputs[0].set_data_from_numpy(samples)
    inputs[1].set_data_from_numpy(lengths)
    inputs[2].set_data_from_numpy(np.array([prefix], dtype=object).reshape((1, 1)))
    return inputs


def _text(result) -> str:
    value = result.as_numpy("TRANSCRIPTS")[0]
    return (b" ".join(value) if isinstance(value, np.ndarray) else value).decode("utf-8")


def test_a_whisper_bls_client_transcribes(whisper):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tokenizers import Tokenizer

    audio = tone(3.0)
    features = log_mel(audio, FeatureConfig())
    generator = loop(whisper)
    try:
        room = generator.max_target + 1
        expected = {}
        for prefix, ids in ((PREFIX, (1, 10, 12, 14)), ("", (1,))):
            request = GenerationRequest(prompt=ids, max_tokens=room - len(ids),
                                        sampling=Sampling(), stop_ids=frozenset({2}),
                                        encoder_input=features)
            tokens = [t for c in generator.generate(request) for t in c.ids]
            expected[prefix] = transcript(
                Tokenizer.from_file(str(whisper / "tokenizer.json")).decode(tokens))
    finally:
        generator.close()
    assert expected[PREFIX] and expected[""] != expected[PREFIX]
    server = start(whisper, model_name="whisper_bls")
    try:
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{server.port}")
        config = grpc.get_model_config("whisper_bls", as_json=True)["config"]
        assert {"WAV", "WAV_LENS", "TEXT_PREFIX"} <= {i["name"] for i in config["input"]}
        wanted = [grpcclient.InferRequestedOutput("TRANSCRIPTS")]
        for prefix, text in expected.items():
            got = grpc.infer("whisper_bls", _bls_inputs(grpcclient, audio, prefix),
                             request_id="1", outputs=wanted)
            assert _text(got) == text
        http = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        got = http.infer("whisper_bls", _bls_inputs(httpclient, audio, PREFIX),
                         outputs=[httpclient.InferRequestedOutput("TRANSCRIPTS")])
        assert _text(got) == expected[PREFIX]

        # decoupled: every response holds the text so far; the last, all of it
        answers: queue.Queue = queue.Queue()
        grpc.start_stream(callback=lambda result, error: answers.put((result, error)))
        grpc.async_stream_infer("whisper_bls", _bls_inputs(grpcclient, audio, PREFIX),
                                request_id="7")
        texts = []
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            texts.append(_text(result))
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        grpc.stop_stream()
        assert texts[-1] == expected[PREFIX] and len(texts) > 2
        assert all(texts[-1].startswith(t) for t in texts)

        silence = grpc.infer("whisper_bls", _bls_inputs(grpcclient, audio * 0, PREFIX))
        assert _text(silence) != expected[PREFIX]  # (the audio reaches the model)
        too_long = _bls_inputs(grpcclient, tone(31.0), PREFIX)
        with pytest.raises(Exception, match="/v1/audio/transcriptions"):
            grpc.infer("whisper_bls", too_long)
    finally:
        server.stop(0)
