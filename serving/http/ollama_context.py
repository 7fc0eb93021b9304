"""Ollama's way with a prompt past the model's context, which its clients count on: a chat
client sends its whole history every turn, and Ollama answers however long it grows.

- A chat's oldest messages are left out until the prompt fits, its system messages and its
  last message always kept (Ollama's chatPrompt).
- A prompt still too long keeps its first `num_keep` tokens (Ollama's option, 4 by default)
  and its last ones (Ollama's runner).
- Ollama generates past a full window by shifting it (half of it dropped); this engine's
  cache cannot shift, so a prompt cut for room leaves the answer what it asked for
  (`num_predict`), at most half the model's length, and `num_predict` past the room left is
  cut to it (the answer ends with done_reason "length").

Nothing changes for a prompt that fits with the answer it asks for."""

from __future__ import annotations

from typing import Callable, Sequence

from serving.errors import InvalidArgument
from serving.http.openai_requests import body_value

NUM_KEEP = 4  # Ollama's default num_keep


def predict_of(body: dict) -> int | None:
    """A request's num_predict (None: as many as there is room for, Ollama's -1 and -2)."""
    predict = body_value(body.get("options") or {}, "num_predict", (int,), -1)
    if predict == 0 or predict < -2:
        raise InvalidArgument("'num_predict' must be a positive number of tokens, or -1 / -2 "
                              "(no limit)")
    return predict if predict > 0 else None


def prompt_limit(generator, predict: int | None, prompt_tokens: int) -> int | None:
    """The most prompt tokens this request may keep, or None where it fits as it is.
    `predict`: the answer's num_predict (None: as long as there is room), which --max-tokens
    bounds."""
    if predict is not None:
        predict = min(predict, generator.options.max_tokens)
    if prompt_tokens <= generator.max_prompt and (
            predict is None or predict <= generator.room(prompt_tokens)):
        return None
    want = min(predict or generator.max_cache_len, generator.max_cache_len // 2)
    return max(1, generator.max_prompt - max(0, want - generator.room(generator.max_prompt)))


def fitted(generator, body: dict, ids: tuple[int, ...], messages: Sequence[dict] | None = None,
           encode: Callable[[list[dict]], tuple[int, ...]] | None = None) -> tuple[int, ...]:
    """The prompt a request (its `body`) runs: `ids` where they fit; else, for a chat (its
    `messages`, which `encode` renders and tokenizes), its oldest messages left out, then the
    tokens cut, keeping the first num_keep (negative: as many as fit)."""
    keep = body_value(body.get("options") or {}, "num_keep", (int,), NUM_KEEP)
    limit = prompt_limit(generator, predict_of(body), len(ids))
    if limit is None:
        return ids
    if messages is not None and encode is not None:
        ids = encode(fitted_messages(messages, lambda kept: len(encode(kept)) <= limit))
    return cut(ids, limit, limit if keep < 0 else keep)


def fitted_messages(messages: Sequence[dict], fits: Callable[[list[dict]], bool]) -> list[dict]:
    """The most recent messages that `fits`, with every system message before them; at
    least the last message."""
    last = len(messages) - 1
    for start in range(last + 1):
        kept = [m for m in messages[:start] if m.get("role") == "system"] + \
            list(messages[start:])
        if start == last or fits(kept):
            return kept
    return list(messages)  # no messages


def cut(ids: tuple[int, ...], limit: int, keep: int) -> tuple[int, ...]:
    """`ids` in `limit` tokens: the first `keep` and the last ones."""
    if len(ids) <= limit:
        return ids
    keep = max(0, min(keep, limit))
    return ids[:keep] + ids[len(ids) - (limit - keep):]
