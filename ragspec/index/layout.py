"""Index directories on disk: versions, the atomic link swap, the build lock.

`indexes/<name>` is a symbolic link to `.<name>@<id>`, a complete version directory. A build writes a new
version beside it and swaps the link with one `rename(2)`, which is atomic: at every moment the name points
at a whole, valid version, so killing a build (even with SIGKILL) leaves the previous index searchable.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from pathlib import Path

from ragspec.errors import RagspecError
from ragspec.index.manifest import MANIFEST


def version_dirs(target: Path) -> list[Path]:
    parent = target.parent
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.glob(f".{target.name}@*") if p.is_dir())


def new_tmp_dir(target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{time.time_ns()}"
    tmp.mkdir()
    return tmp


def clean_stale(target: Path) -> int:
    """Remove half-written builds left by killed runs (call only while holding the build lock)."""
    removed = 0
    for p in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
        removed += 1
    for p in target.parent.glob(f".{target.name}.link-*"):
        with contextlib.suppress(OSError):
            p.unlink()
    return removed


@contextlib.contextmanager
def build_lock(target: Path):
    """One build per index at a time; a second waits for the first."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RagspecError(f"another `ragspec index` is building {target} right now; wait for it to finish") from None
        yield


def fsync_tree(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, target: Path) -> Path:
    """Turn a finished build directory into a version and point `target` at it atomically."""
    version = target.parent / f".{target.name}@{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns() % 10**9:09d}"
    fsync_tree(tmp)
    os.rename(tmp, version)
    if target.exists() and not target.is_symlink():
        # a plain directory here: adopt it only if it is a ragspec index (never clobber a user's folder)
        if not (target / MANIFEST).is_file():
            raise RagspecError(f"{target} exists and is not a ragspec index; choose another --name or --out")
        os.rename(target, target.parent / f".{target.name}@0-adopted-{time.time_ns()}")
    link = target.parent / f".{target.name}.link-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    os.symlink(version.name, link)
    os.replace(link, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return version


def prune(target: Path, keep: int = 2) -> None:
    """Delete old versions, keeping the current one and the one before it (a reader may still hold it)."""
    current = current_version(target)
    olds = [p for p in version_dirs(target) if p != current]
    olds.sort(key=lambda p: p.stat().st_mtime)
    for p in olds[: max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)


def current_version(target: Path) -> Path | None:
    if target.is_symlink():
        return (target.parent / os.readlink(target)).resolve()
    if (target / MANIFEST).is_file():
        return target.resolve()
    return None


def dir_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
