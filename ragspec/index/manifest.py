"""manifest.json: what an index was built with, so it can be searched (and trusted) later.

The manifest carries the size and sha256 of every other file, and a checksum of its own content, so damage
anywhere in an index is caught before any of it is used.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ragspec.errors import RagspecError

FORMAT_VERSION = 2  # 2: chunk text hashes, document file type and metadata (filters, copies)
MANIFEST = "manifest.json"
KEYS = {"format_version", "corpus", "embedder", "faiss", "chunker", "bm25", "counts", "files", "created", "checksum"}


def checksum(data: dict) -> str:
    """sha256 of the manifest's content without its `checksum` field (canonical JSON)."""
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def load(folder: Path, shown: str | None = None) -> dict:
    """The manifest of the index version in `folder`; `shown` is the index path for messages."""
    from ragspec.index.integrity import IndexDamaged

    shown = shown or str(folder)
    path = Path(folder) / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RagspecError(f"{shown} is not a ragspec index (no {MANIFEST}); build one with `ragspec index`") from None
    except ValueError as exc:  # bad JSON or bad UTF-8
        raise IndexDamaged(shown, f"{MANIFEST} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) - KEYS:
        raise IndexDamaged(shown, f"{MANIFEST} has unexpected content")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise RagspecError(
            f"{shown} has index format {version}, this ragspec reads format {FORMAT_VERSION}; rebuild it: "
            f"ragspec index CORPUS --out {shown}"
        )
    # manifests written before the checksum existed have none; any damage to one written since is caught
    if "checksum" in data and data["checksum"] != checksum(data):
        raise IndexDamaged(shown, f"{MANIFEST} does not match its checksum")
    files = data.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(m, dict) and isinstance(m.get("size"), int) and isinstance(m.get("sha256"), str)
        for m in files.values()
    ):
        raise IndexDamaged(shown, f"{MANIFEST} has no valid file list")
    return data


def write(folder: Path, data: dict) -> None:
    data = {**data, "checksum": checksum(data)}
    (Path(folder) / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
