"""One calibration candidate measured in its own process, a process that stops while the user works.

Why a child: a native build that dies (SIGILL on a CPU it was not built for) or runs out of memory costs that
candidate, recorded with why, never the caller. Why it stops: the measurement must never take the CPUs from the
user. The parent watches the markers of user work (`ragspec.activity`: a load, an ask, a server request, an
index build in any ragspec process on the machine) a few times a second; while one is there it stops the child
(SIGSTOP: within a second, with no cooperation needed) and continues it once the machine has been quiet for
`RESUME_AFTER_S`. The child measures in slices (one prefill, one run of t(n), one assembly): a slice during which
it was stopped is measured again, so a pause never lands in a figure.

`python -m ragspec.machine.measure MODEL BACKEND DTYPE THREADS` prints one candidate's JSON.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ragspec import activity
from ragspec.errors import RagspecError

POLL_S = 0.2  # how often the parent looks for user work
RESUME_AFTER_S = 3.0  # a stopped measurement continues after this long with no user work
# prompt / cache length of the measurements: a 5-source ask within its source budget is ~400-700 tokens (whole
# sources ~900-1,300); each prefill of the 1.5B on llama.cpp costs 5 s of 2 cores at this length
CONTEXT = 512
SIZES = (1, 2, 4, 8, 16)  # t(n) measured at these n
# the source cache's calibration prompt (a warm store): a head, five cached pieces behind short source headers,
# the question and template tail; pieces re-positioned, their first 4 tokens and the gaps computed in full, and
# with CacheBlend the fraction BLEND of the rest. Cost grows about linearly with the fraction recomputed.
ASSEMBLY = {"head": 64, "pieces": 5, "gap": 6, "tail": 24, "recompute": 4}
BLEND = 0.5
TIMEOUT_S = 1800  # per candidate, pauses not counted

_resumed = 0  # in the child: how many times it was continued after a stop


def run_child(model: str, backend: str, dtype: str, threads: int, say: Callable[[str], None],
              started: Callable[[int], None] | None = None) -> dict:
    """Measure one candidate in a child process, stopping it while any other process does user work. The row
    gets `cpu_s` (the child's CPU seconds) and `paused_s` (how long it stood stopped). `started(pid)` hears the
    child's process id."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "ragspec.machine.measure", model, backend, dtype, str(threads)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, text=True,
                                 start_new_session=True)
        if started is not None:
            started(child.pid)
        paused_s, ran_s, mine = 0.0, 0.0, (os.getpid(),)
        try:
            while child.poll() is None:
                if ran_s > TIMEOUT_S:
                    raise RagspecError(f"measuring took over {TIMEOUT_S} s")
                busy = activity.active(mine)
                if busy:
                    paused_s += _stopped_while_busy(child, busy, say, mine)
                    continue
                time.sleep(POLL_S)
                ran_s += POLL_S
        finally:
            if child.poll() is None:  # an error or an interrupt of the parent: the child goes too
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        out.seek(0)
        err.seek(0)
        lines = [ln for ln in out.read().splitlines() if ln.startswith("{")]
        if child.returncode != 0 or not lines:
            if child.returncode is not None and child.returncode < 0:
                why = f"the measuring process died of {signal.Signals(-child.returncode).name}"
            else:
                tail = err.read().strip().splitlines()
                why = tail[-1] if tail else f"exit status {child.returncode}"
            raise RagspecError(why[:300])
    row = json.loads(lines[-1])
    return row | {"paused_s": round(paused_s, 1)}


def _stopped_while_busy(child: subprocess.Popen, busy: list[str], say, mine: tuple[int, ...]) -> float:
    """Stop the child until no user work has been seen for RESUME_AFTER_S; returns the seconds it stood."""
    t0 = time.monotonic()
    os.killpg(child.pid, signal.SIGSTOP)
    say(f"paused: {busy[0]}" + (f" and {len(busy) - 1} more" if len(busy) > 1 else ""))
    quiet_since = None
    while True:
        time.sleep(POLL_S)
        if activity.active(mine):
            quiet_since = None
        elif quiet_since is None:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= RESUME_AFTER_S:
            break
    os.killpg(child.pid, signal.SIGCONT)
    stood = time.monotonic() - t0
    say(f"resumed after {stood:.0f} s")
    return stood


# -- in the child -------------------------------------------------------------------------------------------------
def _on_continue(signum, frame) -> None:
    global _resumed
    _resumed += 1


def unpaused(measure: Callable[[], object]) -> object:
    """`measure()` again until a run of it was not stopped in between (its timing would hold the pause)."""
    while True:
        before = _resumed
        result = measure()
        if _resumed == before:
            return result


