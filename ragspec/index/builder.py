"""`ragspec index`: corpus folder → index version on disk, incrementally and atomically."""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ragspec import activity
from ragspec.console import console, progress, warn
from ragspec.corpus.chunker import Chunk, ChunkerSettings, chunk_text
from ragspec.corpus.loader import Document, ScanReport, SourceFile, read_file, walk
from ragspec.errors import RagspecError
from ragspec.index import faiss_index, layout, manifest, windows
from ragspec.index.integrity import IndexDamaged
from ragspec.index.reader import Index
from ragspec.index.store import StoreWriter, text_hash
from ragspec.settings import IndexSettings

STORE = "store.sqlite"
FAISS = "faiss.index"
EMBEDDINGS = "embeddings.npy"
BM25_DIR = "bm25"


@dataclass
class BuildSummary:
    path: Path
    documents: int = 0
    files: int = 0
    skipped: int = 0
    chunks: int = 0
    embedded: int = 0
    reused: int = 0
    added: int = 0
    changed: int = 0
    deleted: int = 0
    seconds: float = 0.0
    embed_seconds: float = 0.0
    windows_embedded: int = 0  # the gate's window vectors pooled (with the chunks' forward, or for kept chunks
    #                            of a version without them), and those reused
    windows_reused: int = 0
    windows_seconds: float = 0.0
    factory: str = ""
    index_type: str = ""
    bytes: int = 0
    up_to_date: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def chunks_per_s(self) -> float:
        return self.embedded / self.embed_seconds if self.embed_seconds > 0 else 0.0


def default_name(corpus: Path) -> str:
    p = Path(corpus).resolve()
    return p.stem if p.is_file() else p.name


@dataclass
class _Reuse:
    """What a previous version holds for one source file."""

    rows: list  # DocumentRow
    sha256: str
    size: int
    mtime: float


def build_index(
    corpus: Path | str,
    target: Path | str,
    settings: IndexSettings | None = None,
    embedder=None,
    show_progress: bool = True,
    reuse_from: Path | str | None = None,
    executor=None,
) -> BuildSummary:
    """Build or update the index at `target` (a link to its current version) from `corpus`.

    Unchanged files (same size and mtime, or same sha256) keep their chunks and vectors; only added and
    changed files are embedded; deleted files are dropped. With nothing changed, nothing is written.
    `reuse_from` seeds a new target from another index of the same corpus (e.g. an IVF-PQ twin of an exact
    index) so its vectors are not computed twice.
    """
    with activity.busy("an index build"):  # a calibration job stops while it runs
        return _build(corpus, target, settings or IndexSettings(), embedder, show_progress, reuse_from, executor)


