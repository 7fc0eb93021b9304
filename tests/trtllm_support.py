"""What TensorRT-LLM's Triton clients send, as tensors (tritonclient), and a stream to send
them on: the helpers of tests/test_trtllm_clients.py (its core model) and
tests/test_trtllm_batches.py (its ensemble's client, batches of prompts)."""

from __future__ import annotations

import queue
from contextlib import contextmanager

import numpy as np
import tritonclient.grpc as tg
from llm_support import PROMPT, tokenizer
from serving_support import slowed
from tritonclient.utils import np_to_triton_dtype

LONG = 60  # tokens: a generation that runs long enough to be stopped


def tensor(module, name: str, array: np.ndarray):
    made = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    made.set_data_from_numpy(array)
    return made


def example_inputs(prompt: list[int], tokens: int, streaming: bool, module=tg, **extra):
    """What TensorRT-LLM's example client sends: every control [1, 1], its dtypes."""
    arrays = {"input_ids": np.array([prompt], np.int32),
              "input_lengths": np.array([[len(prompt)]], np.int32),
              "request_output_len": np.array([[tokens]], np.uint32),
              "beam_width": np.array([[1]], np.uint32),
              "temperature": np.array([[1.0]], np.float32),
              "streaming": np.array([[streaming]], bool), **extra}
    return [tensor(module, n, a) for n, a in arrays.items()]


def stop_inputs(module=tg):
    """Its stop request: a placeholder prompt, nothing to generate, `stop` true."""
    return [tensor(module, "input_ids", np.empty([1, 1], np.int32)),
            tensor(module, "input_lengths", np.zeros([1, 1], np.int32)),
            tensor(module, "request_output_len", np.array([[0]], np.uint32)),
            tensor(module, "stop", np.array([[True]], bool))]


class Stream:
    """A tritonclient gRPC stream whose responses (or errors) queue up."""

    def __init__(self, server) -> None:
        self.client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
        self.got: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.got.put((result, error)))

    def send(self, model: str, inputs, request_id: str, **parameters) -> None:
        self.client.async_stream_infer(model, inputs, request_id=request_id,
                                       parameters=parameters or None)

    def close(self) -> list:
        """Wait for the server to end the stream (as the example client does); every
        response, an error raised."""
        self.client.stop_stream()
        self.client.close()
        out = []
        while not self.got.empty():
            result, error = self.got.get()
            if error is not None:
                raise error
            out.append(result)
        return out


@contextmanager
def slow(server):
    """Decode steps of 10 ms: a stop request lands while its target still runs."""
    generator, fast = slowed(server, 0.01)
    try:
        yield
    finally:
        generator.runner = fast


def prompt_ids() -> list[int]:
    return tokenizer().encode(PROMPT).ids


def pack(words: list[list[int]]) -> np.ndarray:
    """A word list as TensorRT-LLM packs it: [1, 2, n], ids then end offsets, -1 padded."""
    ids = [t for w in words for t in w]
    ends = np.cumsum([len(w) for w in words]).tolist()
    return np.array([[ids, ends + [-1] * (len(ids) - len(ends))]], np.int32)


def unary(server, prompt: list[int], tokens: int, **extra) -> tuple[list[int], object]:
    client = tg.InferenceServerClient(f"127.0.0.1:{server.port}")
    result = client.infer(server.slot.name, example_inputs(
        prompt, tokens, False, exclude_input_in_output=np.array([[True]], bool), **extra))
    client.close()
    return beams_of(result)[0], result


def beams_of(result) -> list[list[int]]:
    """The core model's answer as TensorRT-LLM's clients read it: each row of output_ids[0]
    a beam, cut to its sequence_length."""
    lengths = result.as_numpy("sequence_length")[0]
    return [row[:n].tolist() for row, n in zip(result.as_numpy("output_ids")[0], lengths)]


def fresh_pair(want: list[int]) -> int:
    """A position j whose pair (want[j], want[j + 1]) does not occur before it."""
    return next(j for j in range(1, len(want) - 1)
                if (want[j], want[j + 1]) not in zip(want[:j], want[1:j + 1]))


def bytes_input(name: str, array: np.ndarray):
    made = tg.InferInput(name, list(array.shape), "BYTES")
    made.set_data_from_numpy(array)
    return made
