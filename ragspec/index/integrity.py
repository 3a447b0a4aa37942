"""Check an index version's files against its manifest before anything reads them.

FAISS, SQLite and numpy read a damaged file without complaint and answer from it, so every open checks each
file's size, and its sha256 once per process per file version (cached by path, inode, size, mtime and ctime):
a long-lived process (a server, a LangChain app) pays for the hashing once, and a file changed since is
hashed again.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from ragspec.errors import RagspecError

_verified: set[tuple] = set()
_lock = threading.Lock()


class IndexDamaged(RagspecError):
    """An index file differs from what its manifest recorded; `detail` names the file."""

    def __init__(self, shown: str, detail: str):
        self.detail = detail
        super().__init__(f"index {shown} is damaged ({detail}); rebuild it: ragspec index CORPUS --out {shown}")


def check(folder: Path, files: dict, shown: str, rehash: bool = False) -> None:
    """Raise IndexDamaged unless every file in `files` ({name: {size, sha256}}) matches. `rehash`: ignore
    the cache (`ragspec info --verify`)."""
    from ragspec.models.registry import sha256_file

    stats = {}
    for name, meta in files.items():  # sizes first: cheap, and they catch truncation
        try:
            st = os.stat(Path(folder) / name)
        except OSError:
            raise IndexDamaged(shown, f"{name} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise IndexDamaged(shown, f"{name} is not a file")
        if st.st_size != meta["size"]:
            raise IndexDamaged(shown, f"{name} is {st.st_size} bytes, its manifest says {meta['size']}")
        stats[name] = st
    for name, meta in files.items():
        st = stats[name]
        key = (os.path.realpath(Path(folder) / name), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
               meta["sha256"])
        with _lock:
            known = key in _verified
        if known and not rehash:
            continue
        if sha256_file(Path(folder) / name) != meta["sha256"]:
            raise IndexDamaged(shown, f"{name} does not match its sha256 in the manifest")
        with _lock:
            _verified.add(key)
