"""The static verifier (decoding/backends/static_verifier.py), run eagerly on the CPU with the real SmolLM2:
greedy through drafters equals `generate`, a tree's rows equal the dynamic backend's, a generation's region of the
slot cache moves when full without changing a token, generations running at once share the cache (each in its own
region) and, under a step batcher, their forwards, answering as alone, and a cancelled one gives its region back
at once; forks are independent, sampling through it keeps the distribution, and
the choice of backend follows `RAGSPEC_STATIC_VERIFIER` (PLD+ drafters stay on the dynamic one). On a GPU the same
steps replay CUDA graphs: tests/test_cuda.py runs every drafter through them there. And the backends' t(n)
calibration, which the static verifier measures with its own steps, runs once when two loads race."""

from __future__ import annotations

import pytest
import torch

from ragspec.decoding import backends
from ragspec.decoding.backends import static_verifier
from ragspec.decoding.backends.static_verifier import StaticBackend, bucket
from ragspec.decoding.backends.transformers import TransformersBackend
from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.decoding.sampling import SamplingSettings
from ragspec.decoding.tree import DraftTree
from ragspec.paths import read_json

pytestmark = pytest.mark.slow
FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [10, 10, 10, 10.2, 10.4, 10.8, 11.6, 13, 16])


@pytest.fixture
def static(monkeypatch):
    monkeypatch.setenv("RAGSPEC_STATIC_VERIFIER", "1")


def branching_tree() -> DraftTree:
    t = DraftTree()
    t.add_chain([5, 6, 7])
    t.add_chain([5, 9])
    t.add_chain([4, 11, 12, 13])
    return t


def test_buckets_and_the_choice(smol, monkeypatch):
    assert [bucket(n) for n in (1, 2, 3, 9, 256)] == [1, 2, 4, 16, 256]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(257)
    model, _ = smol
    monkeypatch.setenv("RAGSPEC_STATIC_VERIFIER", "auto")  # auto: on CUDA only
    assert backends.backend_class(model) is TransformersBackend
    monkeypatch.setenv("RAGSPEC_STATIC_VERIFIER", "1")
    assert backends.backend_class(model) is StaticBackend
    assert type(backends.make_backend(model, SamplingSettings())) is StaticBackend
    assert type(backends.make_backend(model, SamplingSettings(), hidden_layer=3)) is TransformersBackend
    assert backends.cost_key(model).endswith("-static")


@pytest.mark.parametrize("method", ["none", "pld", "suffix", "trie", "lookahead"])
def test_greedy_matches_generate(static, smol, cases, method):
    model, tok = smol
    accepted = 0
    for prompt, ref in cases:
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(method, model, tok), max_new_tokens=48,
                                   budget=AdaptiveBudget(FLAT))
        gen.generate(prompt)
        assert gen.tokens == ref, method
        accepted += gen.stats.accepted_draft_tokens
    assert accepted > 0 or method == "none"


def test_tree_rows_equal_the_dynamic_backend(smol, cases):
    model, _ = smol
    prompt = cases[0][0]
    tree = branching_tree()
    dynamic, fixed = TransformersBackend(model, SamplingSettings()), StaticBackend(model, SamplingSettings())
    dynamic.prefill(prompt)
    fixed.prefill(prompt)
    assert torch.equal(dynamic._root_logits, fixed._root_logits) or torch.allclose(
        dynamic._root_logits, fixed._root_logits, atol=1e-4)
    want, got = dynamic.score(tree).float(), fixed.score(tree).float()
    assert got.shape == want.shape == (1 + len(tree), model.config.vocab_size)
    assert torch.allclose(got, want, atol=1e-3 * want.abs().max().item())
    assert fixed.cached == len(prompt)  # scoring keeps nothing
    # a step down one branch keeps that path: the next step's rows see it, as the dynamic backend's do
    for backend in (dynamic, fixed):
        backend.step(tree)
    nxt = DraftTree()
    nxt.add_chain([3, 8])
    assert dynamic.cached == fixed.cached
    assert torch.allclose(fixed.score(nxt).float(), dynamic.score(nxt).float(), atol=1e-3 * want.abs().max().item())


def test_a_full_region_moves_mid_generation(static, smol, cases, monkeypatch):
    """A region of little room beyond the prompt fills while drafts run: it moves to one twice as large, its rows
    with it, the buffer growing to hold it, and the tokens stay greedy's."""
    model, tok = smol
    monkeypatch.setattr(static_verifier, "ROOM", 8)
    monkeypatch.setattr(static_verifier, "_capacity", lambda slots: slots)  # no power-of-two headroom
    static_verifier._HELD.pop(model, None)
    prompt, ref = cases[1]
    gen = SpeculativeGenerator(model, tok, drafter=make_drafter("suffix", model, tok), max_new_tokens=48,
                               budget=AdaptiveBudget(FLAT))
    moves, grown = [], []
    take, grow = static_verifier.Held.take, static_verifier.Held.grow
    monkeypatch.setattr(static_verifier.Held, "take",
                        lambda self, *a, keep=None: (keep and moves.append(keep), take(self, *a, keep=keep))[1])
    monkeypatch.setattr(static_verifier.Held, "grow", lambda self, cap: (grown.append(cap), grow(self, cap)))
    gen.generate(prompt)
    assert gen.tokens == ref and moves and grown


