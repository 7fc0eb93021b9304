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
then reads. A constrained reply (structured output, forced tool calls) thinks freely first
as well: its grammar holds what follows `</think>` (serving.generation.grammar.THINKING),
as vLLM constrains a reasoning model's answer and not its thinking."""

from __future__ import annotations

from dataclasses import dataclass, replace

from serving.generation.grammar import THINKING
from serving.http.tools import Reader
from serving.sampling import Chunk, Grammar, held_back

PARSERS = tuple(THINKING)
OPEN, CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class Thinking:
    """Splits a reply's text into reasoning and content, as the parser named (PARSERS)."""

    parser: str

    @property
    def opened_by_prompt(self) -> bool:
        return self.parser == "deepseek_r1"

    def constrain(self, grammar: Grammar | None) -> Grammar | None:
        """A request's grammar, held to the answer after the thinking."""
        return None if grammar is None else replace(grammar, thinking=self.parser)

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


@dataclass(kw_only=True)
class Reply:
    """One reply as it is generated: its text, what of it the parsers released so far (the
    reasoning, and the content a tool reader, serving/http/tools.py, may hold back from),
    the tool calls read out of it at the end, its tokens and the prompt tokens read from the
    prefix cache (known at the end). Chat completions keep one per choice; a Responses or a
    Messages answer is one."""

    thinking: Thinking | None = None
    tools: Reader | None = None
    text: str = ""  # everything generated
    reasoning: str = ""
    content: str = ""
    calls: list[dict] | None = None
    generated: int = 0
    cached: int = 0

    def add(self, chunk: Chunk) -> tuple[str, str]:
        """Take the chunk: the reasoning and the content it releases."""
        self.text += chunk.text or ""
        self.generated += len(chunk.ids)
        self.cached = chunk.cached or self.cached
        reasoning, answer = (self.thinking.split(self.text, chunk.final)
                             if self.thinking is not None else ("", self.text))
        thought = reasoning[len(self.reasoning):]
        if self.tools is None:
            piece = answer[len(self.content):]
        else:
            piece, self.calls = self.tools.read(answer, len(self.content), chunk.final)
        self.reasoning, self.content = self.reasoning + thought, self.content + piece
        return thought, piece
