"""Audio in, Whisper's encoder input out: an audio file read (WAV, FLAC, OGG, MP3, AIFF, as
libsndfile reads them; any rate, any number of channels), resampled to the feature
extractor's rate, and its log-mel spectrogram as
Whisper computes it (transformers' WhisperFeatureExtractor, the same arithmetic in numpy:
tests/test_audio_transcription.py compares the two). No grpc, no transformers here.

    samples (n,) at 16 kHz -> zero-padded to 30 s -> |STFT|^2 (400-point Hann, hop 160,
    centred, reflect-padded) -> 80 Slaney mel bands -> log10 -> floor at max - 8 ->
    (x + 4) / 4 -> (80, 3000)
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from serving.errors import InvalidArgument
from serving.text_config import read_json

@dataclass(frozen=True)
class FeatureConfig:
    """preprocessor_config.json's WhisperFeatureExtractor fields."""

    mel_bins: int = 80
    sampling_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    chunk_length: int = 30  # seconds: what one encoder run hears

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @property
    def frames(self) -> int:
        return self.n_samples // self.hop_length


def feature_config(folder: Path) -> FeatureConfig | None:
    """The folder's Whisper feature extractor, None when it has none."""
    data = read_json(Path(folder) / "preprocessor_config.json")
    if not isinstance(data, dict) or data.get("feature_extractor_type") != \
            "WhisperFeatureExtractor":
        return None
    d = FeatureConfig()
    ints = {k: data.get(k) for k in ("feature_size", "sampling_rate", "n_fft", "hop_length",
                                     "chunk_length")}
    if not all(isinstance(v, int) and v > 0 for v in ints.values() if v is not None):
        return None
    return FeatureConfig(ints["feature_size"] or d.mel_bins,
                         ints["sampling_rate"] or d.sampling_rate, ints["n_fft"] or d.n_fft,
                         ints["hop_length"] or d.hop_length,
                         ints["chunk_length"] or d.chunk_length)


# ----------------------------------------------------------------------------- audio files

BLOCK = 1 << 20  # frames decoded at a time (a file's channels are averaged block by block)
MAX_DECODED_RATE = 48000  # a file decodes to at most its seconds' worth at this rate (a
# compressed file is small for its length: its frame count, not its size, bounds the memory)