def test_generations_share_the_cache_each_in_its_own_region(smol, cases):
    """Generations running at once write one slot cache, each in a region of its own past the scratch slots; a
    closed generation's region (and on CUDA the graphs) serve the model's next one, and its steps are its own."""
    model, _ = smol
    prompt = cases[0][0]
    static_verifier._HELD.pop(model, None)
    first = StaticBackend(model, SamplingSettings())
    first.prefill(prompt)
    beside = StaticBackend(model, SamplingSettings())
    beside.prefill(prompt)
    assert beside.cache is first.cache
    (a0, a1), (b0, b1) = (static_verifier._HELD[model].regions[x._owner] for x in (first, beside))
    assert static_verifier.SCRATCH <= a0 < a1 <= b0 < b1 and first.base == a0 and beside.base == b0
    tokens = first.step(branching_tree()).tokens
    assert beside.step(branching_tree()).tokens == tokens
    first.close()
    beside.close()
    assert not static_verifier._HELD[model].regions
    nxt = StaticBackend(model, SamplingSettings())
    nxt.prefill(prompt)
    assert nxt.cache is first.cache and nxt.base == static_verifier.SCRATCH
    assert nxt.step(branching_tree()).tokens == tokens
    nxt.close()


@pytest.mark.parametrize("method", ["none", "suffix", "pld", "lookahead"])
def test_generations_together_share_forwards_and_answer_as_alone(static, smol, cases, method):
    """Under a step batcher the static verifier's generations pack their rows into one bucket's forward (one
    graph replay on CUDA): each answer is still greedy's, token for token."""
    import threading

    from ragspec.decoding.backends import run_steps
    from ragspec.decoding.step_batcher import StepBatcher

    model, tok = smol
    batcher = StepBatcher(threading.Lock(), lambda payloads: run_steps(model, payloads))
    got: dict = {}

    def generation(i):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(method, model, tok), max_new_tokens=48,
                                   budget=AdaptiveBudget(FLAT))
        "".join(d.text for d in gen.stream(cases[i][0], batcher=batcher))
        got[i] = gen.tokens

    threads = [threading.Thread(target=generation, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(cases))] == [ref for _, ref in cases], method
    assert batcher.batches > 0 and batcher.generations == 0
    assert not static_verifier._HELD[model].regions  # every region given back


