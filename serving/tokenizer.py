"""The artifact's tokenizer (a `tokenizer.json` beside the model, read with the `tokenizers`
library) and an incremental detokenizer for streaming. No grpc here.

Why incremental decoding needs care: one character can span several tokens (byte-level BPE
splits a multi-byte UTF-8 character into byte tokens), and decoding a token alone can also
lose the space a tokenizer adds between words. So each step decodes a short window of recent
ids, and text is released only once it no longer ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from serving.errors import InvalidArgument

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


def load_tokenizer(folder: Path):
    """The `tokenizers.Tokenizer` in `folder/tokenizer.json`, or None when there is none.
    Padding and truncation saved in the file are turned off, as transformers turns them off
    for a call that does not ask for them: a tokenizer.json saved with fixed padding (MiniLM's
    pads to 128) would otherwise fill every prompt with pad tokens."""
    path = Path(folder) / TOKENIZER_FILE
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def cutting(tokenizer, max_tokens: int | None, direction: str = "right",
            strategy: str = "longest_first"):
    """A copy of `tokenizer` that cuts what it encodes to `max_tokens`, its special tokens
    kept (as transformers' truncation), or cuts nothing (None); each way of cutting its own
    copy, since the setting belongs to the tokenizer."""
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(tokenizer.to_str())
    if max_tokens is None:
        copy.no_truncation()
    else:
        copy.enable_truncation(max_tokens, strategy=strategy, direction=direction)
    return copy


def whole_length(tokenizer, text: str, second: str | None = None) -> int:
    """How many tokens `text` (or the pair) has uncut, whatever truncation `tokenizer` has
    (an uncut copy: made only for a refusal's numbers)."""
    whole = cutting(tokenizer, None)
    return len(whole.encode(text) if second is None else whole.encode(text, second))


def engine_tokenizer(engine):
    """An encoder engine's tokenizer (its artifact's tokenizer.json), for the endpoints that
    take text; InvalidArgument without one."""
    folder = engine.model.folder
    tokenizer = load_tokenizer(folder) if folder is not None else None
    if tokenizer is None:
        raise InvalidArgument(f"model '{engine.name}' has no tokenizer (tokenizer.json in "
                              "its artifact): send token ids to /v2/models/.../infer instead")
    return tokenizer


def token_text(tokenizer, token: int) -> str:
    """One token's own text, special tokens included (what log-prob listings show)."""
    return tokenizer.decode([int(token)], skip_special_tokens=False)


class IncrementalDecoder:
    """Text for a growing list of token ids, one piece per call, never splitting a character.

    `prefix` is where the window starts (ids before it are already text); `read` is where the
    text already released ends, in ids. Decoding [prefix:] and removing the text of
    [prefix:read] gives the new text with the tokenizer's own spacing (TGI's approach)."""

    def __init__(self, tokenizer, prompt: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt)
        # start the window a few ids into the prompt: spacing depends on the previous token
        self.prefix = max(0, len(self.ids) - 4)
        self.read = len(self.ids)

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def add(self, token: int) -> str:
        """The new text that `token` completes ('' while a character is still incomplete)."""
        self.ids.append(int(token))
        before = self._text(self.ids[self.prefix:self.read])
        now = self._text(self.ids[self.prefix:])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before):]

    def flush(self) -> str:
        """Whatever is still held back at the end (an incomplete character stays U+FFFD)."""
        before = self._text(self.ids[self.prefix:self.read])
        now = self._text(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return now[len(before):]