def _build(corpus, target, settings: IndexSettings, embedder, show_progress, reuse_from, executor) -> BuildSummary:
    t0 = time.perf_counter()
    corpus_given = str(corpus)
    corpus = Path(corpus)
    target = Path(target)
    if not corpus.exists():
        raise RagspecError(f"corpus path {corpus_given} does not exist")
    summary = BuildSummary(path=target)
    report = ScanReport()
    if corpus.is_file():
        root, only = corpus.parent, corpus.name
        files = [f for f in walk(root, ScanReport()) if f.rel == only]  # only this file; siblings unreported
        if not files:
            raise RagspecError(f"{corpus_given} is not a supported file (.txt .md .rst .html .json .jsonl .pdf)")
    else:
        root = corpus
        files = walk(root, report)
    root_given = corpus_given if corpus.is_dir() else os.path.dirname(corpus_given) or "."

    with layout.build_lock(target):
        stale = layout.clean_stale(target)
        if stale:
            summary.notes.append(f"removed {stale} unfinished build(s) left by an interrupted run")
        prev = _open_previous(target)
        own = prev is not None  # "up to date" only ever means the target's own previous version
        if prev is None and reuse_from is not None:
            prev = _open_previous(Path(reuse_from))
        compatible = prev is not None and _compatible(prev.manifest, settings)
        if prev is not None and not compatible:
            summary.notes.append("settings changed since the last build: re-embedding everything")
        reuse = _reusable(prev) if compatible else {}

        # decide per file: reuse (unchanged) or read (new/changed)
        keep: dict[str, _Reuse] = {}
        to_read: list[SourceFile] = []
        for f in files:
            old = reuse.get(f.rel)
            if old is not None and old.size == f.size and abs(old.mtime - f.mtime) < 1e-6:
                keep[f.rel] = old
            else:
                to_read.append(f)
        summary.deleted = len(set(reuse) - {f.rel for f in files})

        new_docs: dict[str, list[Document]] = {}
        if to_read:
            with progress() as bar:
                task = bar.add_task("reading", total=len(to_read), visible=show_progress)
                for f in to_read:
                    docs = read_file(f, report)
                    old = reuse.get(f.rel)
                    if old is not None and docs and docs[0].sha256 == old.sha256:
                        keep[f.rel] = _Reuse(old.rows, old.sha256, f.size, f.mtime)  # touched, not changed
                    elif docs:
                        new_docs[f.rel] = docs
                        if old is None:
                            summary.added += 1
                        else:
                            summary.changed += 1
                    elif old is not None:
                        summary.deleted += 1  # now unreadable/empty: it leaves the index
                    bar.advance(task)
        _report(report)
        summary.skipped = report.skipped_count

        touched = any(
            prev is not None and keep.get(rel) and keep[rel].mtime != reuse[rel].mtime for rel in keep
        )
        plan_n = prev.store.count_chunks() if prev is not None else 0
        if (
            own
            and compatible
            and not new_docs
            and summary.deleted == 0
            and not touched
            and _same_faiss_request(prev.manifest, settings, plan_n)
            and windows.stored(prev.manifest) is not None
        ):
            summary.up_to_date = True
            summary.documents = prev.store.count_documents()
            summary.files = len(files)
            summary.chunks = plan_n
            summary.reused = plan_n
            summary.factory = prev.manifest["faiss"]["factory"]
            summary.index_type = prev.manifest["faiss"]["kind"]
            summary.bytes = layout.dir_bytes(prev.folder)
            summary.seconds = time.perf_counter() - t0
            return summary

        tmp = None
        try:
            tmp = layout.new_tmp_dir(target)
            summary_out = _write_version(
                tmp, root, root_given, files, keep, new_docs, prev, settings, embedder, summary, show_progress,
                executor,
            )
            version = layout.publish(tmp, target)
        except BaseException as exc:
            full = _disk_full(exc, target.parent)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # the previous version is untouched; leave no half build
            if full:
                raise RagspecError(
                    f"no space left on the device while writing {target}; the previous index is unchanged: "
                    "free some space and run `ragspec index` again"
                ) from None
            raise
        layout.prune(target)
        summary_out.bytes = layout.dir_bytes(version)
        summary_out.seconds = time.perf_counter() - t0
        if prev is not None:
            prev.close()
        return summary_out