def test_a_cancelled_generation_gives_its_region_back_at_once(static, smol, cases):
    """Under a step batcher, a generation cancelled mid-answer leaves at once: its region is free while the other
    generation still answers, and that one's answer is still greedy's."""
    import threading

    from ragspec.decoding.backends import run_steps
    from ragspec.decoding.step_batcher import StepBatcher
    from ragspec.errors import Cancelled

    model, tok = smol
    static_verifier._HELD.pop(model, None)
    batcher = StepBatcher(threading.Lock(), lambda payloads: run_steps(model, payloads))
    cancel, left, regions_then = threading.Event(), threading.Event(), []
    out: dict = {}

    def cancelled():
        gen = SpeculativeGenerator(model, tok, max_new_tokens=200, eos_token_ids=[])
        try:
            for i, _ in enumerate(gen.stream(cases[0][0], batcher=batcher, cancel=cancel)):
                if i == 3:
                    cancel.set()
        except Cancelled:
            out["cancelled"] = True
        finally:
            left.set()

    def other():
        gen = SpeculativeGenerator(model, tok, max_new_tokens=48)
        for _ in gen.stream(cases[1][0], batcher=batcher):
            if left.is_set() and not regions_then:
                regions_then.append(len(static_verifier._HELD[model].regions))
        out["other"] = gen.tokens

    threads = [threading.Thread(target=f) for f in (cancelled, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out.get("cancelled") and out.get("other") == cases[1][1]
    assert regions_then == [1], "the cancelled generation's region outlived it"
    assert not static_verifier._HELD[model].regions


def test_forks_are_independent(smol, cases):
    model, _ = smol
    prompt = cases[0][0]
    base = StaticBackend(model, SamplingSettings())
    base.prefill(prompt)
    a, b = base.fork(), base.fork()
    first = a.step(branching_tree()).tokens
    b.step(DraftTree())  # b takes another path; a and base must not see it
    again = base.fork().step(branching_tree()).tokens
    assert first == again and base.cached == len(prompt)


def test_sampling_keeps_the_distribution(smol):
    """Draws of the first two tokens from one static forward over a branching tree follow the model's joint."""
    from test_engine_sampling import SAMPLES, SETTINGS, assert_follows, chat, draft_tree, exact_joint

    from ragspec.decoding.backends.accept import accept_sampled

    model, tok = smol
    prompt = chat(tok, "Name one colour of the rainbow.")
    p1, joint = exact_joint(model, prompt)
    tree = draft_tree(p1, joint)
    v = StaticBackend(model, SETTINGS)
    v.prefill(prompt)
    logits = v.score(tree)
    gen = torch.Generator().manual_seed(7)
    counts: dict = {}
    for _ in range(SAMPLES):
        path, bonus = accept_sampled(tree, logits, SETTINGS, gen)
        toks = [tree.tokens[i] for i in path] + [bonus]
        if len(toks) < 2:
            nxt = sorted(k[1] for k in joint if k[0] == toks[0])
            w = torch.tensor([joint[(toks[0], x)] for x in nxt])
            toks.append(nxt[int(torch.multinomial(w / w.sum(), 1, generator=gen))])
        counts[(toks[0], toks[1])] = counts.get((toks[0], toks[1]), 0) + 1
    assert_follows(joint, counts)


def test_calibration_measures_steps(smol):
    model, _ = smol
    ms = StaticBackend.measure_costs(model, 64, 1, [1, 8])
    assert len(ms) == 2 and all(m > 0 for m in ms)


def test_calibration_stops_past_the_sizes_that_can_pay(smol, tmp_path, monkeypatch):
    """Once a forward past budget.ALWAYS takes STOP_MS, larger sizes are not measured: the cost file keeps the
    sizes it measured and the budget extrapolates the rest."""
    from ragspec.decoding.backends import calibrate

    model, _ = smol
    assert len(TransformersBackend.measure_costs(model, 32, 1, [1, 16, 24, 32], stop_ms=0.0)) == 2
    monkeypatch.setattr(backends, "STOP_MS", 0.0)  # every forward is "long": stop at the first past ALWAYS
    cost = calibrate(model, context=32, repeats=1, cache_dir=tmp_path, sizes=(1, 2, 16, 24, 32))
    assert cost.sizes == [1, 2, 16] and cost.time(32) >= cost.time(16)
    assert read_json(next(tmp_path.glob("*.json")))["sizes"] == [1, 2, 16]


def test_loads_together_measure_t_n_once(smol, tmp_path, monkeypatch):
    """Two loads of one model at once (a server and a notebook) measure its t(n) once: the second waits for
    the first's figures (a lock beside the file) instead of measuring beside it."""
    import threading
    import time

    from ragspec.decoding.backends import calibrate

    model, _ = smol
    calls = []
    real = TransformersBackend.measure_costs

    def counted(*args, **kwargs):
        calls.append(1)
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(TransformersBackend, "measure_costs", staticmethod(counted))
    monkeypatch.setattr(backends, "BUSY", 0.0)  # the sleep above idles the cores: not another job's load
    out = [None, None]

    def run(i):
        out[i] = calibrate(model, context=32, repeats=1, cache_dir=tmp_path, sizes=(1, 2))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and out[0].sizes == out[1].sizes == [1, 2]
    assert out[1].ms == pytest.approx(out[0].ms, abs=0.01)


def test_t_n_measured_beside_another_job_is_measured_again(smol, tmp_path, monkeypatch):
    """t(n) measured while other processes take the cores (spinning ones here, as a calibration job or a second
    ask would) is not kept as the machine's: it is marked, the next load measures again, and after TRIES
    contended tries the figures are kept without measuring."""
    import json
    import os
    import subprocess
    import sys
    import time

    from ragspec.decoding.backends import BUSY, TRIES, calibrate

    model, _ = smol
    args = dict(context=256, repeats=3, cache_dir=tmp_path, sizes=(1, 2, 4, 8, 16))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(0.5)
        busy_lines = []
        calibrate(model, progress=busy_lines.append, **args)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    (path,) = tmp_path.glob("*.json")
    first = json.loads(path.read_text())
    assert first["contended"] and first["cpu_share"] < BUSY and first["tries"] == 1, first
    assert any("another job ran): measuring again" in line for line in busy_lines), busy_lines
    assert "measured again at the next load" in busy_lines[-1]

    quiet_lines = []
    calibrate(model, progress=quiet_lines.append, **args)  # the machine is quiet now: measured again
    second = json.loads(path.read_text())
    assert "measuring this model's step cost again" in quiet_lines[0] and second["tries"] == 2
    assert second["cpu_share"] > first["cpu_share"]

    # a table contended on every try is kept after TRIES of them: read, not measured
    path.write_text(json.dumps(second | {"contended": True, "cpu_share": 0.4, "tries": TRIES}))
    monkeypatch.setattr(TransformersBackend, "measure_costs", staticmethod(lambda *a: pytest.fail("re-measured")))
    cost = calibrate(model, **args)
    assert cost.ms == second["ms"]
