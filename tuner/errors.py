"""The two kinds of failure the CLI tells apart (docs/design.md: exit 2 bad input, 1 internal)."""


class BadInput(Exception):
    """The user's input cannot be used: the CLI prints the message on one line and exits 2."""


class RewriteRefused(BadInput):
    """A rewrite met a graph pattern it does not understand; the message names the node."""


def one_line(e: BaseException) -> str:
    """`e` in one line: a BadInput's message as it is (written for the user), else its type
    and its message's first line (an ONNX Runtime error names the node there)."""
    if isinstance(e, BadInput):
        return str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
