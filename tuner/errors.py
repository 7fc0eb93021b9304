"""The two kinds of failure the CLI tells apart (docs/design.md: exit 2 bad input, 1 internal)."""


class BadInput(Exception):
    """The user's input cannot be used: the CLI prints the message on one line and exits 2."""


class RewriteRefused(BadInput):
    """A rewrite met a graph pattern it does not understand; the message names the node."""
