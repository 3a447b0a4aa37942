"""The one rich console ragspec prints progress and warnings to (stderr, so stdout stays parseable), and
`quiet_libraries`, which keeps the libraries' own warnings, logs and progress bars off it."""

from __future__ import annotations

import contextlib
import os
import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

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


def progress(transient: bool = False) -> Progress:
    """A progress display for long stages (`transient`: gone from the screen once it stops)."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=transient,
    )


@contextlib.contextmanager
def status(message: str):
    """A spinner for a stage of unknown length; yields it (for `.update(text)`), or None off a terminal."""
    if console.is_terminal:
        with console.status(message) as spinner:
            yield spinner
    else:
        console.print(message)
        yield None


class PrefillProgress:
    """`on_progress` for a generation: once reading the prompt has taken `after` seconds, shows how far it is —
    on `spinner` (a running status) if given, else as a bar on a terminal, else as a line per chunk."""

    def __init__(self, after: float = 2.0, spinner=None):
        self.t0 = time.monotonic()
        self.after = after
        self.spinner = spinner
        self.bar = None
        self.task = None

    def __call__(self, done: int, total: int) -> None:
        if done >= total:
            self.close()
            return
        if self.bar is None and time.monotonic() - self.t0 < self.after:
            return
        message = f"reading the prompt: {done:,} of {total:,} tokens"
        if self.spinner is not None:
            self.spinner.update(message)
        elif not console.is_terminal:
            console.print(message)
        else:
            if self.bar is None:
                self.bar = progress(transient=True)
                self.task = self.bar.add_task("reading the prompt", total=total)
                self.bar.start()
            self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("bm25s").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - transformers missing or changed: cosmetic only
        pass
