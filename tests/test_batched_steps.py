"""Continuous batching (`decoding/step_batcher.py`, `runtime/step_forward.step_forward_many`): generations that
run together share their steps' forwards, and each answer stays the one it gets alone, token for token."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from transformers import DynamicCache

from ragspec.decoding.backends import run_steps
from ragspec.decoding.backends.transformers import cache_arg
from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.decoding.sampling import SamplingSettings
from ragspec.decoding.step_batcher import StepBatcher
from ragspec.errors import Cancelled
from ragspec.models.registry import installed
from ragspec.runtime.growing_cache import growing
from ragspec.runtime.step_forward import step_forward, step_forward_many

SMOL = "smollm2-135m-instruct"
FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])
METHODS = ["none", "pld", "trie", "suffix", "lookahead", "ngrammys", "auto", "pldplus-h"]

pytestmark = pytest.mark.skipif(not installed(SMOL), reason="SmolLM2's weight package is not installed")


@pytest.fixture(scope="module")
def smol_gguf():
    from ragspec.models.generator import load_generator

    return load_generator(SMOL, dtype="gguf")


@pytest.fixture(scope="module")
def prompts(smol_gguf):
    from greedy_cases import PASSAGES, QUESTIONS, chat_prompt

    _, tok = smol_gguf
    return [chat_prompt(tok, PASSAGES[p], q) for q, p in QUESTIONS]


def batcher_of(model) -> StepBatcher:
    return StepBatcher(threading.Lock(), lambda payloads: run_steps(model, payloads))


def together(jobs) -> list:
    """Run the callables on threads at once; their results in order (an exception is returned, not raised)."""
    out: list = [None] * len(jobs)

    def run(i):
        try:
            out[i] = jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def _prefilled(model, n: int, seed: int):
    ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(seed))
    cache = growing(DynamicCache(config=model.config))
    with torch.inference_mode():
        type(model).forward(model, input_ids=ids, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    return cache


def _copy(cache, model):
    twin = growing(DynamicCache(config=model.config))
    for mine, theirs in zip(twin.layers, cache.layers):
        mine.update(theirs.keys.clone(), theirs.values.clone())
    return twin


def test_one_forward_of_several_generations_gives_each_its_own_bits(smol_gguf):
    """Three generations' steps (a tree, one token, a chain) over caches of different lengths, in one forward:
    each part's logits and cache are the bits of its forward alone."""
    model, _ = smol_gguf
    parts, alone = [], []
    for n, rows, seed in ((120, 9, 1), (300, 1, 2), (41, 4, 3)):
        cache = _prefilled(model, n, seed)
        ids = torch.randint(100, 20000, (1, rows), generator=torch.Generator().manual_seed(seed + 10))
        pos = torch.arange(n, n + rows)[None]
        visible = torch.ones(1, 1, rows, n + rows, dtype=torch.bool).tril_(n)
        if rows > 4:  # a tree: the second half are siblings under the first row
            visible[0, 0, rows // 2 :, n + 1 : n + rows] = torch.eye(rows, dtype=torch.bool)[rows // 2 :, 1:]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, torch.finfo(torch.float32).min)
        mine = _copy(cache, model)
        with torch.inference_mode():
            out = step_forward(model, input_ids=ids, position_ids=pos, attention_mask=mask, cache=mine)
        alone.append((out.logits[0], mine))
        parts.append((ids, pos, mask, cache))
    with torch.inference_mode():
        logits = step_forward_many(model, parts)
    assert logits is not None
    for (ref, ref_cache), got, (_, _, _, cache) in zip(alone, logits, parts):
        assert torch.equal(got, ref)
        for a, b in zip(cache.layers, ref_cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@pytest.mark.parametrize("method", METHODS)
def test_answers_together_are_the_answers_alone(smol_gguf, prompts, method):
    model, tok = smol_gguf

    def generation(prompt, batcher=None):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(method, model, tok), max_new_tokens=40,
                                   budget=AdaptiveBudget(FLAT))
        "".join(d.text for d in gen.stream(prompt, batcher=batcher))
        return gen.tokens

    alone = [generation(p) for p in prompts]
    batcher = batcher_of(model)
    got = together([lambda p=p: generation(p, batcher) for p in prompts])
    assert got == alone, method
    if method != "pldplus-h":  # PLD+ reads hidden states: its generations take the model in turn
        assert batcher.batches > 0, "no step ran batched"
    if method == "suffix":  # rows are cheap on FLAT: steps sharing a forward still carry their drafts
        assert batcher.batched_rows > 2 * batcher.batched_steps
    assert batcher.generations == batcher.decoding == 0


def test_a_fixed_budget_is_split_between_the_generations_and_answers_stay_alone(smol_gguf, prompts):
    """`drafting.budget: N`: N + 1 rows a step, split equally between the generations stepping together."""
    model, tok = smol_gguf

    def generation(prompt, batcher=None):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter("suffix", model, tok), max_new_tokens=40,
                                   budget=11)
        "".join(d.text for d in gen.stream(prompt, batcher=batcher))
        return gen.tokens

    alone = [generation(p) for p in prompts]
    batcher = batcher_of(model)
    assert together([lambda p=p: generation(p, batcher) for p in prompts]) == alone
    assert batcher.batches > 0


