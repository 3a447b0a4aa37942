"""BM25 over the same chunks as the dense index (bm25s: sparse matrices saved as .npy/.json, no pickle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

STOPWORDS = "en"
STEMMER = "english"


def _stemmer():
    try:
        import Stemmer

        return Stemmer.Stemmer(STEMMER)
    except ImportError:  # PyStemmer is a dependency, but BM25 still works without stemming
        return None


def tokenize(texts: list[str]):
    import bm25s

    return bm25s.tokenize(texts, stopwords=STOPWORDS, stemmer=_stemmer(), show_progress=False, return_ids=False)


def build(texts: list[str], folder: Path) -> None:
    import bm25s

    model = bm25s.BM25()
    model.index(tokenize(texts), show_progress=False)
    model.save(str(folder))


class BM25Index:
    """Loaded BM25 index; `search` returns (chunk ids, scores), zero-score hits dropped."""

    def __init__(self, folder: Path):
        import bm25s

        self.folder = Path(folder)
        self._model = bm25s.BM25.load(str(folder))
        self._n = int(self._model.scores["num_docs"])

    def search(self, query: str, k: int, allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`allowed`: chunk ids a filter lets through; the others score 0 inside bm25s (a mask, not a
        post-filter, so a selective filter still gets its top k)."""
        tokens = tokenize([query])
        if not tokens[0] or self._n == 0 or (allowed is not None and len(allowed) == 0):
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
        mask = None
        if allowed is not None:
            mask = np.zeros(self._n, dtype=np.float32)
            mask[allowed] = 1.0
        ids, scores = self._model.retrieve(tokens, k=min(k, self._n), show_progress=False, weight_mask=mask)
        ids, scores = ids[0], scores[0]
        keep = scores > 0
        return ids[keep].astype(np.int64), scores[keep].astype(np.float32)
