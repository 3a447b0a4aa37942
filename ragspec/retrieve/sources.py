"""From ranked chunks to distinct sources: every prompt token should carry something new.

Walking the candidates best first:
- copies (chunks with the same normalised-text hash, found through the store's hash index) are one source that
  keeps every location;
- a chunk of a document that overlaps or touches (only whitespace between) a chosen source's span in that
  document extends that span,
  re-read from the document text (offsets stay exact: `document_text[start:end] == text`);
- a chunk whose word 5-grams are mostly (≥ `containment`) in a chosen source adds its location to it (also when
  the source grows over it later);
- anything else takes a new place, until `top_n` places are filled.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

WORD = re.compile(r"\w+")
SHINGLE = 5


@dataclass
class Location:
    """One place a source's text (or most of it) is found: a span of one document."""

    document_id: int
    path: str  # the document's path relative to the corpus root
    key: str
    title: str
    start: int
    end: int
    text: str  # document_text[start:end]
    chunk_ids: list[int] = field(default_factory=list)
    kind: str = "primary"  # primary | copy (same normalised text) | contained (mostly inside the primary)


@dataclass
class Group:
    score: float
    locations: list[Location]
    shingles: set = field(default_factory=set)

    @property
    def primary(self) -> Location:
        return self.locations[0]


def shingles(text: str, n: int = SHINGLE) -> set:
    w = [m.group().lower() for m in WORD.finditer(text)]
    if len(w) < n:
        return {tuple(w)} if w else set()
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def containment(part: set, whole: set) -> float:
    """The share of `part`'s shingles found in `whole`."""
    return len(part & whole) / len(part) if part else 0.0


def group_candidates(ranked: list[tuple[int, float]], store, top_n: int, document_text: Callable[[int], str],
                     merge: bool = True, min_containment: float | None = 0.8) -> list[Group]:
    """Distinct sources, best first, from candidates (chunk id, score) ranked best first."""
    texts: dict[int, str] = {}
    fetch = document_text

    def document_text(d: int) -> str:  # each document read once per call
        return texts[d] if d in texts else texts.setdefault(d, fetch(d))

    ids = [c for c, _ in ranked]
    rows = {r.id: r for r in store.chunks(ids)}
    copies = store.copies(r.hash for r in rows.values())
    extra = {c for cs in copies.values() for c in cs} - set(rows)
    rows.update({r.id: r for r in store.chunks(sorted(extra))})
    seen: set[int] = set()
    groups: list[Group] = []
    for cid, score in ranked:
        if len(groups) >= top_n:
            break
        if cid in seen or cid not in rows:
            continue
        row = rows[cid]
        same = [cid] + [c for c in copies.get(row.hash, [cid]) if c != cid and c in rows]
        seen.update(same)
        locs = [_location(rows[c], "primary" if c == cid else "copy") for c in same]
        target = _neighbour(groups, row, document_text) if merge else None
        if target is not None:
            _extend(target, row, document_text)
            _absorb_neighbours(groups, target, document_text)
            target.locations.extend(loc for loc in locs[1:] if not _holds(target, loc))
            if min_containment is not None:
                _absorb_contained(groups, target, min_containment)
            continue
        sh = shingles(row.text)
        if min_containment is not None:
            home = next((g for g in groups if containment(sh, g.shingles) >= min_containment), None)
            if home is not None:
                for loc in locs:
                    loc.kind = "copy" if loc.kind == "copy" else "contained"
                    if not _holds(home, loc):
                        home.locations.append(loc)
                continue
        groups.append(Group(score, locs, sh))
    return groups


def _location(row, kind: str) -> Location:
    return Location(row.document, row.path, row.key, row.title, row.start, row.end, row.text, [row.id], kind)


def touching(text: str, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Spans [a0, a1) and [b0, b1) of one document overlap, or only whitespace lies between them."""
    (_, a1), (b0, _) = sorted([a, b])
    return b0 <= a1 or not text[a1:b0].strip()


def _neighbour(groups: list[Group], row, document_text: Callable[[int], str]) -> Group | None:
    """The chosen source whose primary span in this chunk's document overlaps or touches the chunk."""
    for g in groups:
        p = g.primary
        if p.document_id == row.document and touching(document_text(row.document), (p.start, p.end),
                                                      (row.start, row.end)):
            return g
    return None


def _extend(g: Group, row, document_text: Callable[[int], str]) -> None:
    p = g.primary
    p.start, p.end = min(p.start, row.start), max(p.end, row.end)
    p.text = document_text(p.document_id)[p.start:p.end]
    p.chunk_ids = sorted(set(p.chunk_ids) | {row.id})
    g.shingles = shingles(p.text)


def _absorb_neighbours(groups: list[Group], g: Group, document_text: Callable[[int], str]) -> None:
    """After `g` grew, fold in any other chosen source it now overlaps or touches in the same document."""
    p = g.primary
    for other in [o for o in groups if o is not g]:
        q = other.primary
        if q.document_id == p.document_id and touching(document_text(p.document_id), (p.start, p.end),
                                                       (q.start, q.end)):
            p.start, p.end = min(p.start, q.start), max(p.end, q.end)
            p.chunk_ids = sorted(set(p.chunk_ids) | set(q.chunk_ids))
            p.text = document_text(p.document_id)[p.start:p.end]
            g.locations.extend(loc for loc in other.locations[1:] if not _holds(g, loc))
            g.score = max(g.score, other.score)
            groups.remove(other)
    g.shingles = shingles(p.text)


def _absorb_contained(groups: list[Group], g: Group, min_containment: float) -> None:
    """After `g` grew, a source now mostly inside it becomes one of its locations, freeing a place."""
    for other in [o for o in groups if o is not g]:
        if containment(other.shingles, g.shingles) >= min_containment:
            for loc in other.locations:
                loc.kind = "copy" if loc.kind == "copy" else "contained"
                if not _holds(g, loc):
                    g.locations.append(loc)
            groups.remove(other)


def _holds(g: Group, loc: Location) -> bool:
    return any(held.document_id == loc.document_id and held.start <= loc.start and loc.end <= held.end
               for held in g.locations)
