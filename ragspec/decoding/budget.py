"""Cost-aware draft budget: how many tree nodes are worth verifying on this model and device.

On a CPU the forward cost grows with the number of tokens checked (n-grammys-batched-speculation.txt §3:
memory-bound for a few tokens, compute-bound beyond), so a bigger tree is not free. The model's backend measures
the verify forward time t(n) for n input tokens once per model/device/dtype (`backends.calibrate`, cached as
JSON); here we track how often the drafter's node of each rank is accepted, and take the tree size k that
maximises expected tokens per ms:

    rate(k) = (1 + Σ_{r<k} accept_rate[r]) / t(1 + k)

(a step yields the bonus token plus the accepted drafts and costs one forward of 1 + k tokens, so decoding T
tokens takes T / rate(k) ms). A node is worth adding only while its acceptance per ms of extra forward beats
the step's average — not merely while it saves more than it costs: that weaker rule grew PLD+ trees to ~40
nodes that accepted 8–9 tokens per step but ran slower than 9-node PLD chains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
ALWAYS = 16  # t(n) is measured up to here whatever it costs: the trees that pay on a slow machine live below it


def measured_enough(n: int, ms: float, stop_ms: float | None) -> bool:
    """Whether a t(n) measurement may stop after size n, which took `ms`: past ALWAYS, once one forward takes
    `stop_ms` (None: never), since a bigger tree cannot pay there and `CostModel.time` extrapolates the rest."""
    return stop_ms is not None and n >= ALWAYS and ms >= stop_ms


@dataclass
class CostModel:
    sizes: list[int]
    ms: list[float]

    def __post_init__(self):
        self.ms = monotone(self.ms)  # measured or read back from an older cache file alike

    def time(self, n: int) -> float:
        """t(n) by linear interpolation (extrapolated linearly past the last size)."""
        s, m = self.sizes, self.ms
        if n <= s[0]:
            return m[0]
        for i in range(1, len(s)):
            if n <= s[i]:
                f = (n - s[i - 1]) / (s[i] - s[i - 1])
                return m[i - 1] + f * (m[i] - m[i - 1])
        slope = (m[-1] - m[-2]) / (s[-1] - s[-2])
        return m[-1] + slope * (n - s[-1])

    def as_dict(self) -> dict:
        return {"sizes": self.sizes, "ms": [round(x, 3) for x in self.ms]}


def monotone(ms: list[float]) -> list[float]:
    """A forward of more tokens never costs less: a timing above a later (larger) one is noise from a busy
    machine, so each t(n) becomes the least time measured at n or beyond."""
    out = list(ms)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


CONF_EDGES = (0.2, 0.4, 0.6, 0.8, 0.999)  # confidence buckets: [0, .2) … [.8, .999), [.999, 1]


class ScoreCalibration:
    """Acceptance of scored draft nodes, learned online per (group, confidence bucket).

    A scored drafter gives each node the confidence that it follows its parent (e.g. how often that token
    followed the matched context) and a group (e.g. how long the match was). What counts is how often such a
    node is really accepted once its parent is: a Beta-smoothed hit rate per cell, starting from the drafter's
    own estimate (`prior`), so a fresh cell trusts the drafter and a seen one trusts the data.
    """

    def __init__(self, strength: float = 6.0):
        self.strength = strength
        self.cells: dict[tuple[int, int], list[float]] = {}  # (group, bucket) → [hits, offers]

    @staticmethod
    def bucket(conf: float) -> int:
        for i, edge in enumerate(CONF_EDGES):
            if conf < edge:
                return i
        return len(CONF_EDGES)

    def prior(self, group: int, conf: float) -> float:
        return conf

    def rate(self, group: int, conf: float) -> float:
        hits, offers = self.cells.get((group, self.bucket(conf)), (0.0, 0.0))
        return (hits + self.strength * self.prior(group, conf)) / (offers + self.strength)

    def observe(self, group: int, conf: float, hit: bool) -> None:
        cell = self.cells.setdefault((group, self.bucket(conf)), [0.0, 0.0])
        cell[0] += 1.0 if hit else 0.0
        cell[1] += 1.0

    def as_dict(self) -> dict:
        return {f"{g}:{b}": [round(h), round(o)] for (g, b), (h, o) in sorted(self.cells.items())}


@dataclass
class AdaptiveBudget:
    """The cost model + what acceptance was seen → the draft to verify.

    Unscored trees (pld, trie, PLD+) are cut by rank: per-rank acceptance rates (exponential moving averages).
    Scored trees (suffix) are cut by confidence: each node's chance of acceptance is the product of the
    calibrated conditional rates along its path, and the nodes most likely to be accepted are kept — as many
    as maximise expected tokens per ms, none at all (a plain step) when no draft is expected to pay.
    """

    cost: CostModel
    max_nodes: int = 256
    min_nodes: int = 1  # unscored: always offer one node (t(2) ≈ t(1)), and it keeps the rates learning
    alpha: float = 0.15
    rates: list[float] = field(default_factory=list)
    calibration: ScoreCalibration = field(default_factory=ScoreCalibration)

    def __post_init__(self):
        if not self.rates:
            # optimistic prior: early ranks are often right on copy-heavy tasks; later ones rarely
            self.rates = [0.8 / (1 + r / 8) for r in range(self.max_nodes)]
        self._t = {1: [self.cost.time(n) for n in range(self.max_nodes + 2)]}  # t(n) once, not per step

    def times(self, sharers: int = 1) -> list[float]:
        """t(sharers × n) for n = 0 … max_nodes + 1: the forward's cost when `sharers` generations step together,
        each with a tree of this size. Maximising a step's tokens per ms over it is the whole batch's rate when
        every generation drafts as this one does; so a step of several generations keeps the nodes whose
        acceptance still pays for their rows in the shared forward, and fewer where the rows stop being cheap."""
        if sharers not in self._t:
            self._t[sharers] = [self.cost.time(sharers * n) for n in range(self.max_nodes + 2)]
        return self._t[sharers]

    def select(self, tree, sharers: int = 1):
        """The part of a proposal to verify now (a `fixed` tree, sized by its drafter, whole); `sharers`: the
        generations whose steps share a forward (see `times`)."""
        if tree.fixed:
            return tree
        if not tree.scored:
            return tree.truncated(self.budget(sharers))
        t = self.times(sharers)
        probs = self.path_probabilities(tree)
        order = sorted(range(len(tree)), key=lambda i: (-probs[i], tree.depths[i], i))[: self.max_nodes]
        best_k, best_rate, expected = 0, 1.0 / t[1], 1.0
        for k, i in enumerate(order, start=1):
            expected += probs[i]
            rate = expected / t[1 + k]
            if rate > best_rate:
                best_k, best_rate = k, rate
        return tree.subset(order[:best_k])

    def path_probabilities(self, tree) -> list[float]:
        """P(node accepted) = Π over its path of the calibrated P(node accepted | parent accepted)."""
        cal = self.calibration
        out: list[float] = []
        for i, parent in enumerate(tree.parents):
            p = cal.rate(tree.groups[i], tree.confs[i])
            out.append(p if parent < 0 else out[parent] * p)
        return out

    def observe_proposal(self, tree, path: list[int]) -> None:
        """Learn from a whole proposal once the output has passed it; `path`: the nodes the output followed.
        A `fixed` tree teaches nothing: its nodes are not ranked by how likely they are."""
        if tree.fixed:
            return
        if not tree.scored:
            self.observe(self.max_nodes, path)
            return
        on_path = set(path)
        for i, parent in enumerate(tree.parents):
            if parent < 0 or parent in on_path:  # only nodes whose parent was accepted say anything
                self.calibration.observe(tree.groups[i], tree.confs[i], i in on_path)

    def budget(self, sharers: int = 1) -> int:
        t = self.times(sharers)
        best_k, best_rate, expected = 0, 1.0 / t[1], 1.0
        for k in range(1, self.max_nodes + 1):
            expected += self.rates[k - 1]
            rate = expected / t[1 + k]
            if rate > best_rate:
                best_k, best_rate = k, rate
        return max(best_k, self.min_nodes)

    def observe(self, offered: int, accepted_ranks: list[int]) -> None:
        """Update with one proposal: ranks 0..offered-1 were on offer; those in `accepted_ranks` were (or would
        have been) accepted. A rank the drafter left empty counts as a miss — a budget the drafter cannot fill
        gains nothing, so it must not keep the tree cap (and the tree) large."""
        hit = set(accepted_ranks)
        a = self.alpha
        for r in range(min(offered, self.max_nodes)):
            self.rates[r] = (1 - a) * self.rates[r] + a * (1.0 if r in hit else 0.0)


def settle(budget, pending: list, generated: list[int], final: bool) -> list:
    """Teach `budget` from proposals (tree, output length when proposed) whose depth the output has now passed
    (or all of them, `final`): the nodes on the path the output followed were accepted, the others missed.
    Returns the proposals still waiting. Shared by the generator and `bench.replay`, so both learn alike."""
    keep = []
    for full, start in pending:
        if not final and len(generated) - start <= full.max_depth():
            keep.append((full, start))
            continue
        budget.observe_proposal(full, full.follow(generated[start:]))
    return keep
