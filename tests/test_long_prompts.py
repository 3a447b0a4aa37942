"""Long prompts: prefill in chunks with progress, greedy output still identical to plain greedy (which prefills
in the same chunks), and a cancel — set directly, by a closed async stream, or by an over-long prompt's limit —
stops the work between chunks and leaves the model free."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from conftest import PARAGRAPHS

from ragspec.decoding.backends.base import PREFILL_CHUNK, chunks
from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.errors import Cancelled, RagspecError
from ragspec.pipeline import DoneEvent, Pipeline, SourcesEvent

SPEC = {
    "name": "long",
    "generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 24},
    "drafting": {"method": "suffix", "budget": 16},
}


@pytest.fixture(scope="module")
def smol():
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct")


def long_text(paragraphs: int = 12) -> str:
    texts = list(PARAGRAPHS.values())
    return "\n\n".join(f"Note {i}. {texts[i % len(texts)]}" for i in range(paragraphs))


def long_prompt(tok, n_min: int = 3 * PREFILL_CHUNK) -> list[int]:
    text, k = long_text(), 12
    while True:
        ids = tok.apply_chat_template([{"role": "user", "content": text + "\n\nSummarise the notes."}],
                                      add_generation_prompt=True, tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        if len(ids) >= n_min:
            return ids
        k *= 2
        text = long_text(k)


def test_chunks_cut_at_multiples_of_the_chunk_size():
    assert chunks(0, 1300, 512) == [(0, 512), (512, 1024), (1024, 1300)]
    assert chunks(700, 1100, 512) == [(700, 1024), (1024, 1100)]
    assert chunks(5, 5, 512) == [] and chunks(0, 512, 512) == [(0, 512)]
    # where rows are independent a short first or last piece is read with its neighbour (one forward, not two)
    assert chunks(0, 538, 512, min_tail=128) == [(0, 538)]
    assert chunks(700, 1100, 512, min_tail=128) == [(700, 1100)]
    assert chunks(0, 1300, 512, min_tail=128) == [(0, 512), (512, 1024), (1024, 1300)]
    assert chunks(600, 700, 512, min_tail=128) == [(600, 700)]
    assert chunks(500, 1300, 512, min_tail=128) == [(500, 1024), (1024, 1300)]  # a short first piece too


def test_chunked_prefill_reports_progress_and_stays_identical_to_greedy(smol):
    model, tok = smol
    prompt = long_prompt(tok)
    eos = [tok.eos_token_id]
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, eos_token_id=eos,
                             pad_token_id=eos[0], prefill_chunk_size=PREFILL_CHUNK)[0, len(prompt):].tolist()
    for method in ("none", "suffix"):
        seen = []
        gen = SpeculativeGenerator(model, tok, make_drafter(method, model, tok), max_new_tokens=24, budget=16)
        out = [t for d in gen.stream(prompt, on_progress=lambda done, total, seen=seen: seen.append((done, total)))
               for t in d.tokens]
        assert out == ref[: len(out)] and len(out) == len(ref), method
        total = len(prompt)  # the root too: the first token comes from the prefill's last row, as in `generate`
        assert seen == [(b, total) for _, b in chunks(0, total)], method


def test_a_cancel_stops_the_prefill_between_chunks(smol):
    model, tok = smol
    prompt = long_prompt(tok)
    cancel = threading.Event()
    seen = []

    def on_progress(done, total):
        seen.append(done)
        cancel.set()  # as a closed connection would, mid-prefill

    gen = SpeculativeGenerator(model, tok, make_drafter("suffix", model, tok), max_new_tokens=24, budget=16)
    with pytest.raises(Cancelled):
        list(gen.stream(prompt, cancel=cancel, on_progress=on_progress))
    assert seen == [PREFILL_CHUNK], "one chunk ran, then the cancel was honoured"
    assert gen.stats.new_tokens == 0


def test_closing_an_async_stream_stops_the_generation_and_frees_the_model(smol):
    model, tok = smol
    pipe = Pipeline(SPEC, model=model, tokenizer=tok)
    doc = long_text(24)
    seen = []
    first_chunk = threading.Event()
    release = threading.Event()

    def on_progress(done, total):
        seen.append(done)
        first_chunk.set()
        release.wait(30)  # hold the prefill here until the consumer has gone

    async def go():
        stream = pipe.astream("Summarise the notes.", documents=[doc], on_progress=on_progress)
        async for ev in stream:
            assert isinstance(ev, SourcesEvent)
            break  # the reader leaves after the sources, while the prompt is being read
        closing = asyncio.ensure_future(stream.aclose())
        await asyncio.to_thread(first_chunk.wait, 30)
        release.set()
        await closing

    asyncio.run(go())
    total = len(seen)
    assert total <= 2, f"the prefill should stop at the next chunk, ran {seen}"
    assert pipe._gen_lock.acquire(blocking=False), "the model lock must be free once the stream is closed"
    pipe._gen_lock.release()
    answer = pipe.ask("Summarise the notes.", documents=[doc], max_new_tokens=4)  # the pipeline still works
    assert answer.stats.new_tokens >= 1


def test_a_prompt_over_the_budget_is_one_error_before_any_prefill(smol):
    model, tok = smol
    pipe = Pipeline({**SPEC, "prompt": {"max_context_tokens": 200}}, model=model, tokenizer=tok)
    seen = []
    with pytest.raises(RagspecError, match="more than the prompt budget of 200"):
        list(pipe.stream("why " * 300, documents=["short"], on_progress=lambda d, t: seen.append(d)))
    assert seen == []
    events = list(pipe.stream("Summarise the notes.", documents=[long_text(24)], max_new_tokens=4))
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.answer.stats.prompt_tokens <= 200
    assert done.answer.warnings, "the sources that did not fit are dropped with a warning"
