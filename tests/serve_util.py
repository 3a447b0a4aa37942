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


def quiet_port(host: str = "127.0.0.1", low: int = 20000, high: int = 32000) -> int:
    """A free port for a server that binds it only seconds later (Ray Serve's proxy, after Ray has started): from
    a range neither the kernel's ephemeral ports (32768-60999 here) nor Ray's worker ports (10002-19999) use, so
    Ray's own sockets cannot take it in between (seen: "Failed to bind to address" with a port from bind(0))."""
    import random
    import socket

    for port in random.sample(range(low, high), 200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{high}")
