"""Distinct sources: copies collapse into one source with every location, neighbouring chunks of one document
merge into one exact span, MMR equals a brute-force MMR, and citations name every copy verbatim."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import write_corpus

from ragspec.index.builder import build_index
from ragspec.index.reader import Index
from ragspec.index.store import text_hash
from ragspec.pipeline import Pipeline
from ragspec.pipeline.attribution import CopyMatcher
from ragspec.pipeline.prompt import SourceText
from ragspec.retrieve.mmr import mmr
from ragspec.retrieve.retriever import Retriever
from ragspec.retrieve.sources import group_candidates, touching
from ragspec.settings import IndexSettings, RetrieverSettings

SHARED = ("The global statement is a declaration which holds for the entire current code block. It means that "
          "the listed identifiers are to be interpreted as globals.")
# the same paragraph, wrapped differently: the copy is found by its normalised text, sliced verbatim
SHARED_WRAPPED = SHARED.replace(" entire current", "\nentire current").replace(" It means", "\n  It means")
FILES = {
    "naming.txt": "Naming and binding\n\nNames refer to objects. Names are introduced by name binding operations "
                  "such as assignment, function definitions, class definitions, imports and the targets of for "
                  "loops, with statements and except clauses, each one binding a name in a block.\n\n" + SHARED,
    "execmodel.txt": "Execution model\n\nA Python program is constructed from code blocks, such as a module, a "
                     "function body or a class definition; each command typed interactively is a block, and so is "
                     "a script file or a string passed to the built-in functions eval and exec.\n\n"
                     + SHARED_WRAPPED,
    # the paragraph quoted inside a sentence: a near-duplicate (most of its word 5-grams are in the source)
    "quote.txt": "As it says, " + SHARED,
    "bread.txt": "Knead the dough for ten minutes until it is smooth and elastic. Let it rise for an hour. "
                 "Bake at 230 degrees for thirty minutes, until the crust sounds hollow when tapped.",
}
# no overlap: the shared paragraph is one whole chunk in each file
SETTINGS = IndexSettings(chunk_tokens=64, overlap=0)


def read(path: str) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


@pytest.fixture(scope="module")
def dup_index(tmp_path_factory, embedder):
    root = write_corpus(tmp_path_factory.mktemp("dups") / "corpus", FILES)
    target = root.parent / "idx"
    build_index(root, target, SETTINGS, embedder=embedder, show_progress=False)
    return Index(target)


def test_copies_are_one_source_with_every_location(dup_index, embedder):
    copies = [r for r in dup_index.store.chunks(range(dup_index.store.count_chunks()))
              if r.hash == text_hash(SHARED)]
    assert len(copies) == 2, [r.text for r in dup_index.store.chunks(range(10))]
    vecs = dup_index.embeddings
    assert np.array_equal(vecs[copies[0].id], vecs[copies[1].id])  # embedded once
    hits = Retriever(dup_index, RetrieverSettings(top_n=3, containment=None, merge=False), embedder=embedder).search(
        "What does the global statement do?")
    top = next(h for h in hits if text_hash(h.text) == text_hash(SHARED))
    assert len(top.locations) == 2 and top.locations[1].kind == "copy"
    assert {loc.path.rsplit("/", 1)[-1] for loc in top.locations} == {"naming.txt", "execmodel.txt"}
    for loc in top.locations:
        assert read(loc.path)[loc.start:loc.end] == loc.text
    assert sum(1 for h in hits if text_hash(h.text) == text_hash(SHARED)) == 1  # never two sources


def test_a_citation_names_both_copies_verbatim(dup_index, embedder):
    pipe = Pipeline(None, Retriever(dup_index, RetrieverSettings(top_n=3), embedder=embedder))
    sources, _ = pipe.retrieve("What does the global statement do?")
    m = CopyMatcher(sources, 3, 10)
    m.feed("The global statement is a declaration which holds for the entire current code block. It means that "
           "the listed identifiers are to be interpreted as globals.")
    cites = m.finish()
    assert len(cites) == 1
    c = cites[0]
    assert (c.locations[0]["path"], c.locations[0]["start"], c.locations[0]["end"]) == (c.path, c.start, c.end)
    names = [loc["path"].rsplit("/", 1)[-1] for loc in c.locations]
    assert {"naming.txt", "execmodel.txt"} <= set(names) and len(names) == len(set(names))
    for loc in c.locations:  # each slice verbatim, with the whitespace its own file has
        assert read(loc["path"])[loc["start"]:loc["end"]] == loc["quote"]
        assert " ".join(loc["quote"].split()) == SHARED
    assert "\n" in c.locations[names.index("execmodel.txt")]["quote"]


def test_a_chunk_mostly_inside_a_source_adds_its_location(dup_index):
    rows = dup_index.store.chunks(range(dup_index.store.count_chunks()))
    shared = [r.id for r in rows if r.hash == text_hash(SHARED)]
    quoted = next(r for r in rows if r.path == "quote.txt" and "listed identifiers" in r.text)
    bread = next(r.id for r in rows if r.path == "bread.txt")
    ranked = [(shared[0], 0.9), (quoted.id, 0.8), (bread, 0.7)]
    groups = group_candidates(ranked, dup_index.store, 2, dup_index.store.document_text)
    assert len(groups) == 2 and groups[1].primary.chunk_ids == [bread]
    assert [loc.kind for loc in groups[0].locations] == ["primary", "copy", "contained"]
    p = groups[0].primary
    m = CopyMatcher([SourceText(1, p.text, p.path, p.start, p.end, document_id=p.document_id,
                                locations=groups[0].locations)], 3, 10)
    m.feed("the listed identifiers are to be interpreted as globals")
    c = m.finish()[0]
    assert len(c.locations) == 3
    alone = group_candidates(ranked, dup_index.store, 3, dup_index.store.document_text, min_containment=None)
    assert len(alone) == 3


@pytest.fixture(scope="module")
def long_index(tmp_path_factory, embedder):
    """touch.txt: paragraphs, cut at their breaks (chunks touch across blank lines); flow.txt: words without
    punctuation, cut mid-stream with an 8-token overlap."""
    paras = [f"Paragraph {i} is about topic number {i}: the quick brown fox jumps over the lazy dog {i} times, "
             f"then rests under tree {i} near the river before it runs home again." for i in range(12)]
    flow = " ".join(f"fox{i} jumps over dog{i} and rests under tree{i} by the river" for i in range(30))
    root = write_corpus(tmp_path_factory.mktemp("long") / "corpus", {
        "touch.txt": "\n\n".join(paras), "flow.txt": flow, "other.txt": FILES["bread.txt"]})
    build_index(root, root.parent / "idx", IndexSettings(chunk_tokens=48, overlap=8), embedder=embedder,
                show_progress=False)
    return Index(root.parent / "idx")


@pytest.mark.parametrize("name", ["flow.txt", "touch.txt"])
def test_neighbouring_chunks_merge_into_one_exact_span(long_index, name):
    idx = long_index
    docs = {d.path: d.id for d in idx.store.documents()}
    chunks = idx.store.chunks_of(docs[name])
    assert len(chunks) >= 4
    (c0, _, s0, e0, _), (c1, _, s1, e1, _), (c2, *_), (c3, _, _, e3, _) = chunks[:4]
    doc = idx.store.document_text(docs[name])
    assert (s1 < e0) if name == "flow.txt" else (s1 > e0 and touching(doc, (s0, e0), (s1, e1)))
    other = idx.store.chunks_of(docs["other.txt"])[0][0]
    ranked = [(c1, 0.9), (other, 0.8), (c0, 0.7), (c3, 0.6), (c2, 0.5)]
    groups = group_candidates(ranked, idx.store, 5, idx.store.document_text, min_containment=None)
    # c0 and c1 merge; c3 stands apart until c2 arrives and joins everything into one span
    assert len(groups) == 2
    g = groups[0]
    assert g.primary.chunk_ids == sorted([c0, c1, c2, c3])
    assert (g.primary.start, g.primary.end) == (s0, e3)
    assert doc[g.primary.start:g.primary.end] == g.primary.text
    off = group_candidates(ranked, idx.store, 5, idx.store.document_text, merge=False, min_containment=None)
    assert len(off) == 5


def test_search_never_returns_touching_sources_of_one_document(long_index, embedder):
    idx = long_index
    hits = Retriever(idx, RetrieverSettings(top_n=6), embedder=embedder).search("the fox rests under the tree")
    assert 2 <= len(hits) <= 6
    assert any(len(h.chunk_ids) > 1 for h in hits)
    for h in hits:
        assert read(h.path)[h.start:h.end] == h.text
    for a in hits:
        for b in hits:
            if a is not b and a.document_id == b.document_id:
                assert not touching(idx.store.document_text(a.document_id), (a.start, a.end), (b.start, b.end))


def brute_mmr(q, v, diversity, k):
    lam = 1 - diversity
    chosen, rest = [], list(range(len(v)))
    while rest and len(chosen) < k:
        def score(i):
            if not chosen:
                return float(q @ v[i])
            return lam * float(q @ v[i]) - (1 - lam) * max(float(v[i] @ v[j]) for j in chosen)
        best = max(rest, key=lambda i: (score(i), -i))
        chosen.append(best)
        rest.remove(best)
    return chosen


def test_mmr_equals_brute_force():
    rng = np.random.default_rng(3)
    base = rng.normal(size=(4, 8))
    v = np.concatenate([base + 0.05 * rng.normal(size=(4, 8)) for _ in range(3)])  # 3 near-copies of 4 points
    v = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(np.float32)
    q = (base[0] / np.linalg.norm(base[0])).astype(np.float32)
    for d in (0.0, 0.3, 0.5, 0.7, 1.0):
        assert mmr(q, v, d, 6) == brute_mmr(q, v, d, 6), d
    assert mmr(q, v, 0.0) == list(np.argsort(-(v @ q), kind="stable"))
    assert len({i % 4 for i in mmr(q, v, 0.0, 3)}) == 1  # relevance alone: three copies of one point
    assert len({i % 4 for i in mmr(q, v, 0.8, 3)}) == 3  # diversity: three different points


def test_diversity_reorders_candidates(long_index, embedder):
    idx = long_index
    plain = Retriever(idx, RetrieverSettings(top_n=3, merge=False, containment=None), embedder=embedder)
    diverse = Retriever(idx, RetrieverSettings(top_n=3, merge=False, containment=None, diversity=1.0),
                        embedder=embedder)
    a = plain.search("knead the dough")
    b = diverse.search("knead the dough")
    assert a[0].chunk_id == b[0].chunk_id  # the most relevant first either way
    assert len(b) == 3


class FakeStore:
    """Just what `group_candidates` reads: chunk rows and copies by hash."""

    def __init__(self, docs: dict[int, tuple[str, list[tuple[int, int]]]]):
        from ragspec.index.store import ChunkRow

        self.docs = {d: text for d, (text, _) in docs.items()}
        self.rows = {}
        for d, (text, spans) in docs.items():
            for o, (a, b) in enumerate(spans):
                cid = len(self.rows)
                self.rows[cid] = ChunkRow(cid, d, o, a, b, text[a:b], f"doc{d}.txt", "", "", text_hash(text[a:b]))

    def chunks(self, ids):
        return [self.rows[i] for i in ids if i in self.rows]

    def copies(self, hashes):
        hashes = set(hashes)
        return {h: sorted(r.id for r in self.rows.values() if r.hash == h) for h in hashes}


def test_a_source_that_grows_over_another_takes_it_in():
    p1 = "Names are bound by assignment, imports, function and class definitions in a block of code."
    p2 = "A global statement makes the listed names refer to the module namespace for the whole block."
    a = p1 + "\n\n" + p2
    b = "Also: " + p2
    store = FakeStore({1: (a, [(0, len(p1)), (len(p1) + 2, len(a))]), 2: (b, [(0, len(b))])})
    ranked = [(0, 0.9), (2, 0.8), (1, 0.7)]  # a's first paragraph, b, then a's second paragraph
    groups = group_candidates(ranked, store, 3, store.docs.__getitem__)
    assert len(groups) == 1
    g = groups[0]
    assert (g.primary.start, g.primary.end, g.primary.text) == (0, len(a), a)
    assert [(loc.document_id, loc.kind) for loc in g.locations] == [(1, "primary"), (2, "contained")]
