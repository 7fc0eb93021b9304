"""A Whisper export that hears its audio, for the tests and the benchmarks: made-up audio (a
tone with noise) and WAV files of it, the tests' random-weight Whisper export copied with its
audio path scaled up and a word-level tokenizer ("w7" is id 7), optionally Whisper's timestamp
settings in its generation config and Whisper's special tokens named in its tokenizer (as
Triton's whisper_bls clients spell its prompt)."""

from __future__ import annotations

import io
import json
import shutil
import wave
from pathlib import Path

import numpy as np
import onnx

RATE = 16000
# the special tokens named_special_tokens gives names, with the ids the tests' Whisper uses
SPECIAL = {"<|startoftranscript|>": 1, "<|endoftext|>": 2, "<|en|>": 10, "<|transcribe|>": 12,
           "<|notimestamps|>": 14}
PREFIX = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def tone(seconds: float, rate: int = RATE, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(len(t)) * 0.05
    return (0.3 * np.sin(2 * np.pi * 300 * t) + noise).astype(np.float32)


def wav(x: np.ndarray, rate: int = RATE, width: int = 2, channels: int = 1) -> bytes:
    """A PCM WAV file of `x` (stdlib `wave`), every channel the same."""
    ints = {1: (x * 127 + 128).astype(np.uint8), 2: (x * 32767).astype("<i2"),
            4: (x * 2147483647).astype("<i4")}[width]
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(np.repeat(ints, channels).tobytes())
    return out.getvalue()


def _scaled(path: Path, factors: dict[str, float]) -> None:
    """The graph at `path` with the weights named (an initializer's name, or the end of the
    name of the MatMul node that reads it) scaled."""
    proto = onnx.load(str(path))
    weights = {i.name: i for i in proto.graph.initializer}
    for name, factor in factors.items():
        names = [name] if name in weights else [
            x for n in proto.graph.node if n.name.endswith(name) for x in n.input if x in weights]
        assert names, f"{path.name}: no weight {name}"
        for x in names:
            value = onnx.numpy_helper.to_array(weights[x]) * factor
            weights[x].CopyFrom(onnx.numpy_helper.from_array(value.astype(np.float32), x))
    onnx.save(proto, str(path))


def whisper_copy(export: Path, folder: Path) -> Path:
    """A copy of the tests' Whisper export at `folder` that hears its audio, with a tokenizer
    (a word-level one over its ids: "w7" is id 7), as Whisper ships one. With random
    weights the encoder's positions drown the audio and every file gives the same tokens:
    here its convolutions and the decoders' cross-attention outputs are scaled up (the same
    in both decoders, whose cache path stays exact), so that a tone, noise and silence are
    told apart; the merged decoder is left out (Optimum then loads these two)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.copytree(export, folder)
    (folder / "decoder_model_merged.onnx").unlink(missing_ok=True)
    _scaled(folder / "encoder_model.onnx", {"conv1.weight": 10.0, "conv2.weight": 10.0})
    for name in ("decoder_model.onnx", "decoder_with_past_model.onnx"):
        _scaled(folder / name, {"encoder_attn/out_proj/MatMul": 20.0})
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 1003)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def with_timestamps(folder: Path, no_timestamps: int = 900, previous: int = 898) -> Path:
    """`folder`'s generation config given Whisper's timestamp, prompt and initial-timestamp
    settings (the tests' ids: timestamps 901..1002, 0.00-2.02 s; <|nospeech|> 899)."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text())
    config.pop("_from_model_config", None)  # (else transformers rebuilds it from config.json)
    config.update(no_timestamps_token_id=no_timestamps, prev_sot_token_id=previous,
                  max_initial_timestamp_index=50)
    path.write_text(json.dumps(config))
    return folder


def named_special_tokens(folder: Path) -> Path:
    """`folder`'s tokenizer with ids 1, 2, 10, 12 and 14 named as Whisper's special tokens
    (SPECIAL), so that a client spelling Whisper's prompt (PREFIX) is understood."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    names = {v: k for k, v in SPECIAL.items()}
    vocab = {names.get(i, f"w{i}"): i for i in range(1003) if i not in (0, 3)}
    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 3, **vocab}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    assert tok.encode(PREFIX, add_special_tokens=False).ids == [1, 10, 12, 14]
    tok.save(str(folder / "tokenizer.json"))
    return folder
