"""Fill-in-the-middle prompts for code models: the text before the cursor and the text after
it, around the special tokens the model was trained with, in its order, as the servers that
take a `suffix` write them (Ollama's templates for these models; OpenAI's completions API
takes `suffix`), and as the model cards write them. What editor plugins send for inline code
completion. The format is read from the tokenizer: the first one whose tokens are among its
added tokens. No HTTP here.

  StarCoder(2), SantaCoder, Granite Code:   <fim_prefix>BEFORE<fim_suffix>AFTER<fim_middle>
  Qwen2.5-Coder, Qwen3-Coder, CodeGemma:    <|fim_prefix|>BEFORE<|fim_suffix|>AFTER<|fim_middle|>
  DeepSeek-Coder:                           <｜fim▁begin｜>BEFORE<｜fim▁hole｜>AFTER<｜fim▁end｜>

The text is encoded as a prompt is (the tokenizer's own special tokens added: DeepSeek-Coder's
begin-of-sentence). Formats whose tokenizers cut the text around the tokens their own way
(CodeLlama's <PRE>/<SUF>/<MID>, Codestral's [SUFFIX]/[PREFIX]) are not read: such a model
answers that it has no fill-in-the-middle tokens."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FimFormat:
    prefix: str
    suffix: str
    middle: str

    def text(self, before: str, after: str) -> str:
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


FORMATS = (FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
           FimFormat("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
           FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))


def fim_format(tokenizer) -> FimFormat | None:
    """The model's format: the first whose three tokens are among its tokenizer's added
    tokens (kept whole wherever they appear in a text); None for a model without."""
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    return next((f for f in FORMATS if {f.prefix, f.suffix, f.middle} <= added), None)