def _write_version(tmp, root, root_given, files, keep, new_docs, prev, settings, embedder, summary, show_progress,
                   executor=None):
    writer = StoreWriter(tmp / STORE)
    prev_vectors = np.load(prev.folder / EMBEDDINGS, allow_pickle=False, mmap_mode="r") if keep else None
    rows_from_prev: list[int] = []  # prev chunk ids, in new-id order, for reused chunks
    slots_new: list[int] = []  # rows of `fresh` (the new chunks' vectors), -1 for reused chunks
    all_texts: list[str] = []
    n_docs = 0
    fresh_docs = [d for f in files if f.rel in new_docs for d in new_docs[f.rel]]
    if fresh_docs and executor is None and embedder is None:  # loaded before the clock starts, as always
        from ragspec.models.embedder import load_embedder

        embedder = load_embedder(settings.embedder, settings.device, settings.embed_dtype, settings.chunk_tokens)
    t_embed = time.perf_counter()
    runner = executor or LocalExecutor(embedder)
    done = runner.chunk_embed([d.text for d in fresh_docs], settings, show_progress)
    if fresh_docs:
        summary.embed_seconds = time.perf_counter() - t_embed
    next_doc = iter(done.chunks)
    n_fresh = 0
    for f in files:
        if f.rel in keep:
            for row in keep[f.rel].rows:
                doc, text, ftype, meta = prev.store.document_full(row.id)
                did = writer.add_document(
                    path=doc.path, key=doc.key, sha256=doc.sha256, size=keep[f.rel].size,
                    mtime=keep[f.rel].mtime, title=doc.title, encoding=doc.encoding, text=text,
                    file_type=ftype, meta=meta,
                )
                old_chunks = prev.store.chunks_of(row.id)
                writer.add_chunks(did, [(o, s, e, t) for _, o, s, e, t in old_chunks])
                rows_from_prev.extend(cid for cid, *_ in old_chunks)
                all_texts.extend(t for *_, t in old_chunks)
                slots_new.extend([-1] * len(old_chunks))
                n_docs += 1
        elif f.rel in new_docs:
            for d in new_docs[f.rel]:
                did = writer.add_document(
                    path=d.rel, key=d.key, sha256=d.sha256, size=d.size, mtime=d.mtime,
                    title=d.title, encoding=d.encoding, text=d.text, file_type=file_type(d.rel), meta=d.meta,
                )
                chunks = next(next_doc)
                writer.add_chunks(did, [(c.order, c.start, c.end, c.text) for c in chunks])
                for c in chunks:
                    rows_from_prev.append(-1)
                    slots_new.append(n_fresh)
                    n_fresh += 1
                    all_texts.append(c.text)
                n_docs += 1
    writer.close()
    n = len(all_texts)
    if n == 0:
        raise RagspecError("no chunks: the corpus has no readable documents (see the warnings above)")
    fresh = done.vectors
    dim = fresh.shape[1] if n_fresh else prev_vectors.shape[1]
    vectors = np.zeros((n, dim), dtype=np.float32)
    for i in range(n):
        if rows_from_prev[i] >= 0:
            vectors[i] = prev_vectors[rows_from_prev[i]]
        else:
            vectors[i] = fresh[slots_new[i]]
    np.save(tmp / EMBEDDINGS, vectors.astype(np.float16), allow_pickle=False)
    # FAISS sees exactly the vectors a later incremental build will reuse (stored as float16)
    vectors = vectors.astype(np.float16).astype(np.float32)
    embed_dtype = done.dtype if fresh_docs else prev.manifest["embedder"]["dtype"]
    fresh_windows = [done.windows[slots_new[i]] if slots_new[i] >= 0 and done.windows is not None else None
                     for i in range(n)]
    window_rows = _write_windows(tmp, all_texts, fresh_windows, rows_from_prev, prev, dim, settings, embed_dtype,
                                 embedder or getattr(runner, "embedder", None), summary, show_progress)
    plan = _faiss_plan(settings, n, dim)
    with console.status(f"FAISS {plan.factory} over {n} vectors") if show_progress else _null():
        index = faiss_index.build(vectors, plan, use_gpu=settings.device == "cuda")
        faiss_index.write(index, tmp / FAISS)
    if settings.device == "cuda":
        from ragspec.index.torch_search import which_search

        gpu = faiss_index.gpu_available()
        summary.notes.append(f"device cuda: embedded on cuda; FAISS built on the {'GPU' if gpu else 'CPU'}; searches "
                             f"on cuda run {which_search('cuda')}")
    if settings.bm25:
        from ragspec.index import bm25

        with console.status("BM25") if show_progress else _null():
            bm25.build(all_texts, tmp / BM25_DIR)
    embedder_name = done.embedder if fresh_docs else prev.manifest["embedder"]["name"]
    files_meta = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            from ragspec.models.registry import sha256_file

            files_meta[p.relative_to(tmp).as_posix()] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
    manifest.write(
        tmp,
        {
            "format_version": manifest.FORMAT_VERSION,
            "corpus": {"root": root_given, "root_abs": str(Path(root).resolve())},
            "embedder": {
                "name": embedder_name,
                "requested": settings.embedder,
                "dimension": dim,
                "dtype": embed_dtype,
                "normalized": True,
                "max_tokens": settings.chunk_tokens,
                # the gate's window vectors (index/windows.py); here, not a key of its own, so that a ragspec
                # from before them still reads the index (it checks the files and ignores the entry)
                "windows": windows.manifest_entry(window_rows),
            },
            "faiss": plan.as_dict(),
            "chunker": settings.chunker_dict() | {"tokenizer": embedder_name},
            "bm25": {"enabled": settings.bm25, "stopwords": "en", "stemmer": "english"} if settings.bm25 else {"enabled": False},
            "counts": {"documents": n_docs, "chunks": n, "files": len(files), "skipped": summary.skipped},
            "files": files_meta,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )
    summary.documents = n_docs
    summary.files = len(files)
    summary.chunks = n
    summary.embedded = n_fresh
    summary.reused = n - n_fresh
    summary.factory = plan.factory
    summary.index_type = plan.kind
    return summary


def _write_windows(tmp, texts, fresh, rows_from_prev, prev, dim, settings, dtype, embedder, summary,
                   show_progress) -> int:
    """Every chunk's gate windows (index/windows.py): a new chunk's as pooled when it was embedded, a reused
    one's from the previous version, or pooled now where that version has none. Returns the rows written."""
    previous = windows.StoredWindows(prev.folder) if prev is not None and windows.stored(prev.manifest) else None
    reuse = rows_from_prev if previous is not None else [-1] * len(texts)
    if prev is not None and previous is None and any(r >= 0 for r in rows_from_prev):
        summary.notes.append("the previous version has no gate window vectors (or older ones): pooling the kept "
                             "chunks' windows")
    t = time.perf_counter()

    def pool(todo: list[str]) -> list[np.ndarray]:
        nonlocal embedder
        if embedder is None:
            from ragspec.models.embedder import load_embedder

            embedder = load_embedder(settings.embedder, settings.device, dtype, settings.chunk_tokens)
        with progress() as bar:
            task = bar.add_task("pooling gate windows", total=len(todo), visible=show_progress)
            return embedder.encode_windows(todo, settings.embed_batch_size,
                                           on_batch=lambda k: bar.advance(task, k))[1]

    made, reused = windows.write(tmp, texts, reuse, previous, fresh, pool, dim)
    summary.windows_embedded, summary.windows_reused = made, reused
    summary.windows_seconds = time.perf_counter() - t
    return int(np.load(tmp / windows.OFFSETS)[-1])


@dataclass
class Embedded:
    """What an executor returns for the documents it was given: their chunks and one vector per chunk."""

    chunks: list[list[Chunk]]  # per document, in the order given
    vectors: np.ndarray  # float32, one row per chunk: documents in order, each document's chunks in order
    embedder: str = ""  # the embedder's canonical name and dtype, for the manifest
    dtype: str = ""
    windows: list[np.ndarray] | None = None  # per chunk (as `vectors`): its gate windows' vectors, pooled


class LocalExecutor:
    """Chunk and embed in this process (the default; `ragspec.cluster.indexing.RayExecutor` is the other)."""

    def __init__(self, embedder=None):
        self.embedder = embedder

    def chunk_embed(self, texts: list[str], settings: IndexSettings, show_progress: bool = True) -> Embedded:
        if not texts:
            return Embedded([], np.zeros((0, 0), dtype=np.float32))
        if self.embedder is None:
            from ragspec.models.embedder import load_embedder

            self.embedder = load_embedder(settings.embedder, settings.device, settings.embed_dtype,
                                          settings.chunk_tokens)
        emb = self.embedder
        chunker = ChunkerSettings(settings.chunk_tokens, settings.overlap)
        chunks: list[list[Chunk]] = []
        with progress() as bar:
            task = bar.add_task("chunking", total=len(texts), visible=show_progress)
            for text in texts:
                chunks.append(chunk_text(text, emb.tokenizer, chunker))
                bar.advance(task)
        flat = [c.text for doc in chunks for c in doc]
        # copies of one text (the same paragraph in several files) are embedded once
        first: dict[str, int] = {}
        distinct: list[str] = []
        slot_of: list[int] = []
        for t in flat:
            h = text_hash(t)
            if h not in first:
                first[h] = len(distinct)
                distinct.append(t)
            slot_of.append(first[h])
        with progress() as bar:
            task = bar.add_task("embedding", total=len(distinct), visible=show_progress)
            vecs, wins = emb.encode_windows(distinct, settings.embed_batch_size,
                                            on_batch=lambda k: bar.advance(task, k))
        vectors = vecs[np.asarray(slot_of, dtype=np.int64)] if flat else np.zeros((0, emb.dim), np.float32)
        return Embedded(chunks, vectors, emb.name, emb.dtype, [wins[k] for k in slot_of])


def file_type(rel: str) -> str:
    """A document's file type for filters: its suffix without the dot, lower-case ('' when it has none)."""
    return Path(rel).suffix.lower().lstrip(".")


def _open_previous(target: Path) -> Index | None:
    if not (target.exists() or target.is_symlink()):
        return None
    try:
        return Index(target)
    except IndexDamaged as exc:
        warn(f"previous index at {target} is damaged ({exc.detail}); rebuilding it from scratch")
    except RagspecError as exc:
        warn(f"previous index at {target} is unusable ({exc}); building from scratch")
    return None


def _disk_full(exc: BaseException, folder: Path) -> bool:
    """ENOSPC as each writer reports it: an errno (json, bm25s), a message (sqlite3, FAISS), or a short write
    with no errno (numpy) on a device that is now full."""
    if not isinstance(exc, Exception):
        return False
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc).lower()
    if "no space left" in text or "disk is full" in text or "disk quota" in text:
        return True
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return isinstance(exc, (OSError, RuntimeError)) and st.f_bavail * st.f_frsize < 1 << 20


