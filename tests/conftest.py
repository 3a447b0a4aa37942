"""Shared fixtures: the real MiniLM embedder (loaded once) and small corpora written by the tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub
# a pipeline on a machine with no calibration table takes the CPU-flag guess and measures nothing: no job runs
# beside the tests, and no test pays minutes of measurement it does not check (the guess is what every table
# measured so far picks); tests/test_machine.py covers the measurement, the background job and the switch
os.environ.setdefault("RAGSPEC_CALIBRATE", "off")

REPO = Path(__file__).resolve().parent.parent

PARAGRAPHS = {
    "files.md": (
        "# Working with files\n\n"
        "Use open() with mode 'a' to open a file for appending. Writes then go to the end of the file, "
        "whatever the current seek position is.\n\n"
        "Mode 'w' truncates the file first; mode 'x' fails if the file already exists.\n\n"
        "Always close files, or better, use a with statement so they are closed for you."
    ),
    "rivers.txt": (
        "The Danube flows through ten countries, more than any other river in the world.\n"
        "It rises in the Black Forest and empties into the Black Sea.\n\n"
        "The Rhine is shorter but carries more traffic; barges move coal and grain along it."
    ),
    "sub/bread.rst": (
        "Baking bread\n============\n\n"
        "Knead the dough for ten minutes until it is smooth and elastic. Let it rise for an hour.\n\n"
        "Bake at 230 degrees Celsius for thirty minutes, until the crust sounds hollow when tapped."
    ),
}


def write_corpus(root: Path, files: dict[str, str] = PARAGRAPHS) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def embedder():
    from ragspec.models.embedder import load_embedder

    return load_embedder("all-minilm-l6-v2", "cpu", "auto", 256)


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def smol():
    """SmolLM2-135M-Instruct (model, tokenizer), seeded, one for the session (no test changes it); a module that
    needs another load defines its own."""
    import torch

    from ragspec.models.generator import load_generator

    torch.manual_seed(0)
    return load_generator("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def cases(smol):
    """(prompt, greedy reference) for each of greedy_cases.QUESTIONS, 48 new tokens."""
    from greedy_cases import PASSAGES, QUESTIONS, chat_prompt, reference

    from ragspec.decoding.generate import SpeculativeGenerator

    model, tok = smol
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    return [(prompt, reference(model, prompt, 48, eos))
            for prompt in (chat_prompt(tok, PASSAGES[p], q) for q, p in QUESTIONS)]
