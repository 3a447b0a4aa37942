from pathlib import Path

import pytest
from conftest import REPO

from ragspec.errors import RagspecError
from ragspec.spec import load_spec


def test_shipped_specs_validate():
    for path in sorted((REPO / "pipelines").glob("*.yaml")):
        spec = load_spec(path)
        assert spec.retriever.top_n == 5
    assert load_spec(REPO / "pipelines" / "bge-m3.yaml").index.faiss_factory == "IVF4096,PQ64"


def test_the_default_spec_names_the_15b_and_fast_the_05b():
    for spec in (load_spec(None), load_spec(REPO / "pipelines" / "default.yaml")):
        assert spec.generator.model == "qwen2.5-coder-1.5b-instruct"
    assert load_spec(REPO / "pipelines" / "fast.yaml").generator.model == "qwen2.5-coder-0.5b-instruct"


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("index:\n  chunk_tokns: 100\n")
    with pytest.raises(RagspecError, match=r"unknown key 'index.chunk_tokns'"):
        load_spec(p)
    with pytest.raises(RagspecError, match=r"retriever.top_n"):
        load_spec({"retriever": {"top_n": 0}})
    with pytest.raises(RagspecError, match="does not exist"):
        load_spec(Path(tmp_path / "missing.yaml"))
