"""One exception type for problems the user can fix; the CLI prints its message as one line."""

from contextlib import contextmanager


class RagspecError(Exception):
    """A user-facing error: bad input, a missing model package, a broken index.

    The message must say what is wrong and what to do about it, in one line.
    """


class Cancelled(RagspecError):
    """A generation stopped on request (a closed stream, a cancelled HTTP request, Ctrl-C): between prefill
    chunks or decode steps, the model lock released, nothing half-written."""


class LoadError(RagspecError):
    """A model or index that could not be loaded. On a server it is the server's fault, not the request's: the
    server logs it whole and answers one generic line (the text may name this machine's paths)."""


@contextmanager
def loading():
    """Inside it, loading a model or an index: a RagspecError raised there is a LoadError."""
    try:
        yield
    except LoadError:
        raise
    except RagspecError as exc:
        raise LoadError(str(exc)) from exc


def check_cancel(cancel) -> None:
    """Raise `Cancelled` if `cancel` (a threading.Event, or None) is set."""
    if cancel is not None and cancel.is_set():
        raise Cancelled("the generation was cancelled")
