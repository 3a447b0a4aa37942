"""LangChain: the standard `langchain-tests` suites for ChatRagspec and RagspecRetriever (SmolLM2, MiniLM),
and our own checks of RagspecLLM against the pipeline (same text, stream, callbacks, batch, async)."""

from __future__ import annotations

import asyncio
import functools
import tempfile
from pathlib import Path

from conftest import write_corpus
from langchain_core.callbacks import BaseCallbackHandler
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from ragspec.integrations.langchain import ChatRagspec, RagspecLLM, RagspecRetriever
from ragspec.pipeline import Pipeline

SMOL = {"model": "smollm2-135m-instruct", "budget": 16}
SHORT = 32  # answer budget in the suites (their default is 100 tokens), to keep CI time down


@functools.cache
def small_index() -> str:
    """A small real index, built once per test session (the suites take constructor params, not fixtures)."""
    from ragspec.index.builder import build_index
    from ragspec.settings import IndexSettings

    root = Path(tempfile.mkdtemp(prefix="ragspec-lc-"))
    corpus = write_corpus(root / "corpus")
    build_index(corpus, root / "index", IndexSettings(chunk_tokens=48, overlap=8), show_progress=False)
    return str(root / "index")


class ChatRagspecParams:
    """What both chat suites construct. Tool calling, structured output, JSON mode and multimodal inputs are
    off through the suites' own properties: ChatRagspec does not override bind_tools / with_structured_output,
    and the supports_* flags default to False."""

    @property
    def chat_model_class(self):
        return ChatRagspec

    @property
    def chat_model_params(self) -> dict:
        return dict(SMOL)

    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": SHORT}


class TestChatRagspecUnit(ChatRagspecParams, ChatModelUnitTests):
    pass


class TestChatRagspecIntegration(ChatRagspecParams, ChatModelIntegrationTests):
    pass


class TestRagspecRetriever(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self):
        return RagspecRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"index": small_index(), "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "how do I open a file for appending"


# -- our own ----------------------------------------------------------------------------------------------------
QUESTION = "Which mode opens a file for appending?"


def _pipeline() -> Pipeline:
    return Pipeline({"generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 32},
                     "drafting": {"budget": 16}, "retriever": {"top_n": 3}}, small_index())


class Tokens(BaseCallbackHandler):
    def __init__(self):
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def test_llm_with_an_index_equals_the_pipeline_answer():
    pipe = _pipeline()
    expected = pipe.ask(QUESTION)
    llm = RagspecLLM(pipeline=pipe)
    assert llm.invoke(QUESTION) == expected.text
    chunks = list(llm.stream(QUESTION))
    assert len(chunks) > 1 and "".join(chunks) == expected.text
    cb = Tokens()
    assert llm.invoke(QUESTION, config={"callbacks": [cb]}) == expected.text
    assert "".join(cb.tokens) == expected.text and len(cb.tokens) > 1
    assert llm.batch([QUESTION, QUESTION]) == [expected.text, expected.text]
    others = ["Where does the Danube rise?", "How long should the dough be kneaded?"]
    alone = [pipe.ask(q).text for q in others]
    assert llm.batch([QUESTION, *others]) == [expected.text, *alone]  # run together, each as alone
    assert asyncio.run(llm.ainvoke(QUESTION)) == expected.text


def test_llm_by_index_name_and_generation_info():
    llm = RagspecLLM(model="smollm2-135m-instruct", index=small_index(), max_tokens=32, budget=16)
    result = llm.generate([QUESTION])
    gen = result.generations[0][0]
    same = Pipeline({"generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 32},
                     "drafting": {"budget": 16}}, small_index())  # the LLM's settings (top_n 5)
    assert gen.text == same.ask(QUESTION).text
    info = gen.generation_info
    assert {"citations", "stats", "sources"} <= set(info) and info["stats"]["new_tokens"] > 0


def test_llm_drafts_from_a_prompt_that_holds_the_documents():
    passage = "The Danube rises in the Black Forest and empties into the Black Sea after 2,850 km."
    llm = RagspecLLM(**SMOL, max_tokens=32)
    prompt = f"Passage: {passage}\nQuestion: Where does the Danube rise? Quote the passage."
    text = llm.invoke(prompt)
    direct = Pipeline({"generator": {"model": "smollm2-135m-instruct", "max_new_tokens": 32},
                       "drafting": {"budget": 16}}).stream_prompt(prompt)
    assert text == "".join(e.text for e in direct if hasattr(e, "text") and isinstance(e.text, str))


def test_chat_metadata_carries_citations_and_stats():
    chat = ChatRagspec(**SMOL, max_tokens=32)
    msg = chat.invoke("Repeat exactly: The Danube rises in the Black Forest and empties into the Black Sea.")
    meta = msg.response_metadata
    assert meta["model_name"] == "smollm2-135m-instruct" and meta["stats"]["new_tokens"] > 0
    assert msg.usage_metadata["output_tokens"] == meta["stats"]["new_tokens"]
    for c in meta["citations"]:
        assert c["path"] == "<prompt>" and msg.content[c["answer_start"] : c["answer_end"]].split() == c["quote"].split()


def test_retriever_documents_carry_offsets():
    docs = RagspecRetriever(index=small_index(), k=3).invoke("how do I open a file for appending")
    assert len(docs) == 3
    for d in docs:
        with open(d.metadata["source"], encoding="utf-8", newline="") as f:
            assert f.read()[d.metadata["start"] : d.metadata["end"]] == d.page_content
        assert {"chunk_id", "score"} <= set(d.metadata)


def test_retriever_filter_in_search_kwargs_and_per_call():
    index = small_index()
    docs = RagspecRetriever(index=index, search_kwargs={"k": 3, "filter": {"path": "sub/*"}}).invoke("rivers")
    assert docs and all(d.metadata["source"].endswith("sub/bread.rst") for d in docs)
    docs = RagspecRetriever(index=index, k=2).invoke("how do I open a file", filter={"type": {"$in": ["txt"]}})
    assert docs and all(d.metadata["source"].endswith("rivers.txt") for d in docs)
    for d in docs:
        loc = d.metadata["locations"][0]
        assert (loc["source"], loc["start"], loc["end"]) == (d.metadata["source"], d.metadata["start"],
                                                              d.metadata["end"])
    mmr = RagspecRetriever(index=index, k=3, search_type="mmr").invoke("how do I open a file for appending")
    assert len(mmr) == 3
