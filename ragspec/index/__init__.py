"""Indexes on disk: SQLite store, FAISS index, BM25, manifest; built atomically and incrementally."""

from ragspec.index.reader import Index

__all__ = ["Index"]
