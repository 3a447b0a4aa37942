"""Corpus loading (files → documents) and chunking (documents → chunks with exact character offsets)."""

from ragspec.corpus.chunker import Chunk, ChunkerSettings, chunk_text
from ragspec.corpus.loader import Document, ScanReport, iter_documents, read_file, walk

__all__ = ["Chunk", "ChunkerSettings", "Document", "ScanReport", "chunk_text", "iter_documents", "read_file", "walk"]