def measure_candidate(model: str, backend: str, dtype: str, context: int = CONTEXT, sizes=SIZES,
                      repeats: int = 1, assembly: bool | None = None) -> dict:
    """Load `model` as the candidate says and measure it: prefill tok/s (the fastest of `repeats` prefills of a
    `context`-token prompt, after a short warm-up) and t(n) in ms for each n in `sizes` (the backend's own
    `measure_costs`, made monotone as the budget does); with `assembly` (default: on transformers, whose
    CacheBlend only it measures; llama.cpp's warm store then counts as a full prefill), what a warm source store
    makes of the prompt. Each timed piece is a slice that a pause makes run again. The whole table of the 1.5B
    costs about 50 s of CPU on 2 cores this way (docs/models.md)."""
    assembly = backend != "llama.cpp" if assembly is None else assembly
    import numpy as np
    import torch

    from ragspec.decoding.backends import backend_class, make_backend
    from ragspec.decoding.budget import monotone
    from ragspec.decoding.sampling import SamplingSettings
    from ragspec.models.generator import load_generator, load_llama_generator

    t0 = time.perf_counter()
    if backend == "llama.cpp":
        lm, _ = load_llama_generator(model)
    else:
        lm, _ = load_generator(model, "cpu", dtype)
    load_s = time.perf_counter() - t0
    try:
        vocab = int(lm.config.vocab_size)
        prompt = np.random.default_rng(0).integers(100, min(vocab, 30000), context + 1).tolist()
        threads = getattr(lm, "n_threads", None) or torch.get_num_threads()
        b = make_backend(lm, SamplingSettings())
        b.prefill(prompt[:64])  # warm-up: first-call allocations and kernel choices
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        prefill = min(unpaused(lambda: b.prefill(prompt)) for _ in range(repeats))
        b.close()
        ms = monotone(unpaused(lambda: backend_class(lm).measure_costs(lm, context, max(repeats, 2), list(sizes))))
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        store = measure_assembly(lm, prompt[:context], 1) if assembly else {}
    finally:
        if hasattr(lm, "close"):
            lm.close()
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"prefill_tps": round(context / (prefill / 1000), 1), "prefill_ms": round(prefill, 1), **store,
            "ms": [round(x, 2) for x in ms], "load_s": round(load_s, 1), "threads": threads,
            # the share of `threads` cores the measurement got: well under 1, another job was running
            "cpu_share": round(cpu_s / ((w1 - w0) * threads), 2), "seconds": round(time.perf_counter() - t0, 1),
            "cpu_s": round(used.ru_utime + used.ru_stime, 1)}


def measure_assembly(lm, prompt: list[int], repeats: int = 1) -> dict:
    """What a warm source store makes of `prompt`'s prefill (the `ASSEMBLY` layout, filled by one cold
    assembly first): `assembled_ms` with first-k recompute only, and `blended_ms` with CacheBlend's fraction
    `BLEND` too (transformers only: llama.cpp applies none). Where the model cannot assemble, `assembly` says
    why and the choice counts a full prefill."""
    from ragspec.decoding.backends import make_backend
    from ragspec.decoding.sampling import SamplingSettings
    from ragspec.decoding.source_cache import SourceKVStore, SourcePlan

    a = ASSEMBLY
    size = (len(prompt) - a["head"] - a["tail"]) // a["pieces"] - a["gap"]
    pieces, at = [], a["head"]
    for _ in range(a["pieces"]):
        pieces.append((at + a["gap"], at + a["gap"] + size))
        at += a["gap"] + size
    store = SourceKVStore(memory_bytes=4 << 30)
    out = {}
    b = make_backend(lm, SamplingSettings())
    try:
        for name, blend in (("assembled_ms", 0.0), ("blended_ms", BLEND)):
            def assemble(blend=blend):
                plan = SourcePlan(store, a["head"], pieces, a["recompute"], blend)
                return b.prefill(prompt, sources=plan), plan

            runs = []
            for k in range(repeats + 1):  # a run before the timed ones: the first fills the store (cold)
                ms, plan = assemble() if k == 0 else unpaused(assemble)
                runs.append(ms)
                if plan.fallback:
                    return {"assembly": plan.fallback}
                if plan.note:  # not applied (llama.cpp has no CacheBlend): it costs what first-k does
                    return out
            out[name] = round(min(runs[1:]), 1)
    finally:
        b.close()
    return out


def _main(argv: list[str]) -> None:
    """`python -m ragspec.machine.measure MODEL BACKEND DTYPE THREADS`: one candidate's JSON."""
    model, backend, dtype, threads = argv
    signal.signal(signal.SIGCONT, _on_continue)
    import torch

    torch.set_num_threads(int(threads))
    from ragspec.console import quiet_libraries

    quiet_libraries()
    print(json.dumps(measure_candidate(model, backend, dtype)), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