def test_sampled_answers_keep_each_requests_own_stream(smol_gguf, prompts):
    """temperature > 0: each generation samples from its own seeded generator, the same numbers a token, so together
    (where its share of a step's rows cuts its trees) it draws the same tokens as alone."""
    model, tok = smol_gguf

    def generation(prompt, seed, batcher=None):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter("suffix", model, tok),
                                   sampling=SamplingSettings(temperature=0.9, top_p=0.95, seed=seed),
                                   max_new_tokens=32)
        "".join(d.text for d in gen.stream(prompt, batcher=batcher))
        return gen.tokens

    alone = [generation(p, s) for s, p in enumerate(prompts)]
    batcher = batcher_of(model)
    assert together([lambda p=p, s=s: generation(p, s, batcher) for s, p in enumerate(prompts)]) == alone
    assert batcher.batches > 0


def test_a_cancelled_generation_leaves_at_once_and_the_others_go_on(smol_gguf, prompts, monkeypatch):
    """The cancelled generation's place, rows and KV cache are gone once its stream closes; the other answers on."""
    import gc
    import weakref

    from ragspec.decoding import generate

    model, tok = smol_gguf
    batcher = batcher_of(model)
    cancel = threading.Event()
    ref = SpeculativeGenerator(model, tok, max_new_tokens=40)
    ref.generate(prompts[1])
    caches: list = []
    made = generate.make_backend

    def recording(*args, **kwargs):  # the real backend, its cache watched
        backend = made(*args, **kwargs)
        real = backend.prefill

        def prefill(*a, **k):
            ms = real(*a, **k)
            caches.append(weakref.ref(backend.cache))
            return ms

        backend.prefill = prefill
        return backend

    monkeypatch.setattr(generate, "make_backend", recording)

    def cancelled():
        gen = SpeculativeGenerator(model, tok, max_new_tokens=200, eos_token_ids=[])
        stream = gen.stream(prompts[0], batcher=batcher, cancel=cancel)
        for i, _ in enumerate(stream):
            if i == 3:
                cancel.set()
        return gen.tokens

    def other():
        gen = SpeculativeGenerator(model, tok, max_new_tokens=40)
        "".join(d.text for d in gen.stream(prompts[1], batcher=batcher))
        return gen.tokens

    first, second = together([cancelled, other])
    assert isinstance(first, Cancelled)
    assert second == ref.tokens
    assert batcher.generations == batcher.decoding == 0 and not batcher._steps
    del first  # its traceback holds the stopped frames (a server logs and drops it)
    gc.collect()
    assert len(caches) == 2 and all(c() is None for c in caches), "a generation's KV cache outlived it"


def test_a_long_prompt_read_mid_stream_does_not_stop_the_other_stream(smol_gguf, prompts):
    """A prompt of four chunks arriving while another answer streams is read a chunk per turn: the running
    stream gets a step between every two of its chunks (the gap between its tokens stays one chunk's time)."""
    model, tok = smol_gguf
    batcher = batcher_of(model)
    events: list[str] = []
    started = threading.Event()
    long_prompt = (prompts[2] * 30)[:1800]
    ref = SpeculativeGenerator(model, tok, max_new_tokens=8)
    ref.generate(long_prompt)

    def streaming():
        gen = SpeculativeGenerator(model, tok, max_new_tokens=400, eos_token_ids=[])
        for _ in gen.stream(prompts[0], batcher=batcher):
            events.append("token")
            started.set()
            if "done" in events:
                break
        return gen.tokens

    def long():
        started.wait(60)
        gen = SpeculativeGenerator(model, tok, max_new_tokens=8)
        "".join(d.text for d in gen.stream(long_prompt, batcher=batcher,
                                           on_progress=lambda done, total: events.append("chunk")))
        events.append("done")
        return gen.tokens

    _, got = together([streaming, long])
    assert got == ref.tokens
    chunks = [i for i, e in enumerate(events) if e == "chunk"]
    assert len(chunks) == 4, events
    for a, b in itertools.pairwise(chunks):
        assert "token" in events[a:b], events


