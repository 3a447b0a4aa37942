"""manifest.json: what an index was built with, so it can be searched (and trusted) later."""

from __future__ import annotations

import json
from pathlib import Path

from ragspec.errors import RagspecError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


def load(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise RagspecError(f"{folder} is not a ragspec index (no {MANIFEST}); build one with `ragspec index`") from None
    except ValueError as exc:
        raise RagspecError(f"{path} is not valid JSON ({exc}); rebuild the index") from None
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise RagspecError(
            f"{folder} has index format {version}, this ragspec reads format {FORMAT_VERSION}; rebuild the index"
        )
    return data


def write(folder: Path, data: dict) -> None:
    (Path(folder) / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
