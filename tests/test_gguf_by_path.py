"""Any GGUF by path (`generator.model: ./mine.gguf`) on dtype gguf, built from the GGUF alone (`gguf_model.py`).

What is checked: tiny Llama and Qwen2 GGUFs written here with `gguf`'s writer (SmolLM2's tokenizer and chat
template, random weights in five block types) load with their tokenizer read from the file, their token table and
norms the bits transformers' GGUF loader de-quantizes, their logits tracking its float model, and every drafter
greedy-identical to plain greedy; the embedded SmolLM2 loads with the same logits as its GGUF copied elsewhere and
named by path, no float folder or GGUF copy made, and a pipeline on the path answers; an architecture the kernels
do not run is one clear line.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from greedy_cases import PASSAGES, QUESTIONS, chat_prompt, reference

from ragspec.decoding.budget import AdaptiveBudget, CostModel
from ragspec.decoding.drafters import make_drafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.errors import RagspecError
from ragspec.models.registry import installed

SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
FLAT = CostModel([1, 2, 4, 8, 16, 32, 64, 128, 256], [100, 102, 104, 108, 116, 132, 164, 228, 356])
METHODS = ["none", "pld", "trie", "suffix", "lookahead", "ngrammys", "auto", "pldplus-h", "pldplus-a"]

pytestmark = pytest.mark.skipif(not installed(SMOL), reason="SmolLM2's weight package is not installed")


def write_tiny_gguf(path: Path, arch: str, tokenizer_gguf: Path, seed: int = 0, hidden: int = 64, ffn: int = 128,
                    layers: int = 2, heads: int = 4, kv_heads: int = 2) -> Path:
    """A small model of `arch` ("llama": a tied head; "qwen2": q/k/v biases and its own head) with the tokenizer
    (and chat template) of `tokenizer_gguf`, random weights in Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(seed)
    src = gguf.GGUFReader(str(tokenizer_gguf))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    vocab = 0
    for name, field in src.fields.items():
        if name.startswith("tokenizer."):
            value = field.contents()
            vocab = len(value) if name == "tokenizer.ggml.tokens" else vocab
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(name, value, field.types[0], sub_type=field.types[-1] if array else None)

    def blocks(name: str, shape: tuple[int, int], qtype, scale: float) -> None:
        w.add_tensor(name, gguf.quants.quantize((rng.standard_normal(shape) * scale).astype(np.float32), qtype),
                     raw_dtype=qtype)

    def floats(name: str, values: np.ndarray) -> None:
        w.add_tensor(name, values.astype(np.float32))

    blocks("token_embd.weight", (vocab, hidden), T.Q8_0, 0.5)
    head_dim = hidden // heads
    for i in range(layers):
        floats(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
        for kind, rows, qtype in (("attn_q", hidden, T.Q4_0), ("attn_k", kv_heads * head_dim, T.Q8_0),
                                  ("attn_v", kv_heads * head_dim, T.Q4_1), ("attn_output", hidden, T.Q5_0),
                                  ("ffn_gate", ffn, T.Q4_0), ("ffn_up", ffn, T.Q8_0)):
            blocks(f"blk.{i}.{kind}.weight", (rows, hidden), qtype, 0.2)
            if arch == "qwen2" and kind in ("attn_q", "attn_k", "attn_v"):
                floats(f"blk.{i}.{kind}.bias", 0.1 * rng.standard_normal(rows))
        blocks(f"blk.{i}.ffn_down.weight", (hidden, ffn), T.Q5_1, 0.2)
        floats(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(hidden))
    floats("output_norm.weight", np.ones(hidden))
    if arch == "qwen2":
        blocks("output.weight", (vocab, hidden), T.Q8_0, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def smol_file():
    from ragspec.models.generator import generator_gguf

    return generator_gguf(SMOL)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory, smol_file):
    from ragspec.models.generator import load_generator

    path = write_tiny_gguf(tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf", request.param, smol_file)
    model, tok = load_generator(str(path), "cpu", "gguf")
    return request.param, path, model, tok


def test_a_tiny_gguf_loads_as_transformers_reads_it(tiny):
    """Tokenizer and chat template from the file; the token table and norms are transformers' bits; the logits
    track its de-quantized float model (the kernels quantize activations: rounding only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ragspec.models.gguf_model import GGUFEmbedding
    from ragspec.runtime.gguf_linear import GGUFLinear

    arch, path, model, tok = tiny
    assert model.config.model_type == arch and isinstance(model.model.embed_tokens, GGUFEmbedding)
    assert all(isinstance(m, GGUFLinear) for n, m in model.named_modules() if n.endswith(("proj", "lm_head")))
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = chat_prompt(tok, PASSAGES[0], QUESTIONS[0][0])
    # the same chat text (a Qwen2 file with SmolLM2's vocabulary may split "\n\n" otherwise once saved)
    assert tok.decode(prompt) == ref_tok.decode(chat_prompt(ref_tok, PASSAGES[0], QUESTIONS[0][0]))
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        assert torch.equal(model.model.embed_tokens(ids), ref.model.embed_tokens(ids))
        a, b = model(ids).logits[0], ref(ids).logits[0]
    ours = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # a GGUFLinear's bias is a buffer
    for name, p in ref.named_parameters():
        if "norm" in name or name.endswith("bias"):
            assert torch.equal(ours[name], p), name
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.99
    assert not any(p.is_meta for p in [*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("method", METHODS)
def test_every_drafter_is_greedy_identical_on_a_tiny_gguf(tiny, method):
    _, _, model, tok = tiny
    eos = sorted(SpeculativeGenerator(model, tok).eos)
    for q, p in QUESTIONS[:2]:
        prompt = chat_prompt(tok, PASSAGES[p], q)
        gen = SpeculativeGenerator(model, tok, drafter=make_drafter(method, model, tok), max_new_tokens=32,
                                   budget=AdaptiveBudget(FLAT))
        gen.generate(prompt)
        assert gen.tokens == reference(model, prompt, 32, eos), method


def test_the_embedded_gguf_and_its_copy_by_path_give_the_same_logits_and_keep_no_float_copy(tmp_path, monkeypatch,
                                                                                            smol_file):
    from ragspec.models.generator import load_generator

    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path / "home"))
    mine = tmp_path / "elsewhere" / "mine.gguf"
    mine.parent.mkdir()
    shutil.copy(smol_file, mine)
    (a, tok), (b, tok_b) = load_generator(SMOL, "cpu", "gguf"), load_generator(str(mine), "cpu", "gguf")
    prompt = chat_prompt(tok, PASSAGES[2], QUESTIONS[3][0])
    assert prompt == chat_prompt(tok_b, PASSAGES[2], QUESTIONS[3][0])
    with torch.inference_mode():
        assert torch.equal(a(torch.tensor([prompt])).logits, b(torch.tensor([prompt])).logits)
    kept = sorted(p.name for p in (tmp_path / "home" / "models").iterdir() if not p.name.endswith(".lock"))
    assert all(".blocks" in n or ".meta-" in n for n in kept), kept  # no float folder, no GGUF copy
    total = sum(p.stat().st_size for p in (tmp_path / "home" / "models").rglob("*") if p.is_file())
    assert total < 1.5 * 2 * smol_file.stat().st_size  # two sources' packings, each about the GGUF's size


def test_a_new_homes_first_load_prepares_in_a_child_process(tmp_path, monkeypatch, smol_file):
    """Reading the GGUF's metadata and packing its blocks run in a child process, so the heap they free never
    stays with the asking process (the 0.5B's first ask peaked 0.08 GB above a warm one); the parent reads what the
    child kept. Where the child cannot run or fails, the parent does the work itself, as before."""
    import sys

    from ragspec.models import generator
    from ragspec.models.gguf_source import gguf_source
    from ragspec.runtime import gguf_blocks

    monkeypatch.setenv("RAGSPEC_HOME", str(tmp_path / "home"))
    mine, other = tmp_path / "mine.gguf", tmp_path / "other.gguf"
    for path in (mine, other):
        shutil.copy(smol_file, path)
    pack = gguf_blocks._pack
    with monkeypatch.context() as mp:
        mp.setattr(gguf_blocks, "_pack", lambda *a, **k: pytest.fail("packed in the asking process"))
        generator.load_generator(str(mine), "cpu", "gguf")
    assert generator._kept(gguf_source(str(mine)))

    packed = []
    monkeypatch.setattr(gguf_blocks, "_pack", lambda *a, **k: packed.append(1) or pack(*a, **k))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # a child that fails
    generator.load_generator(str(other), "cpu", "gguf")
    assert packed and generator._kept(gguf_source(str(other)))


def test_a_pipeline_answers_with_a_gguf_named_by_path(tmp_path, smol_file, embedder):
    from conftest import write_corpus

    from ragspec.index.builder import build_index
    from ragspec.pipeline import Pipeline
    from ragspec.retrieve.retriever import Retriever
    from ragspec.settings import IndexSettings
    from ragspec.spec import load_spec

    mine = tmp_path / "models" / "mine.gguf"
    mine.parent.mkdir()
    shutil.copy(smol_file, mine)
    index = tmp_path / "index"
    build_index(write_corpus(tmp_path / "corpus"), index, IndexSettings(chunk_tokens=48, overlap=8),
                embedder=embedder, show_progress=False)
    spec = load_spec({"generator": {"model": str(mine), "max_new_tokens": 24}, "drafting": {"method": "suffix"}})
    pipe = Pipeline(spec, Retriever(str(index), spec.retriever, embedder=embedder))
    answer = pipe.ask("Which mode opens a file for appending?")
    assert answer.text.strip() and answer.stats.new_tokens > 0


def test_an_architecture_the_kernels_do_not_run_is_one_clear_line(tmp_path):
    import gguf

    from ragspec.models.generator import load_generator

    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(RagspecError, match=r"architecture 'falcon' is not one the GGUF kernels run"):
        load_generator(str(path), "cpu", "gguf")
    with pytest.raises(RagspecError, match=r"not an embedded model or a local \.gguf"):
        load_generator(str(tmp_path / "missing.gguf"), "cpu", "gguf")


def test_the_metadata_folder_read_fast_is_the_one_transformers_own_reader_makes(tmp_path, smol_file):
    """`gguf_fields.FieldsReader` (one pass in plain Python) gives transformers the same config and tokenizer files
    as `gguf.GGUFReader` (the real SmolLM2 file); every field's value agrees (and a tiny Qwen2 file's)."""
    import filecmp

    import gguf
    from transformers import AutoConfig, AutoTokenizer
    from transformers.integrations.ggml import _gguf_parse_value

    from ragspec.models.gguf_fields import FieldsReader, fast_reader

    files = [smol_file, write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2", smol_file, layers=1)]
    for path in files:
        ours, theirs = FieldsReader(path), gguf.GGUFReader(str(path))
        assert list(ours.fields) == list(theirs.fields)
        for key, field in theirs.fields.items():
            mine = ours.fields[key]
            assert mine.types == [int(t) for t in field.types], key
            assert ([_gguf_parse_value(mine.parts[i], mine.types) for i in mine.data]
                    == [_gguf_parse_value(field.parts[i], field.types) for i in field.data]), key
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    made = []
    for fast in (True, False):  # the real file: the slow reader takes ~10 s over its 49k-token vocabulary
        out = tmp_path / f"meta-{fast}"
        with fast_reader() if fast else contextlib.nullcontext():
            AutoConfig.from_pretrained(str(smol_file.parent), gguf_file=smol_file.name).save_pretrained(out)
            AutoTokenizer.from_pretrained(str(smol_file.parent), gguf_file=smol_file.name).save_pretrained(out)
        made.append(out)
    names = sorted(p.name for p in made[0].iterdir())
    assert names == sorted(p.name for p in made[1].iterdir()) and "tokenizer.json" in names
    assert all(filecmp.cmp(made[0] / n, made[1] / n, shallow=False) for n in names)
    assert gguf.GGUFReader is gguf.gguf_reader.GGUFReader  # lent only meanwhile


@pytest.mark.skipif(not installed(QWEN), reason="the 0.5B's weight packages are not installed")
def test_a_gguf_tokenizer_loads_lean_with_the_ids_of_its_own_class():
    """`load_tokenizer` reads a GGUF's tokenizer.json as the generic fast tokenizer (Qwen2Tokenizer keeps Python
    copies of its 151k-token vocabulary and merges): the same ids, chat prompts, decoding and special tokens as the
    class AutoTokenizer picks, on the Qwen model."""
    from transformers import AutoTokenizer

    from ragspec.models.generator import load_tokenizer, tokenizer_source

    lean, own = load_tokenizer(QWEN), AutoTokenizer.from_pretrained(tokenizer_source(QWEN))
    assert type(own).__name__ == "Qwen2Tokenizer" and type(lean) is not type(own)
    texts = [*PASSAGES, "  spaces\n\n\ttabs 12345 ünïcödé 日本語 🙂 <|im_start|>user hi<|im_end|>\r\n x"]
    assert [lean.encode(t) for t in texts] == [own.encode(t) for t in texts]
    for q, p in QUESTIONS:
        assert chat_prompt(lean, PASSAGES[p], q) == chat_prompt(own, PASSAGES[p], q)
    assert [lean.decode(lean.encode(t)) for t in texts] == [own.decode(own.encode(t)) for t in texts]
    assert (lean.eos_token_id, lean.pad_token_id, lean.all_special_ids) == (own.eos_token_id, own.pad_token_id,
                                                                          own.all_special_ids)
