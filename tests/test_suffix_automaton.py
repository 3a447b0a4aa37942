"""The suffix automaton against brute force on random token sequences, built at once and incrementally."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from ragspec.decoding.drafters.suffix_automaton import Matcher, SuffixAutomaton


def occurs_at(seq, pattern, end):
    n = len(pattern)
    return end - n + 1 >= 0 and seq[end - n + 1 : end + 1] == pattern


def brute_longest_repeat(seq):
    """Longest suffix of seq that also ends at an earlier position."""
    n = len(seq)
    best = 0
    for length in range(1, n):
        pat = seq[n - length :]
        if any(occurs_at(seq, pat, e) for e in range(n - 1)):
            best = length
    return best


def brute_ends(seq, pattern):
    return sorted((e for e in range(len(seq)) if occurs_at(seq, pattern, e)), reverse=True)


def brute_longest_prefix(seq, query):
    best = 0
    for length in range(1, len(query) + 1):
        pat = query[:length]
        if any(seq[i : i + length] == pat for i in range(len(seq) - length + 1)):
            best = length
        else:
            break
    return best


seqs = st.lists(st.integers(0, 3), min_size=0, max_size=60)


@settings(max_examples=150, deadline=None)
@given(seqs)
def test_longest_repeat_and_end_positions_match_brute_force(seq):
    sam = SuffixAutomaton()
    for i, tok in enumerate(seq):
        sam.append(tok)  # incrementally: every prefix is checked
        prefix = seq[: i + 1]
        v = sam.longest_repeat()
        assert sam.length[v] == brute_longest_repeat(prefix)
        if sam.length[v]:
            pat = prefix[len(prefix) - sam.length[v] :]
            assert sam.end_positions(v) == brute_ends(prefix, pat)
    assert len(sam.length) <= max(2 * len(seq), 2)


@settings(max_examples=150, deadline=None)
@given(seqs, st.lists(st.integers(0, 3), max_size=20))
def test_longest_prefix_and_its_position(seq, query):
    sam = SuffixAutomaton(seq)
    length, v = sam.longest_prefix(query)
    assert length == brute_longest_prefix(seq, query)
    if length:
        end = sam.firstpos[v]
        assert seq[end - length + 1 : end + 1] == query[:length]
        assert end == min(brute_ends(seq, query[:length]))  # the first occurrence


@settings(max_examples=100, deadline=None)
@given(seqs, st.lists(st.integers(0, 4), max_size=40))
def test_matcher_tracks_longest_common_suffix(seq, text):
    sam = SuffixAutomaton(seq)
    m = Matcher(sam)
    for i, tok in enumerate(text):
        m.feed([tok])
        fed = text[: i + 1]
        best = 0
        for length in range(1, len(fed) + 1):
            pat = fed[len(fed) - length :]
            if any(seq[j : j + length] == pat for j in range(len(seq) - length + 1)):
                best = length
        assert m.length == best
        if best:
            assert all(occurs_at(seq, fed[len(fed) - best :], e) for e in sam.end_positions(m.state))


def test_incremental_equals_at_once_and_limit_keeps_latest():
    rng = random.Random(3)
    seq = [rng.randrange(5) for _ in range(400)]
    once = SuffixAutomaton(seq)
    grown = SuffixAutomaton(seq[:100])
    for k in range(100, 400, 37):
        grown.extend(seq[k : k + 37])
    assert grown.length == once.length and grown.link == once.link and grown.next == once.next
    v = once.longest_repeat()
    all_ends = once.end_positions(v)
    some = once.end_positions(v, limit=3)
    assert len(some) == min(3, len(all_ends)) and set(some) <= set(all_ends)
