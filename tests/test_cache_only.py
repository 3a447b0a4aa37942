"""Prompt chunks read for the cache alone (runtime/cache_only.py): the last layer's o_proj and MLP are skipped, the
cache holds the same bits, and the backends read every chunk without the prompt's last token that way."""

from __future__ import annotations

import pytest
import torch
from conftest import PARAGRAPHS
from transformers import DynamicCache

from ragspec.decoding.backends.base import PREFILL_CHUNK
from ragspec.decoding.backends.transformers import TransformersBackend, cache_arg
from ragspec.runtime.cache_only import cache_only, switch
from ragspec.runtime.prompt_mode import prompt_forward


@pytest.fixture(scope="module", params=["float32", "gguf"])
def model(request):
    from ragspec.models.generator import load_generator

    return load_generator("smollm2-135m-instruct", dtype=request.param)


def prompt(tok, notes: int = 2) -> list[int]:
    text = "\n\n".join(list(PARAGRAPHS.values())[:notes]) if notes <= len(PARAGRAPHS) else \
        "\n\n".join(list(PARAGRAPHS.values()) * (notes // len(PARAGRAPHS) + 1))
    ids = tok.apply_chat_template([{"role": "user", "content": text + "\n\nSummarise the notes."}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def last_mlp_outputs(m):
    """A list that collects, per call of the last layer's MLP through its module, whether it computed anything."""
    seen = []
    handle = m.model.layers[-1].mlp.register_forward_hook(lambda mod, args, out: seen.append(bool(out.abs().sum())))
    return seen, handle


def test_a_cache_only_read_fills_the_same_cache_and_the_next_token_reads_the_same_logits(model):
    m, tok = model
    ids = prompt(tok)
    results = []
    for only in (False, True):
        cache = DynamicCache(config=m.config)
        seen, handle = last_mlp_outputs(m)
        try:
            with torch.inference_mode(), prompt_forward(), cache_only(only):
                m(input_ids=torch.tensor([ids[:-1]]), **cache_arg(m, cache), use_cache=True, logits_to_keep=1)
        finally:
            handle.remove()
        assert seen == [not only], "the cache-only read must skip the last layer's MLP, the plain read run it"
        with torch.inference_mode():  # the prompt's last token, read as a step over either cache
            out = m(input_ids=torch.tensor([ids[-1:]]), **cache_arg(m, cache), use_cache=True, logits_to_keep=1)
        results.append((cache, out.logits))
    (full, full_logits), (only, only_logits) = results
    for a, b in zip(full.layers, only.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert torch.equal(full_logits, only_logits)


def test_the_backend_reads_chunks_without_the_root_for_the_cache_only(model):
    """Two chunks or more: those without the root skip the last MLP, and the root's logits and the cache are the
    bits of a prefill that runs every layer whole (the skip switched off)."""
    m, tok = model
    ids = prompt(tok, 12)
    assert len(ids) > PREFILL_CHUNK + 200  # two chunks at least
    runs = []
    for skip in (True, False):
        switch(skip)
        seen, handle = last_mlp_outputs(m)
        try:
            backend = TransformersBackend(m)
            backend.prefill(ids)
        finally:
            handle.remove()
            switch(True)
        assert backend.cached == len(ids)
        runs.append((seen, backend.cache, backend._root_logits.clone()))
    (seen, cache, logits), (seen_whole, whole, whole_logits) = runs
    assert seen and not seen[0] and all(seen_whole), "the first chunk, without the root, is read for the cache alone"
    assert torch.equal(logits, whole_logits)
    for a, b in zip(cache.layers, whole.layers, strict=True):
        assert torch.equal(a.keys[:, :, :len(ids)], b.keys[:, :, :len(ids)])
        assert torch.equal(a.values[:, :, :len(ids)], b.values[:, :, :len(ids)])


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_other_dense_families_keep_the_same_cache(family):
    """Gemma 3 (sliding-window layers, a norm after its MLP) and Qwen2, small random models: installed, the
    cache-only read fills the same cache; a layer kind not known to be dense is left alone."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    from ragspec.runtime.cache_only import install

    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512)
    if family == "gemma3":
        m = Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=8,
                                               layer_types=["sliding_attention", "full_attention"] * 2)).eval()
    else:
        m = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    assert install(m)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    caches = []
    for only in (False, True):
        cache = DynamicCache(config=m.config)
        with torch.inference_mode(), cache_only(only):
            m(input_ids=ids, **cache_arg(m, cache), use_cache=True, logits_to_keep=1)
        caches.append(cache)
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)

    class MoeLayer(torch.nn.Module):  # a layer kind outside the dense list
        pass

    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([MoeLayer()])
    assert not install(holder)
