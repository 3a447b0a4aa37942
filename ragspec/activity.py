"""Markers of user work in progress (a load, an ask, a server request, an index build), shared by every ragspec
process on the machine through `$RAGSPEC_HOME/activity/`.

Why: the background measurement of this machine (`machine/job.py`) must never take the CPUs from the
user. Each piece of user work holds a small file named after its process while it runs; the measuring job looks
at the folder a few times a second and stops its measuring process at once while any live one is there. A
marker of a process that died is ignored (and removed). Markers are best effort: an unwritable home marks
nothing and fails nothing.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ragspec.paths import ragspec_home

FOLDER = "activity"
_counter = itertools.count()
_lock = threading.Lock()


def folder() -> Path:
    return ragspec_home() / FOLDER


@contextmanager
def busy(what: str) -> Iterator[None]:
    """Mark this process as doing `what` for the user until the block ends (nested and concurrent blocks each
    hold their own marker)."""
    with _lock:
        n = next(_counter)
    path = folder() / f"{os.getpid()}-{n}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{time.time():.3f} {what}\n", encoding="utf-8")
    except OSError:
        path = None
    try:
        yield
    finally:
        if path is not None:
            try:
                path.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def active(ignore_pids: tuple[int, ...] = ()) -> list[str]:
    """What live processes other than `ignore_pids` are doing for the user now (one line each; empty: nothing).
    Markers left by dead processes are removed."""
    out = []
    try:
        entries = list(os.scandir(folder()))
    except OSError:
        return out
    for e in entries:
        pid_text, _, _ = e.name.partition("-")
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if pid in ignore_pids:
            continue
        if not _alive(pid):
            try:
                os.unlink(e.path)
            except OSError:
                pass
            continue
        try:
            text = Path(e.path).read_text(encoding="utf-8").split(" ", 1)[-1].strip()
        except OSError:  # ended between the listing and the read
            continue
        out.append(f"{text} (process {pid})")
    return out
