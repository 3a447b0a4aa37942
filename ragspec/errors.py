"""One exception type for problems the user can fix; the CLI prints its message as one line."""


class RagspecError(Exception):
    """A user-facing error: bad input, a missing model package, a broken index.

    The message must say what is wrong and what to do about it, in one line.
    """


class Cancelled(RagspecError):
    """A generation stopped on request (a closed stream, a cancelled HTTP request, Ctrl-C): between prefill
    chunks or decode steps, the model lock released, nothing half-written."""
