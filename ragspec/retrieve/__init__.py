"""Retrieval: dense (FAISS), BM25, reciprocal-rank fusion and cross-encoder reranking."""

from ragspec.retrieve.retriever import Hit, Retriever

__all__ = ["Hit", "Retriever"]
