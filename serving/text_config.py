"""What Hugging Face's files beside a decoder say about its text: the end-of-sequence ids
(every one that config.json, generation_config.json and onnxruntime-genai's
genai_config.json name, as transformers' generate and vLLM stop at the generation config's
too: a Llama 3 Instruct folder may name only <|end_of_text|> in config.json and list
<|eot_id|>, which ends every chat turn, in generation_config.json; without any, the id of
tokenizer_config.json's `eos_token`) and the chat template with the special tokens it
refers to: `chat_template.jinja`, where transformers' save_pretrained writes it now, else
tokenizer_config.json's `chat_template` (a string or a list of named templates), else
`chat_template.json` (a processor's); and a beam search's length penalty and early stopping
(generation_config.json's, else config.json's, as transformers' generate takes them); and
the model creator's sampling defaults (generation_config.json's temperature, top_p, top_k,
min_p, repetition_penalty and max_new_tokens where they differ from transformers' own
defaults: what vLLM's OpenAI server applies to a request that names none of them).
Absent or unreadable files give empty facts, never an error: generation without them still
works (the OpenAI chat endpoint then says what is missing).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

TOKENIZER_CONFIG = "tokenizer_config.json"
# where the chat template may be, in transformers' order: its own file first
CHAT_TEMPLATE_FILES = ("chat_template.jinja", TOKENIZER_CONFIG, "chat_template.json")
_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TextConfig:
    eos_ids: tuple[int, ...] = ()
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    length_penalty: float = 1.0  # a beam search's, unless a request names its own
    early_stopping: bool | str = False  # True, False or "never"
    # generation_config.json's sampling settings, (name, value) as the file names them;
    # values out of range are not settings
    sampling: tuple[tuple[str, float | int], ...] = ()


def read_json(path: Path):
    """A small JSON file beside the model (16 MiB at most), or None when it is absent, too
    large or unreadable: these files add facts, never errors."""
    try:
        if path.is_file() and path.stat().st_size <= _MAX_BYTES:
            return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    return None


def read_dict(path: Path) -> dict:
    """read_json's object, {} where the file holds none."""
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def _token(value) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def special_token(folder: Path | None, key: str) -> str:
    """tokenizer_config.json's special token `key` (mask_token, unk_token, ...); "" if none."""
    if folder is None:
        return ""
    return _token(read_dict(folder / TOKENIZER_CONFIG).get(key))


def _template(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def token_ids(value) -> list[int]:
    """Token ids as these files write them (`eos_token_id`, `suppress_tokens`): an id or a
    list of ids; anything else, none."""
    if isinstance(value, list):
        return [i for i in value if isinstance(i, int) and not isinstance(i, bool)]
    return [value] if isinstance(value, int) and not isinstance(value, bool) else []


def load_text_config(folder: Path | None, tokenizer=None) -> TextConfig:
    if folder is None:
        return TextConfig()
    folder = Path(folder)
    config, tok = read_dict(folder / "config.json"), read_dict(folder / TOKENIZER_CONFIG)
    genai = read_dict(folder / "genai_config.json").get("model")
    named = (token_ids(config.get("eos_token_id"))
             + token_ids(read_dict(folder / "generation_config.json").get("eos_token_id"))
             + token_ids(genai.get("eos_token_id") if isinstance(genai, dict) else None))
    ids = list(dict.fromkeys(named))  # each once, in the files' order
    eos_token = _token(tok.get("eos_token"))
    if not ids and eos_token and tokenizer is not None:
        found = tokenizer.token_to_id(eos_token)
        ids = [found] if found is not None else []
    generation = read_dict(folder / "generation_config.json")
    search = {**_search(config), **_search(generation)}
    return TextConfig(tuple(ids), _chat_template(folder, tok), _token(tok.get("bos_token")),
                      eos_token, sampling=sampling_defaults(generation), **search)


# generation_config.json's sampling keys: (kind, valid, transformers' default). A value equal
# to transformers' default is no setting (vLLM reads the file's difference from the
# defaults: a file that writes top_k 50, transformers' default, leaves vLLM's top_k off).
_SAMPLING = {
    "temperature": (float, lambda v: v >= 0, 1.0),
    "top_p": (float, lambda v: 0 < v <= 1, 1.0),
    "top_k": (int, lambda v: v >= 0, 50),
    "min_p": (float, lambda v: 0 <= v <= 1, None),
    "repetition_penalty": (float, lambda v: v > 0, 1.0),
    "max_new_tokens": (int, lambda v: v >= 1, None),
}


def sampling_defaults(generation: dict) -> tuple[tuple[str, float | int], ...]:
    """The sampling settings a generation config names (a value of the wrong type or out of
    range skipped: these files add facts, never errors)."""
    out = []
    for key, (kind, valid, default) in _SAMPLING.items():
        value = generation.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or kind is int and value != int(value):
            continue
        value = kind(value)
        if valid(value) and value != default:
            out.append((key, value))
    return tuple(out)


def _search(config: dict) -> dict:
    """A beam search's settings a config file names (the others skipped: a value of the
    wrong type is not a setting)."""
    out: dict = {}
    penalty, early = config.get("length_penalty"), config.get("early_stopping")
    if isinstance(penalty, (int, float)) and not isinstance(penalty, bool) and math.isfinite(
            penalty):
        out["length_penalty"] = float(penalty)
    if early in (True, False, "never"):
        out["early_stopping"] = early
    return out


def _chat_template(folder: Path, tok: dict) -> str | None:
    jinja = folder / CHAT_TEMPLATE_FILES[0]
    try:
        if jinja.is_file() and jinja.stat().st_size <= _MAX_BYTES:
            return jinja.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    return (_template(tok.get("chat_template"))
            or _template(read_dict(folder / CHAT_TEMPLATE_FILES[2]).get("chat_template")))