def test_a_server_answers_distinct_questions_at_once_as_alone(tmp_path, embedder, smol_gguf):
    """examples/serve_load.py --sweep, cut down: a real server, its four distinct questions alone and then all at
    once; every answer the same, steps batched, and /healthz counts the generations while they run."""
    import importlib.util
    from pathlib import Path

    import httpx
    from serve_util import SPEC, build_test_index, make_pipeline

    from ragspec.serve.app import BackgroundServer, Server, create_app
    from ragspec.settings import ServeSettings

    path = Path(__file__).resolve().parent.parent / "examples" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load)
    pipe = make_pipeline(build_test_index(tmp_path, embedder), embedder, *smol_gguf,
                         {**SPEC, "drafting": {"method": "suffix", "budget": 16}})
    srv = BackgroundServer(create_app(Server(pipe, ServeSettings(queue_size=8), model_name="smol")))
    seen: list[int] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(httpx.get(srv.url + "/healthz").json()["generating"])
            stop.wait(0.05)

    watcher = threading.Thread(target=watch)
    try:
        watcher.start()
        report = load.run_sweep(srv.url, "smol", load.DEFAULT_QUESTIONS, [4], 24, pipe.forget)
        stop.set()
        watcher.join()
        for _ in range(100):  # the last stream has ended; its worker leaves its place a moment later
            if httpx.get(srv.url + "/healthz").json()["generating"] == 0:
                break
            time.sleep(0.05)
        after = httpx.get(srv.url + "/healthz").json()["generating"]
    finally:
        stop.set()
        srv.stop()
    (row,) = report["levels"]
    assert row["errors"] == 0 and row["identical"] == 4, row
    assert pipe.step_batcher.batches > 0
    assert max(seen) >= 2 and after == 0


def test_a_request_arriving_while_another_answers_reads_its_prompt_from_the_tree(smol_gguf, prompts):
    """A PromptTree keeps a prompt as soon as it is read: a second request sharing its passage, arriving while the
    first still answers, reads the shared prefix from the tree instead of reading it again; both answers are the
    ones alone."""
    from ragspec.decoding.prefix_cache import PromptTree, common_prefix

    model, tok = smol_gguf
    first, second = prompts[0], prompts[1]
    shared = common_prefix(first, second)
    assert shared > 50

    def generation(prompt, prefix=None, batcher=None, on_first=None, on_progress=None):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter("suffix", model, tok), max_new_tokens=40,
                                   eos_token_ids=[])
        for i, _ in enumerate(gen.stream(prompt, prefix=prefix, batcher=batcher, on_progress=on_progress)):
            if i == 0 and on_first is not None:
                on_first()
        return gen.tokens

    alone = [generation(first), generation(second)]
    tree, batcher = PromptTree(64), batcher_of(model)
    answering, answered, seen = threading.Event(), threading.Event(), {}

    def a():
        try:
            return generation(first, tree, batcher, on_first=answering.set)
        finally:
            answered.set()

    def b():
        assert answering.wait(120)
        got = generation(second, tree, batcher,
                         on_progress=lambda done, total: seen.setdefault("first still answering", not answered.is_set()))
        seen["reused"] = tree.reused_here
        return got

    assert together([a, b]) == alone
    assert seen == {"first still answering": True, "reused": shared}


def test_a_request_arriving_while_another_reads_a_shared_prefix_waits_for_it(smol_gguf, prompts):
    """A request whose prompt shares a prefix with one still being read waits for that one to be stored and
    reads only the rest (its own reading would wait for the earlier prompt's turns anyway); both answers are
    the ones alone, and a cancelled reader lets the waiting request go on."""
    from ragspec.decoding.prefix_cache import PromptTree, common_prefix

    model, tok = smol_gguf
    first, second = prompts[0], prompts[1]
    shared = common_prefix(first, second)
    entered = threading.Event()

    class Watched(PromptTree):  # the real tree, told when a request starts waiting
        def wait_for_readers(self, *args, **kwargs):
            entered.set()
            return super().wait_for_readers(*args, **kwargs)

    def generation(prompt, prefix=None, batcher=None, on_progress=None, cancel=None):
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter("suffix", model, tok), max_new_tokens=24,
                                   eos_token_ids=[])
        "".join(d.text for d in gen.stream(prompt, prefix=prefix, batcher=batcher, on_progress=on_progress,
                                           cancel=cancel))
        return gen.tokens

    alone = [generation(first), generation(second)]
    tree, batcher, seen, late = Watched(64), batcher_of(model), {}, []

    def b():
        got = generation(second, tree, batcher)
        seen["reused"] = tree.reused_here
        return got

    def progress(done, total):  # the first prompt is read, not yet stored: the second request arrives now
        if not late:
            late.append(threading.Thread(target=lambda: seen.setdefault("b", b())))
            late[0].start()
            assert entered.wait(60)

    assert generation(first, tree, batcher, on_progress=progress) == alone[0]
    late[0].join(120)
    assert seen == {"b": alone[1], "reused": shared}

    # the reader ahead is cancelled: the waiting request reads its whole prompt itself
    tree, cancel, entered, late = Watched(64), threading.Event(), threading.Event(), []
    seen.clear()

    def cancelling(done, total):
        progress(done, total)
        cancel.set()

    with pytest.raises(Cancelled):
        generation(first, tree, batcher, on_progress=cancelling, cancel=cancel)
    late[0].join(120)
    assert seen == {"b": alone[1], "reused": 0}
