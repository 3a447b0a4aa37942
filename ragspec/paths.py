"""Where ragspec keeps things on disk."""

from __future__ import annotations

import os
from pathlib import Path


def ragspec_home() -> Path:
    """The cache root: `$RAGSPEC_HOME`, else `~/.cache/ragspec`."""
    env = os.environ.get("RAGSPEC_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ragspec"


def default_index_root() -> Path:
    """`indexes/` of the current directory: where `ragspec index` puts indexes by default."""
    return Path("indexes")
