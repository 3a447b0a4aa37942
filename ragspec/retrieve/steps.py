"""Steps between retrieval and the prompt, in the shape of LlamaIndex's node postprocessors: each a small class
whose `run(query, sources)` returns the sources it passes on and what it found; `run_steps` runs them in order.

Why: the relevance gate (`retrieve.relevance.RelevanceGate`) and the source budget (`retrieve.trim.SourceBudget`)
judge the same question against the same sources' windows; a chain lets each say what it does on its own while
`Query` measures once for both (the gate's window cosines are the budget's), and a step that ends the ask (the
gate declining) stops the chain before the sources are cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ragspec.retrieve.windows import Measured, WindowScorer


@dataclass
class Query:
    """What the steps judge (LlamaIndex's QueryBundle): the question (a conversation's first: a follow-up keeps
    that turn's sources and verdict), whether this ask is a follow-up, and its measurement against the sources,
    made once and shared by the steps."""

    text: str
    scorer: WindowScorer | None
    follow_up: bool = False
    _measured: tuple | None = field(default=None, repr=False)  # (sources measured, wholes, Measured)

    def measure(self, sources, wholes: bool) -> Measured:
        """The question against `sources` (`WindowScorer.measure`): measured again only for other sources, or
        when the whole sources are asked for and were not measured."""
        got = self._measured
        if got is None or got[0] is not sources or (wholes and not got[1]):
            self._measured = (sources, wholes, self.scorer.measure(self.text, sources, wholes))
        return self._measured[2]


def run_steps(steps, query: Query, sources: list) -> tuple[list, dict]:
    """Each step in order over the sources the one before passed on; returns the sources and what each step found
    ({step.name: found}). A finding with `stop` (the gate declining) ends the chain, its sources as they were."""
    found: dict = {}
    for step in steps:
        sources, found[step.name] = step.run(query, sources)
        if found[step.name].stop:
            break
    return sources, found