def _compatible(prev_manifest: dict, s: IndexSettings) -> bool:
    e = prev_manifest.get("embedder", {})
    c = prev_manifest.get("chunker", {})
    dtype = s.embed_dtype
    if dtype == "auto":
        from ragspec.models.embedder import best_cpu_dtype

        dtype = best_cpu_dtype() if s.device == "cpu" else "float16"
    return (
        e.get("requested") == s.embedder
        and e.get("dtype") == dtype
        and c.get("tokens") == s.chunk_tokens
        and c.get("overlap") == s.overlap
        and prev_manifest.get("bm25", {}).get("enabled", False) == s.bm25
    )


def _faiss_plan(s: IndexSettings, n: int, dim: int) -> faiss_index.FaissPlan:
    """The FAISS plan these settings ask for (one place, for building and for the up-to-date check)."""
    return faiss_index.plan_index(n, dim, s.index_type, s.faiss_factory, s.nprobe, s.refine, s.refine_k_factor,
                                  s.spill)


def _same_faiss_request(prev_manifest: dict, s: IndexSettings, n: int) -> bool:
    f = prev_manifest.get("faiss", {})
    dim = prev_manifest.get("embedder", {}).get("dimension", 0)
    try:
        plan = _faiss_plan(s, n, dim)
    except RagspecError:
        return False
    return plan.as_dict() == f


def _reusable(prev: Index) -> dict[str, _Reuse]:
    out: dict[str, _Reuse] = {}
    for row in prev.store.documents():
        r = out.get(row.path)
        if r is None:
            out[row.path] = _Reuse([row], row.sha256, row.size, row.mtime)
        else:
            r.rows.append(row)
    return out


def _report(report: ScanReport) -> None:
    for rel, reason in report.skipped:
        warn(f"skipped {rel}: {reason}")
    for rel, enc in report.decoded:
        warn(f"{rel} is not UTF-8; decoded as {enc}")
    for rel, problem in report.problems[:20]:
        warn(f"{rel}: {problem}")
    if len(report.problems) > 20:
        warn(f"… and {len(report.problems) - 20} more bad records")
    if report.unsupported:
        kinds = ", ".join(f"{k} ×{v}" for k, v in sorted(report.unsupported.items()))
        warn(f"skipped {sum(report.unsupported.values())} files of unsupported types ({kinds})")


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
