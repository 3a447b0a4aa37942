"""Open a built index: manifest, SQLite store, FAISS index and BM25, each file checked against the manifest
before it is read (`integrity`)."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from ragspec.errors import RagspecError
from ragspec.index.faiss_index import gpu_available
from ragspec.index.faiss_index import read as read_faiss
from ragspec.index.integrity import check as check_integrity
from ragspec.index.manifest import load as load_manifest
from ragspec.index.store import Store

log = logging.getLogger(__name__)


class Index:
    """A read-only view of one index version (the one `path` pointed at when opened)."""

    def __init__(self, path: Path | str, verify: bool = False, device: str = "cpu"):
        self.path = Path(path)
        self.device = device
        if not (self.path.exists() or self.path.is_symlink()):
            raise RagspecError(f"no index at {self.path}; build one with `ragspec index CORPUS`")
        self.folder = self.path.resolve()
        self.manifest = load_manifest(self.folder, str(self.path))
        # every file is checked before any is read: size always, sha256 once per process per file version
        check_integrity(self.folder, self.manifest["files"], str(self.path), rehash=verify)
        self.store = Store(self.folder / "store.sqlite")
        self._faiss = None
        self._bm25 = None
        self._embeddings = None
        self._windows = False  # index.windows.StoredWindows, None when this version has none; read on first use
        self._fields = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def corpus_root(self) -> str:
        """The corpus folder as it was given to `ragspec index` (relative paths stay relative)."""
        return self.manifest["corpus"]["root"]

    def source_path(self, rel: str) -> str:
        """The source file of a document, as given to `ragspec index` (root as given + relative path)."""
        return os.path.join(self.corpus_root, rel) if self.corpus_root not in ("", ".") else rel

    @property
    def faiss(self):
        with self._lock:
            if self._faiss is None and self.device == "cuda" and not gpu_available():
                from ragspec.index.torch_search import TorchExactIndex

                log.info("index %s: exact search in torch on cuda (this faiss has no GPU support)", self.name)
                self._faiss = TorchExactIndex(self._vectors(), "cuda")
            if self._faiss is None:
                self._faiss = read_faiss(
                    self.folder / "faiss.index", self.manifest["faiss"], use_gpu=self.device == "cuda"
                )
            return self._faiss

    @property
    def bm25(self):
        if not self.manifest.get("bm25", {}).get("enabled"):
            return None
        with self._lock:
            if self._bm25 is None:
                from ragspec.index.bm25 import BM25Index

                self._bm25 = BM25Index(self.folder / "bm25")
            return self._bm25

    @property
    def embeddings(self):
        """The stored chunk vectors (float16, memory-mapped; row = chunk id): MMR compares candidates with them."""
        with self._lock:
            if self._embeddings is None:
                import numpy as np

                self._embeddings = np.load(self.folder / "embeddings.npy", mmap_mode="r", allow_pickle=False)
            return self._embeddings

    @property
    def windows(self):
        """The gate's window vectors stored with this version (`index.windows.StoredWindows`), or None for an
        index built before them (the gate then embeds windows at ask time)."""
        with self._lock:
            if self._windows is False:
                from ragspec.index.windows import StoredWindows, stored

                self._windows = StoredWindows(self.folder) if stored(self.manifest) else None
            return self._windows

    def allowed_chunks(self, flt: dict):
        """Chunk ids (sorted int64) of the documents a filter keeps; an unknown field is one error line."""
        import numpy as np

        from ragspec.index.filters import compile_filter

        with self._lock:
            if self._fields is None:
                docs = self.store.metadata()
                known = set().union(*(d for _, d in docs)) if docs else set()
                self._fields = (docs, known, np.asarray(self.store.chunk_documents(), dtype=np.int64))
        docs, known, chunk_doc = self._fields
        keep = compile_filter(flt, known)
        ids = np.asarray([did for did, fields in docs if keep(fields)], dtype=np.int64)
        return np.flatnonzero(np.isin(chunk_doc, ids)).astype(np.int64)

    def _vectors(self):
        """Every chunk's vector as stored (float16 rows, row = chunk id), read under the caller's lock."""
        import numpy as np

        return np.load(self.folder / "embeddings.npy", allow_pickle=False)

    def set_nprobe(self, nprobe: int) -> None:
        import faiss

        if getattr(self.faiss, "kind", None) == "torch-exact":
            return  # exact search probes everything

        ivf = faiss.try_extract_index_ivf(self.faiss)
        if ivf is not None:
            ivf.nprobe = nprobe

    def close(self) -> None:
        self.store.close()
