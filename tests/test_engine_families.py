"""Greedy identity beyond Llama: Gemma 3 (sliding-window layers, per-layer-type masks) and Qwen2, on small
randomly initialised models of the real transformers classes (no offline weights of these families are
small enough for tests; the architecture code under test is the real one)."""

from __future__ import annotations

import os

import pytest
import torch

from ragspec.decoding.drafters.lookahead import LookaheadDrafter
from ragspec.decoding.drafters.oracle import OracleDrafter
from ragspec.decoding.drafters.suffix import SuffixDrafter
from ragspec.decoding.drafters.trie import NgramTrieDrafter
from ragspec.decoding.generate import SpeculativeGenerator
from ragspec.decoding.tree import DraftTree
from ragspec.decoding.verifier import sliding_window


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    if os.environ.get("RAGSPEC_TEST_TOKENIZER"):  # a machine without the model packages (a GPU box) brings its own
        return AutoTokenizer.from_pretrained(os.environ["RAGSPEC_TEST_TOKENIZER"])
    from ragspec.models.generator import generator_source

    return AutoTokenizer.from_pretrained(generator_source("smollm2-135m-instruct"))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def tiny(family: str, vocab: int, device: str = "cpu"):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    if family == "gemma3":
        cfg = Gemma3TextConfig(**common, head_dim=16, sliding_window=8,
                               layer_types=["sliding_attention", "full_attention"] * 2)
        model = Gemma3ForCausalLM(cfg)
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    return model.eval().to(device)


class Oracle:
    """Drafts the reference continuation (then wrong tokens past it)."""

    name, hidden_layer = "oracle", None

    def __init__(self, ref):
        self.ref = ref

    def prepare(self, state):
        pass

    def update(self, state, new):
        pass

    def propose(self, state, budget):
        done = len(state.generated)
        t = DraftTree()
        t.add_chain(self.ref[done : done + 6] + [7, 7], budget=budget)
        return t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_tree_decoding_matches_generate(family, device, tokenizer):
    model = tiny(family, len(tokenizer), device)
    assert (sliding_window(model.config) == 8) == (family == "gemma3")
    text = "The river rises in the forest and flows to the sea. " * 4
    prompt = tokenizer(text)["input_ids"]  # ~50 tokens: well past the 8-token window
    eos = [tokenizer.eos_token_id]
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=eos, pad_token_id=eos[0],
                             attention_mask=torch.ones_like(ids))
    ref = out[0, len(prompt):].tolist()
    for drafter in (NgramTrieDrafter(), SuffixDrafter(), LookaheadDrafter(), LookaheadDrafter(W=6, N=4, G=3),
                    OracleDrafter(ref), Oracle(ref)):
        gen = SpeculativeGenerator(model, tokenizer, drafter=drafter, max_new_tokens=40, eos_token_ids=eos)
        gen.generate(prompt)
        assert gen.tokens == ref, drafter.name
    assert gen.stats.accepted_draft_tokens > 0


def test_window_mask_hides_old_keys():
    t = DraftTree()
    t.add_chain([5, 6])
    m = t.attention_mask(10, torch.float32, window=4)[0, 0]
    lo = torch.finfo(torch.float32).min
    # root at position 10 sees cached 7..9; node at 11 sees 8..9; node at 12 sees 9
    assert (m[0, :7] == lo).all() and (m[0, 7:10] == 0).all()
    assert (m[1, :8] == lo).all() and (m[1, 8:10] == 0).all()
    assert (m[2, :9] == lo).all() and (m[2, 9:10] == 0).all()
    assert (m[2, 10:13] == 0).all()  # its ancestors and itself
