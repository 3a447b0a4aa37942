from ragspec.eval.metrics import mrr_at, ndcg_at, recall_at
from ragspec.retrieve.fusion import rrf


def test_metrics_known_values():
    rel = {"a": 1, "b": 2}
    assert ndcg_at(["b", "a", "x"], rel) == 1.0
    assert round(ndcg_at(["x", "b"], rel), 4) == round((2 / 1.584962500721156) / (2 + 1 / 1.584962500721156), 4)
    assert recall_at(["a", "x"], rel, 100) == 0.5
    assert mrr_at(["x", "y", "a"], rel) == 1 / 3
    assert mrr_at(["x"], rel) == 0.0


def test_rrf():
    fused = rrf([[1, 2, 3], [3, 1]], k=60)
    assert [i for i, _ in fused] == [1, 3, 2]
    assert abs(fused[0][1] - (1 / 61 + 1 / 62)) < 1e-12
