"""The machine table measured in a detached process, once the machine is quiet, so a first ask never waits and
no later one is slowed.

Measuring every candidate of a generator takes minutes on a 2-core machine (the 1.5B: 465 s). A pipeline that
finds no table answers with a guess from the CPU flags (`machine.guess`) and starts this job; the job waits
until the other processes leave the CPUs nearly idle and no ragspec process does user work (`ragspec.activity`),
takes the calibration lock, measures, and writes the table that later loads read (and a pipeline holding a guess
switches to, between asks). While it measures, any new user work stops it within a second until the machine is
quiet again (`machine_measure`). Its lines go to a log beside the table (`ragspec models` shows the last).
`python -m ragspec.machine.job MODEL`, started by `launch.start`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ragspec import activity
from ragspec.machine.launch import WAIT_S

QUIET = 0.25  # the machine counts as quiet when processes use under this share of all its CPUs
QUIET_FOR_S = 10  # … for this many seconds in a row, the process that started the job idle or gone meanwhile
PARENT_IDLE = 0.05  # CPU seconds a second under which the starting process counts as idle (between asks)



def busy_share(interval_s: float = 1.0) -> float | None:
    """The share of all CPUs busy over `interval_s` (from /proc/stat), or None where it cannot be read."""

    def sample():
        with open("/proc/stat") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
        return sum(parts), parts[3] + (parts[4] if len(parts) > 4 else 0)  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    span = total1 - total0
    return None if span <= 0 else 1 - (idle1 - idle0) / span


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far, or None when it is gone (or cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def wait_for_quiet(say, wait_s: float = WAIT_S, parent: int | None = None) -> bool:
    """Block until, for QUIET_FOR_S seconds in a row, the machine was quiet and the process that started the
    job (`parent`: an ask loading its model is not always busy, so the machine's share alone is not enough)
    idle or gone (True); False when `wait_s` ran out first."""
    end, calm = time.monotonic() + wait_s, 0
    told = False
    before = cpu_seconds(parent) if parent else None
    while time.monotonic() < end:
        share = busy_share()
        if share is None:
            return True
        now = cpu_seconds(parent) if parent else None
        idle = now is None or before is None or now - before < PARENT_IDLE
        before = now
        calm = calm + 1 if share < QUIET and idle and not activity.active() else 0
        if calm >= QUIET_FOR_S:
            return True
        if not told:
            say(f"waiting for a quiet machine before measuring (CPUs {share:.0%} busy"
                + (f"; process {parent} {'idle' if idle else 'working'}" if parent else "") + ")…")
            told = True
    return False


def run(model: str, cache_dir: Path | None = None, again: bool = False, wait_s: float = WAIT_S,
        parent: int | None = None) -> dict | None:
    """The job itself: wait for quiet, then measure (or read the table another process measured meanwhile).
    `again`: the table there was measured beside another job; a machine still busy after `wait_s` leaves it as
    it is, and that wait counts as one of its TRIES (machine.busy_try), so a machine that stays busy stops
    starting jobs."""
    from ragspec.machine.table import TRIES, busy_try, llama_slower, machine_table

    def say(line: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)

    say(f"calibrating {model} (pid {os.getpid()})" + (" again: its table was measured beside another job" if again
                                                      else ""))
    if not wait_for_quiet(say, wait_s, parent):
        if again:
            table = busy_try(model, cache_dir)
            say(f"the machine stayed busy for {wait_s:.0f} s: the contended table stays"
                + (f" (try {table['tries']} of {TRIES})" if table and table.get("contended") else ""))
            return table
        say(f"the machine stayed busy for {wait_s:.0f} s: measuring anyway (contended rows are marked)")
    table = machine_table(model, cache_dir=cache_dir, progress=say, again=again)
    if llama_slower(table) and not table.get("contended"):
        from ragspec.models.gguf_cache import drop_one_file

        if drop_one_file(model):  # assembled for measuring llama.cpp alone: a GGUF's worth of disk
            say("llama.cpp measured slower at every shape: its one-file copy of the GGUF removed")
    kept = "" if not table.get("contended") else (
        " (contended: measured again when the machine is quiet)" if table.get("tries", 1) < TRIES
        else f" (contended, kept after {table.get('tries', 1)} tries: `ragspec models --calibrate --force` measures it)")
    say("table written" + kept)
    return table


def _main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--cache-dir", type=Path, default=None)
    ap.add_argument("--again", action="store_true", help="the table there was measured beside another job")
    ap.add_argument("--wait-s", type=float, default=WAIT_S)
    ap.add_argument("--parent", type=int, default=None, help="the process that started the job")
    a = ap.parse_args(argv)
    run(a.model, a.cache_dir, a.again, a.wait_s, a.parent)


if __name__ == "__main__":
    _main(sys.argv[1:])
