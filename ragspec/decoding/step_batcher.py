"""Continuous batching: the draft steps of several generations of one model share a forward.

Why: a CPU step reads every weight once whatever its row count, so rows are cheap together (t(16) is 2–3× t(1)
on AVX-512 machines); one user's tree does not always fill a step, and a server with eight users asking at
once would otherwise run eight one-row steps where one eight-row step costs little more. ragspec's CPU kernels
are row-independent (a row's bits do not depend on the other rows of a forward), so each generation's logits,
and so its answer, are the same bits as when it runs alone.

How: every generation keeps its own KV cache, drafter and tree, on its own thread. A step hands its rows to
`step`; the first waiting thread that finds the model free and the batch ready (every generation past its prefill
has handed in a step, or `GATHER_S` has passed since the first did) runs all waiting steps as one forward (up to
`MAX_ROWS` rows) and hands each its logits. A prompt is read in chunks, one chunk per turn under `exclusive()`,
and a chunk's turn and a step batch's turn alternate: streams already running keep streaming while a new prompt
is read (the gap between their tokens is about one chunk's time). Anything else that uses the model (a drafter
calling it, a cache assembled from source pieces, a prompt built with the tokenizer) holds the model's lock,
which every forward here holds too.

Policy for the draft budget: a step affords the rows one generation alone would draft (the measured t(n) sets
that); with k generations stepping, each drafts at most `share(cap)` = cap // k nodes, ranked as before.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

GATHER_S = 0.004  # how long a step waits for the other generations' steps before its batch runs without them
MAX_ROWS = 256  # rows of one batched forward (a draft tree's largest); more waiting rows go to the next batch


@dataclass
class _Step:
    rows: int
    run: Callable  # runs this step alone: () -> result
    payload: tuple  # what a batched forward needs of it
    result: object = None
    error: BaseException | None = None
    done: bool = False
    at: float = field(default_factory=time.monotonic)


class StepBatcher:
    """One model's forwards: steps merged across generations, prompt chunks and other uses in turn.

    `run_many(payloads) -> list | None` runs the payloads of several steps as one forward (None: it cannot, and
    each step runs alone). `lock` is the model's lock (`models.generator.model_lock`)."""

    def __init__(self, lock: threading.Lock, run_many: Callable[[list[tuple]], list | None]):
        self.lock = lock
        self.run_many = run_many
        self._cond = threading.Condition()
        self._busy = False  # a forward (batch or exclusive turn) is running
        self._steps: list[_Step] = []
        self._turns: deque[object] = deque()  # exclusive turns waiting, first come first served
        self._steps_next = True  # after an exclusive turn, waiting steps go first (and the reverse)
        self.decoding = 0  # generations past their prefill: how many steps a full batch holds
        self.generations = 0  # generations running (prefill included)
        self.batches = 0  # batched forwards run
        self.batched_rows = 0

    # -- who is running ------------------------------------------------------------------------------------
    @contextmanager
    def generation(self, limit: int = 1 << 30):
        """Around one generation: counted in `generations` (the server's /healthz); it waits while `limit`
        generations run."""
        with self._cond:
            while self.generations >= limit:
                self._cond.wait(0.05)
            self.generations += 1
        try:
            yield
        finally:
            with self._cond:
                self.generations -= 1
                self._cond.notify_all()

    @contextmanager
    def decoding_phase(self):
        """Around a generation's steps (after its prefill): the batch waits for its step."""
        with self._cond:
            self.decoding += 1
        try:
            yield
        finally:
            with self._cond:
                self.decoding -= 1
                self._cond.notify_all()  # a batch waiting for this generation's step need not

    def share(self, cap: int) -> int:
        """The nodes one generation may draft this step when `cap` is what it would draft alone."""
        k = max(1, self.decoding)
        return cap if k == 1 else max(0, cap // k)

    # -- turns ---------------------------------------------------------------------------------------------
    @contextmanager
    def exclusive(self):
        """The model to one caller (a prompt chunk, a drafter's model call), taking turns with step batches."""
        ticket = object()
        with self._cond:
            self._turns.append(ticket)
            while self._busy or self._turns[0] is not ticket or (self._steps_next and self._steps_ready()):
                self._cond.wait(self._wait_s())
            self._turns.popleft()
            self._busy = True
        try:
            with self.lock:
                yield
        finally:
            with self._cond:
                self._busy, self._steps_next = False, True
                self._cond.notify_all()

    def step(self, rows: int, run: Callable, payload: tuple):
        """This generation's step forward, batched with the others' that wait now: returns `run()`'s result
        (or this step's part of a batched forward's)."""
        me = _Step(rows, run, payload)
        with self._cond:
            self._steps.append(me)
            self._cond.notify_all()
            while not me.done:
                if not self._busy and self._steps_ready() and (self._steps_next or not self._turns):
                    batch = self._take()
                    self._busy = True
                    break
                self._cond.wait(self._wait_s())
            else:
                return self._result(me)
        try:
            self._run(batch)
        finally:
            with self._cond:
                self._busy, self._steps_next = False, False
                self._cond.notify_all()
        with self._cond:
            while not me.done:  # a batch is never taken without its leader's own step
                self._cond.wait(self._wait_s())
        return self._result(me)

    # -- inside --------------------------------------------------------------------------------------------
    def _steps_ready(self) -> bool:
        if not self._steps:
            return False
        full = len(self._steps) >= self.decoding or sum(s.rows for s in self._steps) >= MAX_ROWS
        return full or time.monotonic() - self._steps[0].at >= GATHER_S

    def _wait_s(self) -> float:
        return GATHER_S / 2 if self._steps else 0.05

    def _take(self) -> list[_Step]:
        """The waiting steps, first come first served, up to MAX_ROWS rows (the first always)."""
        batch, rows = [], 0
        for s in list(self._steps):
            if batch and rows + s.rows > MAX_ROWS:
                break
            batch.append(s)
            rows += s.rows
        self._steps = self._steps[len(batch):]
        return batch

    def _run(self, batch: list[_Step]) -> None:
        with self.lock:
            results = None
            if len(batch) > 1:
                try:
                    results = self.run_many([s.payload for s in batch])
                except Exception as exc:  # noqa: BLE001 - every step of the batch re-raises it
                    for s in batch:
                        s.error = exc
                    results = []
            if results is None:  # one step, or parts the batched forward cannot run: each alone, in turn
                results = []
                for s in batch:
                    try:
                        results.append(s.run())
                    except Exception as exc:  # noqa: BLE001 - re-raised in the step's own thread
                        s.error = exc
                        results.append(None)
            else:
                self.batches += 1
                self.batched_rows += sum(s.rows for s in batch)
        with self._cond:
            for s, r in zip(batch, results or [None] * len(batch)):
                s.result = r
            for s in batch:
                s.done = True
            self._cond.notify_all()

    @staticmethod
    def _result(step: _Step):
        if step.error is not None:
            raise step.error
        return step.result