def read_audio(data: bytes, max_seconds: float) -> tuple[np.ndarray, int]:
    """(mono samples in [-1, 1] as float32, sampling rate) of an audio file as libsndfile
    reads it (soundfile): WAV (integer PCM, float, extensible), FLAC, OGG (Vorbis, Opus),
    MP3, AIFF, ...; its channels averaged. InvalidArgument for anything else, for a rate
    outside 1-768 kHz, and for audio over `max_seconds` (or its decoded length at 48 kHz):
    both known from the header, before anything is decoded."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(data))
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgument("the audio is not in a format this reads (WAV, FLAC, OGG, MP3, "
                              "AIFF): convert it, e.g. `ffmpeg -i in.m4a -ar 16000 "
                              "out.wav`") from None
    rate, frames = int(info.samplerate), int(info.frames)
    if not 1000 <= rate <= 768000:
        raise InvalidArgument(f"a sampling rate of {rate} Hz is not audio this reads "
                              "(1 kHz to 768 kHz)")
    if frames / rate > max_seconds or frames > max_seconds * MAX_DECODED_RATE:
        raise InvalidArgument(f"the audio lasts {frames / rate:.0f} s at {rate} Hz; at most "
                              f"{max_seconds:.0f} s (at up to {MAX_DECODED_RATE} Hz) are taken")
    out = np.empty(frames, np.float32)
    at = 0
    try:
        for block in soundfile.blocks(io.BytesIO(data), blocksize=BLOCK, dtype="float32",
                                      always_2d=True):
            n = min(len(block), frames - at)
            out[at:at + n] = block[:n].mean(axis=1)
            at += n
    except (RuntimeError, ValueError) as e:
        raise InvalidArgument(f"the audio file is damaged: {e}") from None
    return out[:at], rate


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """`x` at `target` Hz: band-limited resampling (its spectrum cut or zero-extended)."""
    if rate == target or not len(x):
        return x
    n = max(1, round(len(x) * target / rate))
    spectrum = np.fft.rfft(x.astype(np.float64))
    keep = min(len(spectrum), n // 2 + 1)
    out = np.zeros(n // 2 + 1, complex)
    out[:keep] = spectrum[:keep]
    return (np.fft.irfft(out, n) * (n / len(x))).astype(np.float32)


MOST_PIECES = 120  # one request's audio: 60 minutes of 30-s windows


def check_length(samples: int, rate: int, c: FeatureConfig, most: int = MOST_PIECES) -> None:
    """InvalidArgument for audio longer than `most` windows (checked before resampling:
    what a request may make this server compute is bounded by its length in seconds)."""
    if samples / rate > most * c.chunk_length:
        raise InvalidArgument(f"the audio lasts {samples / rate:.0f} s; at most "
                              f"{most * c.chunk_length} s are taken")


def pieces(samples: np.ndarray, c: FeatureConfig, search_s: float = 1.0,
           most: int = MOST_PIECES) -> list[np.ndarray]:
    """Audio longer than one window cut into pieces of at most chunk_length seconds, each
    cut at the quietest 100 ms of the last `search_s` before the limit (vLLM's approach: a
    cut between words, not through one); at most `most` pieces (InvalidArgument past it)."""
    limit, rate = c.n_samples, c.sampling_rate
    check_length(len(samples), rate, c, most)
    out, at, frame = [], 0, max(1, rate // 10)
    while len(samples) - at > limit:
        low = at + limit - int(search_s * rate)
        window = samples[low:at + limit].astype(np.float64) ** 2
        energy = np.convolve(window, np.ones(frame), "valid")[::frame // 2 or 1]
        cut = low + int(np.argmin(energy)) * (frame // 2 or 1) + frame // 2
        out.append(samples[at:cut])
        at = cut
    return out + [samples[at:]]


# ------------------------------------------------------------------------- log-mel features


def _hz_to_mel(f):  # Slaney's scale: linear below 1 kHz, logarithmic above
    f = np.asarray(f, np.float64)
    log = 15.0 + 27.0 * np.log(np.maximum(f, 1e-10) / 1000.0) / np.log(6.4)
    return np.where(f >= 1000.0, log, 3.0 * f / 200.0)


def _mel_to_hz(m):
    m = np.asarray(m, np.float64)
    return np.where(m >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15.0)), 200.0 * m / 3.0)


@lru_cache(maxsize=4)
def mel_filters(c: FeatureConfig) -> np.ndarray:
    """(1 + n_fft / 2, mel bins): triangles on Slaney's mel scale from 0 to 8 kHz, each of
    unit area (Slaney's norm)."""
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(8000.0), c.mel_bins + 2))
    bins = np.linspace(0, c.sampling_rate // 2, 1 + c.n_fft // 2)
    slopes = edges[None, :] - bins[:, None]
    widths = np.diff(edges)
    down, up = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))


def log_mel(samples: np.ndarray, c: FeatureConfig) -> np.ndarray:
    """(mel bins, frames) float32: Whisper's input for up to chunk_length seconds of audio at
    c.sampling_rate (longer is InvalidArgument)."""
    if len(samples) > c.n_samples:
        raise InvalidArgument(f"the audio lasts {len(samples) / c.sampling_rate:.1f} s; one "
                              f"request takes at most {c.chunk_length} s (the encoder's "
                              "window): send it in pieces")
    x = np.zeros(c.n_samples, np.float64)
    x[:len(samples)] = samples
    half = c.n_fft // 2
    x = np.pad(x, half, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(x, c.n_fft)[::c.hop_length]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(c.n_fft) / c.n_fft)  # periodic Hann
    power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2  # (frames + 1, bins)
    mel = np.log10(np.maximum(1e-10, power @ mel_filters(c))).T[:, :-1]
    mel = np.maximum(mel, mel.max() - 8.0)
    return ((mel + 4.0) / 4.0).astype(np.float32)


# ------------------------------------------------------------------- the decoder's first tokens

