"""Where ragspec keeps things on disk."""

from __future__ import annotations

import json
import os
from pathlib import Path


def ragspec_home() -> Path:
    """The cache root: `$RAGSPEC_HOME`, else `~/.cache/ragspec`."""
    env = os.environ.get("RAGSPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ragspec"


def default_index_root() -> Path:
    """`indexes/` of the current directory: where `ragspec index` puts indexes by default."""
    return Path("indexes")


def read_json(path: Path) -> dict | None:
    """A JSON file's content, or None where it is missing or damaged (a cached measurement is then taken again)."""
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None


def write_json(path: Path, data) -> None:
    """Write JSON under a name of this process's and rename it into place: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)
