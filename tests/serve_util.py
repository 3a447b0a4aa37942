"""Helpers for the `ragspec serve` tests: a small index and a real uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time

SPEC = {
    "name": "serve-test",
    "retriever": {"top_n": 3},
    "generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 40},
    "drafting": {"method": "trie", "budget": 16},
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving `app` on 127.0.0.1 in a background thread; `stop()` shuts it down."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


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
