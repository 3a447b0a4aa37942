"""What the gate windows stored with an index save at ask time, and whether they change a decision.

Usage: python examples/gate_windows_cost.py INDEX   (an index built by this ragspec, e.g. of the quickstart corpus)

For the quickstart's 12 questions and 12 questions no source answers, over the
default pipeline's retrieved sources: the time to measure the question against the sources' windows and wholes
(the relevance gate's and the source budget's one measurement) with the stored vectors, and without them, every
source pooled from its own forward at ask time: with nothing remembered (the first ask over those sources) and
with every source remembered (a warm process that has seen those sources);
the largest score difference, and whether the gate's verdict (the 0.5B's band, 0.415 / 0.52) or the
budget's cut (256 tokens) differs for any question; beside it, the same between two ask-time measurements whose
only difference is the embedder's batch size (16, as the index embeds, against 8): what a bfloat16 embedder's
batching alone moves.
"""

from __future__ import annotations

import statistics
import sys
import time

from ragspec.pipeline import Pipeline
from ragspec.retrieve.trim import SourceUnits, cut_sources
from ragspec.retrieve.windows import WindowScorer

QUICKSTART = [
    "What does the global statement do?", "What does the nonlocal statement do?",
    "How does a with statement call __enter__ and __exit__?",
    "What happens when an exception is raised in a finally clause?", "How are default parameter values evaluated?",
    "What is the difference between a list and a tuple?", "How does the import statement find a module?",
    "What does the yield expression return?", "How are names resolved in class bodies?",
    "What does the assert statement do when optimization is requested?",
    "How does augmented assignment like x += 1 work?", "What is name mangling of private names?",
]
OFF_TOPIC = [
    "Who won the 1966 football world cup?", "How long should bread dough rise?", "What is the capital of Peru?",
    "Which river flows through ten countries?", "How many moons does Jupiter have?", "Who painted the Mona Lisa?",
    "What temperature does water boil at on Everest?", "Who wrote War and Peace?", "How do bees make honey?",
    "When did the Berlin wall fall?", "What is the speed of light?", "How tall is Mount Kilimanjaro?",
]
FLOOR, DOUBT, BUDGET = 0.415, 0.52, 256


def main(path: str) -> None:
    new = Pipeline(None, path)
    embedder = new.retriever.embedder
    count = lambda texts: [len(ids) for ids in embedder.tokenizer(texts, add_special_tokens=False)["input_ids"]]  # noqa: E731
    stored = WindowScorer(lambda: embedder, lambda: new.retriever.index)
    warm = WindowScorer(lambda: embedder)  # no index: every source pooled at ask time (and remembered)
    asks = [(q, new.retrieve(q)[0]) for q in QUICKSTART + OFF_TOPIC]
    embedder.encode(["warm up"])
    for q, sources in asks:  # remember every source once
        warm.measure(q, sources)
    t_stored, t_cold, t_warm, diff, flips, cuts = [], [], [], 0.0, 0, 0
    noise, noise_flips, noise_cuts = 0.0, 0, 0

    class By16:  # the embedder in batches of 16
        def encode(self, texts):
            return embedder.encode(texts, 16)

        def encode_windows(self, texts):
            return embedder.encode_windows(texts, 16)
    for q, sources in asks:
        t = time.perf_counter()
        a = stored.measure(q, sources)
        t_stored.append(time.perf_counter() - t)
        cold = WindowScorer(lambda: embedder)  # nothing remembered
        t = time.perf_counter()
        b = cold.measure(q, sources)
        t_cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        warm.measure(q, sources)
        t_warm.append(time.perf_counter() - t)
        diff = max(diff, abs(a.score - b.score))
        verdict = lambda s: (s >= FLOOR, FLOOR <= s < DOUBT)  # noqa: E731
        flips += verdict(a.score) != verdict(b.score)
        units = [SourceUnits.of(s.text) for s in sources]
        cuts += cut_sources(units, a.windows, BUDGET, count) != cut_sources(units, b.windows, BUDGET, count)
        c = WindowScorer(lambda: By16()).measure(q, sources)
        noise = max(noise, abs(c.score - b.score))
        noise_flips += verdict(c.score) != verdict(b.score)
        noise_cuts += cut_sources(units, c.windows, BUDGET, count) != cut_sources(units, b.windows, BUDGET, count)
    n_windows = [sum(len(SourceUnits.of(s.text).windows) for s in sources) for _, sources in asks]
    print(f"{len(asks)} asks, {statistics.median(n_windows)} windows a question (median)")
    for name, ts in (("stored", t_stored), ("ask time, nothing remembered", t_cold),
                     ("ask time, every source remembered", t_warm)):
        print(f"{name}: median {statistics.median(ts) * 1000:.0f} ms, max {max(ts) * 1000:.0f} ms")
    print(f"largest score difference stored vs ask time: {diff:.2e}; gate verdicts that differ: {flips}; "
          f"budget cuts that differ: {cuts}")
    print(f"ask time in batches of 16 vs of 8: largest score difference {noise:.2e}; verdicts that differ: "
          f"{noise_flips}; budget cuts that differ: {noise_cuts}")
    t = []
    for q, sources in asks:  # the stored scorer again: the merged sources it pooled remembered
        t0 = time.perf_counter()
        stored.measure(q, sources)
        t.append(time.perf_counter() - t0)
    print(f"stored, second time: median {statistics.median(t) * 1000:.0f} ms, max {max(t) * 1000:.0f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
