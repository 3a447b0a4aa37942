"""Continuous batching: the draft steps of several generations of one model share a forward.

Why: a CPU step reads every weight once whatever its row count, so rows are cheap together (eight one-token
steps in one forward take 1.4× (1.5B) to 2.4× (0.5B) one alone on the Xeon, not 8×); a server with eight users
asking at once would otherwise run eight steps where one costs little more. ragspec's CPU kernels are
row-independent (a row's bits do not depend on the other rows of a forward), so each generation's logits, and so
its answer, are the same bits as when it runs alone.

How: every generation keeps its own KV cache, drafter and tree, on its own thread. A step hands its rows to
`step`; the waiting steps run as one forward (up to `MAX_ROWS` rows) and each gets its logits. A prompt is read
in chunks, one chunk per turn under `exclusive()`, and a chunk's turn and a step batch's turn alternate:
streams already running keep streaming while a new prompt is read (the gap between their tokens is about one
chunk's time). Anything else that uses the model (a drafter calling it, a cache assembled from source pieces,
a retrieval's embedder) takes a turn too, or holds the model's lock, which every forward here holds.

A forward starts only once every running generation waits here (or `STRAGGLER_S` has passed): on a CPU whose
cores all run the forward, a generation drafting, accepting or streaming beside it would slow every core's share
of it. So the generations' own work runs between forwards, never during one.

Policy for the draft budget: with k generations stepping, each sizes its tree as if all k drafted as it does,
keeping the nodes that maximise the whole step's expected tokens per ms under the measured t(k × rows)
(`budget.AdaptiveBudget.times`). Rows are cheap while the forward stays bound by reading the weights, so a few
generations keep their likely drafts; many keep only their surest nodes, or step one token each. A fixed budget
(`drafting.budget: N`) is split equally: N + 1 rows a step, each generation drafting (N + 1) // k - 1.
Alone, a generation drafts what its own budget says.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

STRAGGLER_S = 0.02  # the longest a forward waits for a generation still busy with its own work
IDLE_WAIT_S = 0.5  # a waiter's longest sleep (a safety net: every change that lets a waiter on notifies it)
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
        self._turns: list[tuple[float, int, float]] = []  # exclusive turns waiting: (priority, ticket, since)
        self._tickets = itertools.count()
        self._steps_next = True  # after an exclusive turn, waiting steps go first (and the reverse)
        self._mine = threading.local()  # .generation: this thread runs a generation here
        self.waiting = 0  # generations' threads waiting here (for a step or a turn)
        self.decoding = 0  # generations past their prefill: how many share a step's rows
        self.generations = 0  # generations running (prefill included)
        self.batches = 0  # batched forwards run
        self.batched_steps = 0  # generations' steps in them
        self.batched_rows = 0

    # -- who is running ------------------------------------------------------------------------------------
    @contextmanager
    def generation(self, limit: int = 1 << 30):
        """Around one generation (on its own thread): counted in `generations` (the server's /healthz); it waits
        while `limit` generations run."""
        with self._cond:
            while self.generations >= limit:
                self._cond.wait(0.05)
            self.generations += 1
        self._mine.generation, self._mine.since = True, time.monotonic()
        try:
            yield
        finally:
            self._mine.generation = False
            with self._cond:
                self.generations -= 1
                self._cond.notify_all()  # a forward waiting for this generation need not

    @contextmanager
    def decoding_phase(self):
        """Around a generation's steps (after its prefill): its share of a step's rows."""
        with self._cond:
            self.decoding += 1
        try:
            yield
        finally:
            with self._cond:
                self.decoding -= 1

    @contextmanager
    def aside(self):
        """Around a generation's wait elsewhere (for another request's prompt): forwards need not wait for it."""
        with self._cond:
            waiting = self._waiting()
            waiting.__enter__()
        try:
            yield
        finally:
            with self._cond:
                waiting.__exit__(None, None, None)

    def sharers(self) -> int:
        """How many generations' steps share a forward now (those past their prefill): what a generation's draft
        budget divides the step among (`budget.AdaptiveBudget.times`)."""
        return max(1, self.decoding)

    # -- turns ---------------------------------------------------------------------------------------------
    @contextmanager
    def exclusive(self):
        """The model to one caller (a prompt chunk, a drafter's model call), taking turns with step batches. The
        turns go by the caller's generation's start, first come first served: a prompt's later chunks come before
        a later request's first, so each request's first token waits for the prompts before its own, not for
        every prompt that arrived with it."""
        now = time.monotonic()
        mine = (getattr(self._mine, "since", now) if getattr(self._mine, "generation", False) else now,
                next(self._tickets), now)
        with self._cond:
            self._turns.append(mine)
            self._turns.sort()
            with self._waiting():
                while not self._turn_is(mine):
                    self._cond.wait(self._wait_s())
            self._turns.remove(mine)
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
            with self._waiting():
                while not me.done:
                    if self._steps_go():
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
        with self._cond, self._waiting():
            while not me.done:  # a batch is never taken without its leader's own step
                self._cond.wait(self._wait_s())
        return self._result(me)

    # -- inside (under self._cond) ---------------------------------------------------------------------------
    @contextmanager
    def _waiting(self):
        counted = getattr(self._mine, "generation", False)
        if counted:
            self.waiting += 1
            self._cond.notify_all()  # this thread's work is done: a forward may be waiting for it
        try:
            yield
        finally:
            if counted:
                self.waiting -= 1

    def _quiet(self, since: float) -> bool:
        """Every running generation waits here, or the oldest caller has waited `STRAGGLER_S` since `since`."""
        return self.waiting >= self.generations or time.monotonic() - since >= STRAGGLER_S

    def _steps_ready(self) -> bool:
        if not self._steps:
            return False
        return sum(s.rows for s in self._steps) >= MAX_ROWS or self._quiet(self._steps[0].at)

    def _steps_go(self) -> bool:
        """A step batch runs now: the model is free, the batch is ready and it is the steps' turn."""
        return not self._busy and self._steps_ready() and (self._steps_next or not self._turns)

    def _turn_is(self, ticket) -> bool:
        """The exclusive turn `ticket` runs now: the model is free, it is first in line and not the steps' turn."""
        if self._busy or self._turns[0] is not ticket:
            return False
        if self._steps_ready() and (self._steps_next or not self._quiet(ticket[2])):
            return False
        return self._quiet(ticket[2])

    def _wait_s(self) -> float:
        """How long a waiter sleeps before it looks again: until the next straggler deadline of a waiting step or
        turn (the one change nobody announces), else until notified. Every other change notifies, and a waiter
        that woke every few milliseconds would take the interpreter from the forward running beside it."""
        now = time.monotonic()
        ahead = [at + STRAGGLER_S for at in [s.at for s in self._steps[:1]] + [t[2] for t in self._turns]
                 if at + STRAGGLER_S > now]
        return min(ahead) - now + 0.001 if ahead and not self._busy else IDLE_WAIT_S

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

    # -- the forward (outside self._cond) ----------------------------------------------------------------------
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
            elif results:
                self.batches += 1
                self.batched_steps += len(batch)
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
