"""What can go wrong with a request, as exceptions that carry no transport: the batcher and
the engine raise these (they never import grpc); serving.wire.protocol maps them to status codes
in one table."""


# A full server or queue has room again as soon as any one request ends, seldom more than a
# few model runs away: one second, the least Retry-After can say (the openai client's own
# first backoff is about half of it; urllib3's Retry and the anthropic client wait it too)
RETRY_AFTER_S = 1


class ServingError(Exception):
    """Base class: the message is what the client reads; `retry_after_s`, where set, is how
    soon the same request may be sent again (HTTP answers say it in Retry-After)."""

    def __init__(self, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class InvalidArgument(ServingError):
    """The request cannot be run as sent (names, dtypes, shapes, sizes, token ids, batch)."""


class ContextTooLong(InvalidArgument):
    """A prompt past what the model takes (more than `prompt_limit` tokens), or with the
    tokens it asks for past its context (`context` positions): the numbers kept, so that each
    HTTP API words it as its own server does (clients tell a context overflow from other bad
    requests by those words: OpenAI's `context_length_exceeded`, TGI's and Anthropic's
    phrases)."""

    def __init__(self, message: str, prompt_tokens: int, max_tokens: int, context: int,
                 prompt_limit: int) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.context, self.prompt_limit = context, prompt_limit

    @property
    def prompt_alone(self) -> bool:
        """The prompt alone is too long (else the prompt with max_tokens)."""
        return self.prompt_tokens > self.prompt_limit


def input_too_long(where: str, tokens: int, limit: int) -> ContextTooLong:
    """An encoder's input past the model's `limit` tokens that the request said not to cut
    (`truncate` false): a context overflow with nothing to generate."""
    return ContextTooLong(f"{where} has {tokens} tokens, more than the model's {limit}, and "
                          "'truncate' is false", tokens, 0, limit, limit)


class NotFound(ServingError):
    """No model (or version) by that name is served here."""


class Unavailable(ServingError):
    """The model is not ready yet, or the server is shutting down: try again elsewhere/later."""


class Unauthenticated(ServingError):
    """The call lacks the bearer token this server was started with."""


class ResourceExhausted(ServingError):
    """The server is full (every stream slot taken and the queue too): try again later."""


class AlreadyExists(ServingError):
    """The name is taken (a shared memory region registered twice, as Triton refuses it)."""
