"""Helpers for the `ragspec serve` tests: a small index and a real uvicorn server on a free loopback port."""

from __future__ import annotations

from ragspec.serve.app import BackgroundServer

SPEC = {
    "name": "serve-test",
    "retriever": {"top_n": 3},
    "generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 40},
    "drafting": {"method": "trie", "budget": 16},
}


LiveServer = BackgroundServer


def build_test_index(root, embedder):
    from conftest import write_corpus

    from ragspec.index.builder import build_index
    from ragspec.settings import IndexSettings

    corpus = write_corpus(root / "corpus")
    target = root / "indexes" / "corpus"
    build_index(corpus, target, IndexSettings(chunk_tokens=48, overlap=8), embedder=embedder, show_progress=False)
    return target


def make_pipeline(index_path, embedder, model, tokenizer, spec: dict | None = None):
    from ragspec.pipeline import Pipeline
    from ragspec.retrieve.retriever import Retriever
    from ragspec.spec import load_spec

    s = load_spec(spec or SPEC)
    return Pipeline(s, Retriever(str(index_path), s.retriever, embedder=embedder), model=model, tokenizer=tokenizer)
