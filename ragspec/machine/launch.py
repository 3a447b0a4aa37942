"""Whether and how this machine gets measured (RAGSPEC_CALIBRATE), and the start of the detached job
(`machine/job.py`) that measures it: what a load calls, apart from the job's own work so that the table
(`machine/table.py`) and the job import one way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WAIT_S = 900  # at most this long waiting for quiet; then the measurement runs anyway (rows marked if contended)
_started: set[str] = set()  # tables this process has started a job for

MODES = ("background", "foreground", "off")


def mode() -> str:
    """RAGSPEC_CALIBRATE: where a machine with no table gets one. `background` (the default): a guess now, this
    job once the machine is quiet; `foreground`: measured before the first ask; `off`: the guess, nothing
    measured (short-lived containers, the test suite: the guess is what every table measured so far picks)."""
    from ragspec.errors import RagspecError

    value = os.environ.get("RAGSPEC_CALIBRATE", "background").strip().lower() or "background"
    if value not in MODES:
        raise RagspecError(f"RAGSPEC_CALIBRATE '{value}' is not one of {', '.join(MODES)}")
    return value


def start(model: str, table_path: Path, cache_dir: Path | None = None, again: bool = False,
          wait_s: float = WAIT_S) -> Path | None:
    """Start the detached job measuring `model`'s table (once per process and table; `again`: the table there
    is contended); returns its log's path, or None when this process already started one."""
    if str(table_path) in _started:
        return None
    _started.add(str(table_path))
    log = table_path.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "ragspec.machine.job", model]
    cmd += ["--cache-dir", str(cache_dir)] if cache_dir else []
    cmd += ["--again"] if again else []
    cmd += ["--wait-s", str(wait_s), "--parent", str(os.getpid())]
    with open(log, "a") as out:
        subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                         start_new_session=True, close_fds=True)
    return log
