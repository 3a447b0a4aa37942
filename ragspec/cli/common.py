"""What the command groups share: a user error as one red line and exit code 2, a JSON file written whole,
and index settings from options."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from ragspec.console import console
from ragspec.errors import RagspecError


def fail(message: str, code: int = 2):
    from ragspec.console import one_line

    console.print(f"[bold red]error:[/] {one_line(message)}", soft_wrap=True, emoji=False)
    raise typer.Exit(code)


def run(fn, busy: str | None = None):
    """Run a command body; user errors become one red line and exit code 2. `busy`: the command is user work
    from its first line (imports and loads included), so a calibration job on the machine stops meanwhile."""
    from contextlib import nullcontext

    from ragspec import activity

    try:
        with activity.busy(busy) if busy else nullcontext():
            return fn()
    except RagspecError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail("interrupted", 130)


def write_json_atomic(path: Path, data) -> None:
    """Write JSON beside `path` and rename it into place: a run stopped mid-write never leaves half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def index_settings(**overrides):
    from pydantic import ValidationError

    from ragspec.settings import IndexSettings
    from ragspec.spec import describe_error

    data = {k: v for k, v in overrides.items() if v is not None}
    try:
        return IndexSettings(**data)
    except ValidationError as exc:
        raise RagspecError(describe_error(exc, "index settings")) from None
