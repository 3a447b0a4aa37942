"""The cost-aware budget: a monotone cost curve, and a tree cap that follows acceptance and cost."""

from ragspec.decoding.budget import ALWAYS, AdaptiveBudget, CostModel, measured_enough, monotone


def test_monotone_removes_upward_noise():
    assert monotone([120, 170, 170, 380, 470, 350, 450]) == [120, 170, 170, 350, 350, 350, 450]
    assert monotone([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]


def test_a_cut_measurement_extrapolates_its_last_two_sizes():
    """t(n) stops being measured past ALWAYS once a forward takes stop_ms; the rest is the last slope."""
    assert not measured_enough(8, 5000.0, 1000.0)  # below ALWAYS: measured whatever it costs
    assert not measured_enough(ALWAYS, 999.0, 1000.0) and not measured_enough(64, 5000.0, None)
    assert measured_enough(ALWAYS, 1000.0, 1000.0)
    cut = CostModel([1, 8, 16, 32], [60, 200, 380, 800])
    assert cut.time(64) == 800 + (800 - 380) / 16 * 32 and cut.time(24) == 590


def test_budget_follows_cost_and_acceptance():
    flat = CostModel([1, 2, 4, 8, 16, 32, 64], [100, 101, 102, 103, 104, 105, 106])
    steep = CostModel([1, 2, 4, 8, 16, 32, 64], [100, 200, 400, 800, 1600, 3200, 6400])
    good = [0.9] * 64
    assert AdaptiveBudget(flat, max_nodes=64, rates=list(good)).budget() == 64
    assert AdaptiveBudget(steep, max_nodes=64, rates=list(good)).budget() == 1  # the floor: one node
    b = AdaptiveBudget(flat, max_nodes=64, rates=list(good))
    for _ in range(60):  # nothing is ever accepted: rates fall, and so does the cap
        b.observe(64, [])
    assert b.budget() == 1


def test_budget_maximises_tokens_per_ms_not_time_saved():
    # four sure nodes, then nodes accepted 15 % of the time at 10 ms each: each later node "saves" more than
    # it costs (0.15 × 100 > 10) yet lowers the throughput, (1 + 3.6 + 0.15) / 150 < (1 + 3.6) / 140
    linear = CostModel([1, 2, 4, 8, 16, 32, 64, 128], [100 + 10 * (n - 1) for n in (1, 2, 4, 8, 16, 32, 64, 128)])
    rates = [0.9] * 4 + [0.15] * 60
    assert AdaptiveBudget(linear, max_nodes=64, rates=rates).budget() == 4


def test_generations_sharing_a_step_size_their_trees_for_the_whole_forward():
    """With k generations stepping together each tree is sized for t(k × rows): rows ride on the weights' read
    while the forward is memory-bound, so a few generations keep their likely drafts, and many, past the knee,
    keep only what still pays for its rows in the shared forward."""
    knee = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 101, 102, 104, 110, 200, 380, 740, 1460])
    rates = [0.9] * 3 + [0.6] * 4 + [0.2] * 57
    b = AdaptiveBudget(knee, max_nodes=64, rates=list(rates))
    assert b.times(4)[2] == knee.time(8) and b.times(1)[5] == knee.time(5)
    alone, two, eight, thirty_two = b.budget(), b.budget(2), b.budget(8), b.budget(32)
    assert alone == 15  # 16 rows: the last before the knee
    assert two == 7 and eight == 3  # 16 and 32 rows in all: what still pays past the knee
    assert thirty_two == 1  # the floor: one node each
    assert b.budget(1) == alone  # asking for k does not change what a lone step takes
