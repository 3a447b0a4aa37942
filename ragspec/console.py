"""The one rich console ragspec prints progress and warnings to (stderr, so stdout stays parseable)."""

from __future__ import annotations

import contextlib

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True, highlight=False, soft_wrap=True)


def one_line(message: str) -> str:
    """`message` as one printable line: control characters (a newline in a file name) shown escaped, and
    square brackets escaped so rich never reads a file name as markup (callers print with emoji=False)."""
    from rich.markup import escape

    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)
    return escape(shown)


def warn(message: str) -> None:
    """One warning line (plain text: never markup, never more than one line)."""
    console.print(f"[yellow]warning:[/] {one_line(message)}", soft_wrap=True, emoji=False)


def progress() -> Progress:
    """A progress display for long stages."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


@contextlib.contextmanager
def status(message: str):
    """A spinner for a stage of unknown length."""
    if console.is_terminal:
        with console.status(message):
            yield
    else:
        console.print(message)
        yield


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
