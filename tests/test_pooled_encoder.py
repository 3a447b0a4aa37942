"""The plain-kind embedder without sentence-transformers: the same vectors, bit for bit, and the fallback."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ragspec.models.pooled_encoder import PooledEncoder, plain_pooling
from ragspec.models.registry import lookup, part_paths

MINILM = part_paths(lookup("all-minilm-l6-v2", "embedder"))[0]

TEXTS = [
    "Use open() with mode 'a' to open a file for appending.",
    "  leading and trailing spaces  ",
    "",
    "x",
    "ünïcödé, 漢字 and emoji 🙂 in one line",
    "The global statement declares that the listed identifiers are to be interpreted as globals. " * 12,
    "word " * 400,  # past max_seq_length: truncated the same way
    "Mode 'w' truncates the file first; mode 'x' fails if the file already exists.",
    "same length a", "same length b", "same length c",  # ties in the longest-first order
] + [f"Paragraph {i}: the Danube flows through {i} countries." for i in range(30)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vectors_equal_sentence_transformers_bit_for_bit(dtype):
    import torch
    from sentence_transformers import SentenceTransformer

    dt = getattr(torch, dtype)
    ours = PooledEncoder(MINILM, *plain_pooling(MINILM), device="cpu", dtype=dt)
    theirs = SentenceTransformer(str(MINILM), device="cpu", model_kwargs={"dtype": dt}).eval()
    for batch in (1, 8, 32):
        a = theirs.encode(TEXTS, batch_size=batch, normalize_embeddings=True, convert_to_numpy=True,
                          show_progress_bar=False)
        b = ours.encode(TEXTS, batch_size=batch, normalize_embeddings=True)
        assert b.shape == (len(TEXTS), 384)
        assert np.array_equal(a.astype(np.float32), b.astype(np.float32)), (dtype, batch)


def test_the_embedded_embedder_runs_without_importing_sentence_transformers():
    code = ("import sys; from ragspec.models.embedder import load_embedder; "
            "e = load_embedder('all-minilm-l6-v2', 'cpu', 'auto', 256); v = e.encode(['a question', 'a source']); "
            "print(type(e.model).__name__, v.shape, e.max_tokens, e.dim, 'sentence_transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["PooledEncoder", "(2,", "384)", "256", "384", "False"]


def _variant(tmp_path, change) -> object:
    """A copy of MiniLM's folder (weights linked) with one of its sentence-transformers configs changed."""
    folder = tmp_path / "variant"
    folder.mkdir()
    for p in MINILM.iterdir():
        if p.is_file():
            (folder / p.name).symlink_to(p)
    pooling = folder / "1_Pooling"
    pooling.mkdir()
    (pooling / "config.json").write_text((MINILM / "1_Pooling" / "config.json").read_text())
    name, edit = change
    target = folder / name
    data = json.loads(target.read_text()) if target.exists() else {}
    if target.is_symlink():
        target.unlink()
    target.write_text(json.dumps(edit(data)))
    return folder


def _with(key, value):
    return lambda d: {**d, key: value}


@pytest.mark.parametrize("change", [
    ("sentence_bert_config.json", _with("do_lower_case", True)),
    ("config_sentence_transformers.json", _with("prompts", {"query": "query: "})),
    ("config_sentence_transformers.json", _with("default_prompt_name", "query")),
    ("1_Pooling/config.json", _with("pooling_mode_max_tokens", True)),
    ("1_Pooling/config.json", _with("pooling_mode_cls_token", True)),
    ("modules.json", lambda d: d + [{"idx": 3, "name": "3", "path": "3_Dense",
                                     "type": "sentence_transformers.models.Dense"}]),
], ids=["lower-case", "prompts", "default-prompt", "max-pooling", "two-poolings", "dense-module"])
def test_any_other_kind_is_left_to_sentence_transformers(tmp_path, change):
    assert plain_pooling(MINILM) == ("mean", 256, True)
    assert plain_pooling(_variant(tmp_path, change)) is None


def test_cls_pooling_is_the_plain_kind_too(tmp_path):
    folder = _variant(tmp_path, ("1_Pooling/config.json",
                                 lambda d: {**d, "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": True}))
    assert plain_pooling(folder) == ("cls", 256, True)
    import torch
    from sentence_transformers import SentenceTransformer

    ours = PooledEncoder(folder, *plain_pooling(folder), device="cpu", dtype=torch.float32)
    theirs = SentenceTransformer(str(folder), device="cpu").eval()
    a = theirs.encode(TEXTS, batch_size=8, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    assert np.array_equal(a, ours.encode(TEXTS, batch_size=8))


def test_loading_an_embedder_prints_no_bar_and_keeps_the_callers_setting(capfd):
    """A library user's `Pipeline.ask` printed transformers' "Loading weights" bar (the CLI silences it globally);
    ragspec turns it off only while it loads, and leaves the caller's choice as it was."""
    from transformers.utils import logging as hf_logging

    from ragspec.models.embedder import load_embedder

    hf_logging.enable_progress_bar()
    capfd.readouterr()
    load_embedder("all-minilm-l6-v2", dtype="float32")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
