"""Walk a corpus folder deterministically and yield its documents; bad files are skipped, never fatal."""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ragspec.corpus.readers import SUPPORTED, Record, SkipFile, read_records, title_of


@dataclass
class SourceFile:
    """A file found under the corpus root, before reading."""

    rel: str  # path relative to the root, with "/" separators
    path: Path
    size: int
    mtime: float


@dataclass
class Document:
    """One document: a whole file, or one record of a JSON/JSONL file. `text` is what offsets index."""

    rel: str
    key: str
    title: str
    text: str
    sha256: str  # of the file's bytes
    size: int
    mtime: float
    encoding: str
    meta: dict = field(default_factory=dict)  # a JSON record's other scalar fields


@dataclass
class ScanReport:
    """What a walk skipped and why; printed as one warning line per skipped file plus a summary."""

    skipped: list[tuple[str, str]] = field(default_factory=list)  # (rel, reason)
    unsupported: Counter = field(default_factory=Counter)  # suffix -> count
    decoded: list[tuple[str, str]] = field(default_factory=list)  # (rel, encoding) for non-UTF-8 files
    problems: list[tuple[str, str]] = field(default_factory=list)  # (rel, problem) for bad JSON records

    @property
    def skipped_count(self) -> int:
        return len(self.skipped) + sum(self.unsupported.values())


def suffix_of(name: str) -> str:
    return Path(name).suffix.lower()


def walk(root: Path, report: ScanReport) -> list[SourceFile]:
    """Every supported file under `root`, sorted by relative path. Symlinks leaving the root are skipped."""
    root = Path(root)
    real_root = root.resolve()
    found: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        kept = []
        for d in dirnames:
            p = Path(dirpath) / d
            if d.startswith("."):
                continue
            if p.is_symlink():
                if not _inside(p, real_root):
                    report.skipped.append((_rel(p, root) + "/", "symlink out of the corpus root"))
                continue  # a link inside the root points at content the walk reaches anyway
            kept.append(d)
        dirnames[:] = kept
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = _rel(p, root)
            if name.startswith("."):
                continue
            if p.is_symlink() and not _inside(p, real_root):
                report.skipped.append((rel, "symlink out of the corpus root"))
                continue
            if not _utf8(rel):
                report.skipped.append((rel, "file name is not valid UTF-8 (rename the file)"))
                continue
            if suffix_of(name) not in SUPPORTED:
                report.unsupported[suffix_of(name) or "(no suffix)"] += 1
                continue
            try:
                st = p.stat()
            except OSError as exc:
                report.skipped.append((rel, f"cannot stat ({exc.strerror})"))
                continue
            if not p.is_file():
                report.skipped.append((rel, "not a regular file"))
                continue
            found.append(SourceFile(rel=rel, path=p, size=st.st_size, mtime=st.st_mtime))
    found.sort(key=lambda f: f.rel)
    return found


def read_file(src: SourceFile, report: ScanReport) -> list[Document]:
    """The documents in one file ([] when it is skipped; the reason goes into `report`)."""
    try:
        data = src.path.read_bytes()
    except OSError as exc:
        report.skipped.append((src.rel, f"unreadable ({exc.strerror or exc})"))
        return []
    digest = hashlib.sha256(data).hexdigest()
    try:
        records, encoding, problems = read_records(data, suffix_of(src.rel))
    except SkipFile as exc:
        report.skipped.append((src.rel, str(exc)))
        return []
    except Exception as exc:  # noqa: BLE001 - a parser bug on odd input (malformed HTML, …) loses this file, not the run
        report.skipped.append((src.rel, f"unreadable ({type(exc).__name__}: {exc})"))
        return []
    if encoding not in ("utf-8", "pdf"):
        report.decoded.append((src.rel, encoding))
    for p in problems:
        report.problems.append((src.rel, p))
    return [_document(src, r, digest, encoding) for r in records]


def iter_documents(root: Path, report: ScanReport | None = None) -> Iterator[Document]:
    report = report if report is not None else ScanReport()
    for src in walk(root, report):
        yield from read_file(src, report)


def _document(src: SourceFile, r: Record, digest: str, encoding: str) -> Document:
    title = r.title or title_of(r.text, Path(src.rel).name)
    return Document(src.rel, r.key, title, r.text, digest, src.size, src.mtime, encoding, dict(r.meta))


def _utf8(name: str) -> bool:
    """False for names holding undecodable bytes (surrogate escapes), which SQLite cannot store."""
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _inside(p: Path, real_root: Path) -> bool:
    try:
        p.resolve().relative_to(real_root)
        return True
    except (ValueError, OSError, RuntimeError):
        return False


def _rel(p: Path, root: Path) -> str:
    return p.relative_to(root).as_posix()
