"""An LCEL RAG chain over a folder: RagspecRetriever | prompt | ChatRagspec | StrOutputParser, streamed.

    python examples/langchain_rag.py FOLDER "question" [--model NAME] [--k 5]

The folder is indexed into indexes/<folder name> first (incremental: an unchanged corpus is 'up to date' in
seconds). The chat model drafts from the documents the retriever put into the prompt, so copied spans are
accepted many tokens per step; its citations and decoding stats arrive in the last chunk's metadata.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from ragspec.index.builder import build_index, default_name
from ragspec.integrations.langchain import ChatRagspec, RagspecRetriever
from ragspec.paths import default_index_root

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You answer questions using only the numbered sources. Wherever you can, copy the sources' exact "
               "wording instead of paraphrasing. If the sources do not contain the answer, say so."),
    ("human", "Sources:\n{context}\n\nQuestion: {question}"),
])


def format_docs(docs) -> str:
    return "\n\n".join(f"[{i}] {d.metadata['source']}\n{d.page_content}" for i, d in enumerate(docs, 1))


class Metadata(BaseCallbackHandler):
    """Keeps the chat model's final response metadata (citations, decoding stats)."""

    def __init__(self):
        self.meta: dict = {}

    def on_llm_end(self, response, **kwargs) -> None:
        msg = getattr(response.generations[0][0], "message", None)
        if msg is not None and msg.response_metadata:
            self.meta = msg.response_metadata


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("question")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()

    target = default_index_root() / default_name(args.folder)
    build_index(args.folder, target)
    retriever = RagspecRetriever(index=str(target), k=args.k)
    chat = ChatRagspec(model=args.model, max_tokens=args.max_tokens)
    chain = ({"context": retriever | RunnableLambda(format_docs), "question": RunnablePassthrough()}
             | PROMPT | chat | StrOutputParser())

    t = time.perf_counter()
    meta = Metadata()
    for text in chain.stream(args.question, config={"callbacks": [meta]}):  # text as it is verified
        sys.stdout.write(text)
        sys.stdout.flush()
    print()
    if meta.meta:
        stats = meta.meta["stats"]
        for c in meta.meta["citations"]:
            print(f"  quoted from the prompt [{c['start']}:{c['end']}]: {' '.join(c['quote'].split())[:90]!r}")
        print(f"{stats['new_tokens']} tokens in {stats['decode_ms'] / 1000:.1f} s "
              f"({stats['decode_tokens_per_s']:.1f} tok/s, {stats['mean_accepted']:.2f} tokens/step, "
              f"speed-up ≈ {stats['speedup_estimate'] or 0:.2f}×); total {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
