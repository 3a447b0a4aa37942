"""Chunk offsets are exact, chunks respect the token budget, and cuts prefer natural boundaries."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ragspec.corpus.chunker import ChunkerSettings, chunk_text, token_offsets


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ragspec.models.registry import lookup, part_paths

    return AutoTokenizer.from_pretrained(str(part_paths(lookup("all-minilm-l6-v2"))[0]))


WORDS = st.sampled_from(
    ["the", "cat", "é", "naïve", "日本語", "data-set", "x=1;", "(a)", "\u00a0", "emoji🙂", "Straße", "--", "..."]
)
SEPARATORS = st.sampled_from([" ", "  ", "\n", "\n\n", ". ", "! ", "\t", "\r\n", ""])
TEXTS = st.lists(st.tuples(WORDS, SEPARATORS), min_size=0, max_size=400).map(lambda xs: "".join(a + b for a, b in xs))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXTS, size=st.integers(8, 64), overlap_frac=st.floats(0, 0.45))
def test_offsets_slice_the_document_exactly(tokenizer, text, size, overlap_frac):
    cfg = ChunkerSettings(size, int(size * overlap_frac) if int(size * overlap_frac) < size // 2 else 0)
    chunks = chunk_text(text, tokenizer, cfg)
    for c in chunks:
        assert text[c.start : c.end] == c.text
        assert c.tokens <= size
        assert c.text == c.text.strip()
    # every token of the document lies inside some chunk
    covered = set()
    for c in chunks:
        covered.update(range(c.start, c.end))
    for s, e in token_offsets(tokenizer, text):
        assert all(i in covered for i in range(s, e) if not text[i].isspace())
    assert [c.order for c in chunks] == list(range(len(chunks)))
    starts = [c.start for c in chunks]
    assert starts == sorted(starts)


def test_prefers_paragraph_boundaries(tokenizer):
    para = "This sentence has some words in it and keeps going for a while. " * 3
    text = "\n\n".join(para.strip() for _ in range(6))
    chunks = chunk_text(text, tokenizer, ChunkerSettings(64, 0))
    assert len(chunks) > 1
    for c in chunks[:-1]:
        after = text[c.end : c.end + 2]
        assert after == "\n\n" or text[c.end - 1] == "."  # ends at a paragraph or at least a sentence


def test_overlap_repeats_text(tokenizer):
    text = " ".join(f"word{i}." for i in range(400))
    chunks = chunk_text(text, tokenizer, ChunkerSettings(40, 10))
    for a, b in itertools.pairwise(chunks):
        assert b.start < a.end  # consecutive windows overlap
        assert b.start > a.start


def test_empty_and_whitespace(tokenizer):
    assert chunk_text("", tokenizer) == []
    assert chunk_text(" \n\n \t", tokenizer) == []


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError):
        ChunkerSettings(4, 0)
    with pytest.raises(ValueError):
        ChunkerSettings(64, 40)