# Whisper's languages, code: name (its tokenizer's table; OpenAI's verbose answers name them)
LANGUAGES = dict(pair.split(":") for pair in (
    "en:english, zh:chinese, de:german, es:spanish, ru:russian, ko:korean, fr:french, "
    "ja:japanese, pt:portuguese, tr:turkish, pl:polish, ca:catalan, nl:dutch, ar:arabic, "
    "sv:swedish, it:italian, id:indonesian, hi:hindi, fi:finnish, vi:vietnamese, he:hebrew, "
    "uk:ukrainian, el:greek, ms:malay, cs:czech, ro:romanian, da:danish, hu:hungarian, "
    "ta:tamil, no:norwegian, th:thai, ur:urdu, hr:croatian, bg:bulgarian, lt:lithuanian, "
    "la:latin, mi:maori, ml:malayalam, cy:welsh, sk:slovak, te:telugu, fa:persian, "
    "lv:latvian, bn:bengali, sr:serbian, az:azerbaijani, sl:slovenian, kn:kannada, "
    "et:estonian, mk:macedonian, br:breton, eu:basque, is:icelandic, hy:armenian, ne:nepali, "
    "mn:mongolian, bs:bosnian, kk:kazakh, sq:albanian, sw:swahili, gl:galician, mr:marathi, "
    "pa:punjabi, si:sinhala, km:khmer, sn:shona, yo:yoruba, so:somali, af:afrikaans, "
    "oc:occitan, ka:georgian, be:belarusian, tg:tajik, sd:sindhi, gu:gujarati, am:amharic, "
    "yi:yiddish, lo:lao, uz:uzbek, fo:faroese, ht:haitian creole, ps:pashto, tk:turkmen, "
    "nn:nynorsk, mt:maltese, sa:sanskrit, lb:luxembourgish, my:myanmar, bo:tibetan, "
    "tl:tagalog, mg:malagasy, as:assamese, tt:tatar, haw:hawaiian, ln:lingala, ha:hausa, "
    "ba:bashkir, jw:javanese, su:sundanese, yue:cantonese").split(", "))


def language_code(language: str) -> str:
    """A language as a client names it ("en", "EN", "English") as Whisper's code ("en");
    a name it does not know is returned as given (the model's table decides)."""
    key = language.strip().lower()
    return next((code for code, name in LANGUAGES.items() if name == key), key)


@dataclass(frozen=True)
class WhisperPrompt:
    """What Whisper's generation_config.json says the decoder starts with (transformers'
    WhisperGenerationMixin: earlier text after <|startofprev|> where a prompt is given, the
    start token, the language's, the task's, and <|notimestamps|> when no timestamps are
    asked for)."""

    start: int
    languages: dict[str, int]  # "en" -> the id of <|en|> (multilingual models)
    tasks: dict[str, int]  # "transcribe" / "translate" -> its token's id
    no_timestamps: int | None = None
    forced: tuple[int, ...] = ()  # an older config's forced_decoder_ids, without the maps
    previous: int | None = None  # <|startofprev|> (prev_sot_token_id): earlier text after it

    @property
    def no_speech(self) -> int | None:
        """<|nospeech|>: the id before <|notimestamps|> (transformers' rule)."""
        return None if self.no_timestamps is None else self.no_timestamps - 1

    def prefix(self, language: str | None, task: str, timestamps: bool = False,
               before: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The first tokens for `task` in `language` (a code, "en"; None: detected first,
        by the caller, where the model is multilingual), with `before` (earlier text's ids)
        ahead of them. InvalidArgument for a language or task the model has no token for."""
        if before and self.previous is None:
            raise InvalidArgument("this model names no <|startofprev|> token "
                                  "(prev_sot_token_id): it takes no prompt")
        out = [self.previous, *before] if before else []
        out.append(self.start)
        if not self.tasks:
            out += self.forced
        else:
            if self.languages:
                if language not in self.languages:
                    raise InvalidArgument(f"language {language!r} is not one of this model's: "
                                          f"{', '.join(sorted(self.languages))}")
                out.append(self.languages[language])
            if task not in self.tasks:
                raise InvalidArgument(f"this model has no {task!r} task (it has "
                                      f"{', '.join(sorted(self.tasks))})")
            out.append(self.tasks[task])
        if self.no_timestamps is not None and not timestamps and out[-1] != self.no_timestamps:
            out.append(self.no_timestamps)
        elif timestamps and out[-1] == self.no_timestamps:
            out.pop()  # (an older config forces it)
        return tuple(out)


def whisper_prompt(folder: Path, start: int) -> WhisperPrompt:
    g = read_json(Path(folder) / "generation_config.json")
    g = g if isinstance(g, dict) else {}

    def ids(key: str) -> dict[str, int]:
        found = g.get(key) if isinstance(g.get(key), dict) else {}
        return {k.strip("<|>"): v for k, v in found.items() if isinstance(v, int)}

    forced = g.get("forced_decoder_ids") if isinstance(g.get("forced_decoder_ids"), list) else []
    nots, previous = g.get("no_timestamps_token_id"), g.get("prev_sot_token_id")
    return WhisperPrompt(start, ids("lang_to_id") if g.get("is_multilingual", True) else {},
                         ids("task_to_id"), nots if isinstance(nots, int) else None,
                         tuple(p[1] for p in sorted(f for f in forced if isinstance(f, list)
                                                    and len(f) == 2 and isinstance(f[1], int))),
                         previous if isinstance(previous, int) else None)
