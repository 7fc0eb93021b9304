"""Reasoning models' thinking apart from their answer (vLLM's `--reasoning-parser`): a chat
reply `<think>...</think>answer` comes back as the message's `reasoning` (also under
`reasoning_content`, the name vLLM used first and many clients still read) and `content`
"answer". Two families, vLLM's names:

- `deepseek_r1` (DeepSeek-R1 and its distills, QwQ, Qwen3's thinking-only models): their
  chat templates open the think block in the prompt, so the output is reasoning from its
  first token (a `<think>` written anyway is dropped) until `</think>`; a reply cut before
  it is all reasoning;
- `qwen3` (Qwen3's hybrid models): the output thinks only when it opens the block itself
  (thinking off, `chat_template_kwargs: {"enable_thinking": false}`, it does not): a reply
  that does not start with `<think>` is all content.

Whatever follows `</think>` is the content, which a tool reader (serving/http/tools.py)
then reads. A constrained reply (structured output, forced tool calls) is all content: its
grammar holds every token, so there is no free thinking to split off."""

from __future__ import annotations

from dataclasses import dataclass

from serving.sampling import held_back

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Thinking:
    """Splits a reply's text into reasoning and content."""

    opened_by_prompt: bool  # deepseek_r1: the prompt opened the block

    @classmethod
    def named(cls, parser: str) -> "Thinking":
        return cls(opened_by_prompt=parser == "deepseek_r1")

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far: what of each may be sent now. Both only
        grow as the text does (a tag's first characters are held back until decided)."""
        start = text.lstrip()
        if not final and OPEN.startswith(start):
            return "", ""  # whitespace, or a block that may be opening
        opened = start.startswith(OPEN)
        if not (opened or self.opened_by_prompt):
            return "", text
        body = start[len(OPEN):] if opened else text
        end = body.find(CLOSE)
        if end >= 0:
            return body[:end], body[end + len(CLOSE):]
        return (body if final else body[:len(body) - held_back(body, (CLOSE,))]), ""
