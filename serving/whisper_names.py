"""The tensor names of Triton's TensorRT-LLM Whisper model (tensorrtllm_backend's
`whisper_bls`), so that a client written for it transcribes from a Whisper export folder
unchanged, over gRPC or HTTP:

    WAV           FP32   [1, n]  samples at the feature extractor's rate (16 kHz), zero-padded
    WAV_LENS      INT32  [1, 1]  how many of them are the audio (optional: all)
    TEXT_PREFIX   BYTES  [1, 1]  the decoder's first tokens as text, special tokens spelled out
                                 ("<|startoftranscript|><|en|><|transcribe|><|notimestamps|>";
                                 empty: the model's own start, in English where it has languages)
    MAX_NEW_TOKENS INT32 [1, 1]  (optional: as many as the decoder has room for)
    ->
    TRANSCRIPTS   BYTES  [1]     the text so far (every response of a stream holds all of it,
                                 as whisper_bls sends it), special tokens taken out

One window (30 s) per request, as whisper_bls takes it; longer audio is refused, pointing at
the OpenAI endpoint, which cuts it. No grpc here."""

from __future__ import annotations

import re
from typing import Mapping

import numpy as np

from serving.audio import FeatureConfig, WhisperPrompt, log_mel
from serving.conventions import ClientRequest
from serving.errors import InvalidArgument
from serving.model import Signature, TensorSpec
from serving.sampling import GenerationRequest, Sampling

INPUTS = ("WAV", "WAV_LENS", "TEXT_PREFIX", "MAX_NEW_TOKENS")
OUTPUT = "TRANSCRIPTS"
_SPECIAL = re.compile(r"<\|.*?\|>")


def with_whisper_names(signature: Signature) -> Signature:
    """`signature` with whisper_bls's inputs and output beside the LLM names."""
    inputs = (TensorSpec("WAV", "FP32", (-1,)), TensorSpec("WAV_LENS", "INT32", (1,)),
              TensorSpec("TEXT_PREFIX", "BYTES", (1,)), TensorSpec("MAX_NEW_TOKENS", "INT32", (1,)))
    return Signature(signature.inputs + inputs,
                     signature.outputs + (TensorSpec(OUTPUT, "BYTES", (1,)),),
                     signature.token_input, signature.vocab_size)


def transcript(text: str) -> str:
    """The text as whisper_bls answers it: special tokens (timestamps) out, stripped."""
    return _SPECIAL.sub("", text).strip()


def _int(name: str, array, default: int) -> int:
    if array is None:
        return default
    values = np.asarray(array).reshape(-1)
    if values.size != 1 or values.dtype.kind not in "iu":
        raise InvalidArgument(f"'{name}' must hold one integer")
    return int(values[0])


def _samples(tensors: Mapping[str, np.ndarray], config: FeatureConfig) -> np.ndarray:
    wav = np.asarray(tensors["WAV"])
    if wav.dtype.kind != "f" or wav.ndim not in (1, 2) or (wav.ndim == 2 and wav.shape[0] != 1):
        raise InvalidArgument(f"'WAV' must be FP32 samples, [1, n] or [n], not {wav.dtype} "
                              f"{list(wav.shape)} (one audio per request)")
    wav = wav.reshape(-1)
    n = _int("WAV_LENS", tensors.get("WAV_LENS"), len(wav))
    if not 0 < n <= len(wav):
        raise InvalidArgument(f"'WAV_LENS' {n} is not within the {len(wav)} samples sent")
    if n > config.n_samples:
        raise InvalidArgument(f"the audio lasts {n / config.sampling_rate:.1f} s; these names "
                              f"take one {config.chunk_length}-s window (POST "
                              "/v1/audio/transcriptions cuts longer audio into pieces)")
    if not np.isfinite(wav[:n]).all():
        raise InvalidArgument("'WAV' holds a value that is not finite")
    return wav[:n].astype(np.float32)


def _prefix(tensors: Mapping[str, np.ndarray], tokenizer, whisper: WhisperPrompt
            ) -> tuple[int, ...]:
    raw = tensors.get("TEXT_PREFIX")
    values = [] if raw is None else np.asarray(raw, dtype=object).reshape(-1).tolist()
    if len(values) > 1:
        raise InvalidArgument("'TEXT_PREFIX' must hold one string")
    text = values[0] if values else b""
    text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
    if not text.strip():  # whisper_bls's default: English, transcribed, no timestamps
        return whisper.prefix("en" if whisper.languages else None, "transcribe")
    return tuple(tokenizer.encode(text.strip(), add_special_tokens=False).ids)


def parse_audio(tensors: Mapping[str, np.ndarray], *, tokenizer, whisper: WhisperPrompt,
                config: FeatureConfig, room: int, eos_ids, request_id: str = ""
                ) -> ClientRequest:
    """A whisper_bls request as one generation (greedy, as whisper_bls runs it); `room`:
    the decoder's positions."""
    for name in tensors:
        if name not in INPUTS:
            raise InvalidArgument(f"input '{name}' is not one of whisper_bls's "
                                  f"({', '.join(INPUTS)})")
    features = log_mel(_samples(tensors, config), config)
    prefix = _prefix(tensors, tokenizer, whisper)
    limit = room - len(prefix) + 1
    most = _int("MAX_NEW_TOKENS", tensors.get("MAX_NEW_TOKENS"), limit)
    generation = GenerationRequest(prompt=prefix, max_tokens=most, sampling=Sampling(),
                                   stop_ids=frozenset(eos_ids), encoder_input=features,
                                   id=request_id)
    return ClientRequest(generation, stream=True, transcripts=True)
