"""The lean step loop of dtype gguf (`runtime/step_forward.py`) gives the module tree's bits, and steps aside.

Greedy identity with it on is checked per drafter by tests/test_gguf_linear.py (the speculative steps run here,
the `generate` reference, with its 2-D mask, on the module tree); this file compares the two forwards directly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from ragspec.decoding.backends.transformers import cache_arg
from ragspec.models.registry import installed
from ragspec.runtime.growing_cache import growing
from ragspec.runtime.model_runtime import runtime_of
from ragspec.runtime.prompt_mode import prompt_forward
from ragspec.runtime.step_forward import step_forward

SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"  # Qwen2: biased q, k and v, the default generator
MIN = torch.finfo(torch.float32).min


@pytest.fixture(scope="module", params=[SMOL, pytest.param(QWEN, marks=pytest.mark.skipif(
    not installed(QWEN), reason="the 0.5B's weight packages are not installed"))])
def gguf(request):
    from ragspec.models.generator import load_generator

    model, _ = load_generator(request.param, dtype="gguf")
    return model


def _prefilled(model, n: int = 300):
    ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(1))
    cache = growing(DynamicCache(config=model.config))
    with torch.inference_mode():
        type(model).forward(model, input_ids=ids, **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    return cache, n


def _trim(cache, n: int) -> None:
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


def _tree_mask(rows: int, past: int, kind=torch.float32) -> torch.Tensor:
    """A draft tree's mask: a chain of half the rows, the rest siblings under the root."""
    visible = torch.ones(1, 1, rows, past + rows, dtype=torch.bool)
    for r in range(rows):
        for c in range(rows):
            if c > r or (r >= rows // 2 and c >= rows // 2 and c != r):
                visible[0, 0, r, past + c] = False
    if kind == torch.bool:
        return visible
    return torch.zeros(visible.shape, dtype=kind).masked_fill_(~visible, torch.finfo(kind).min)


@pytest.mark.parametrize("rows, mask", [(1, None), (5, None), (1, "tree"), (16, "tree"), (7, "bool")])
def test_a_step_is_the_module_trees_bits(gguf, rows, mask):
    """Logits and the keys and values appended: equal, bit for bit, to the modules' forward over the same cache."""
    model = gguf
    assert runtime_of(model).step_forward and runtime_of(model).kernels.endswith("-step")
    cache, past = _prefilled(model)
    ids = torch.randint(100, 20000, (1, rows), generator=torch.Generator().manual_seed(rows))
    pos = torch.arange(past, past + rows)[None]
    m = None if mask is None else _tree_mask(rows, past, torch.bool if mask == "bool" else torch.float32)
    with torch.inference_mode():
        lean = step_forward(model, input_ids=ids, position_ids=pos, attention_mask=m, **cache_arg(model, cache))
        assert lean is not None
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        _trim(cache, past)
        ref = type(model).forward(model, input_ids=ids, position_ids=pos, attention_mask=m,
                                  **cache_arg(model, cache), use_cache=True)
    assert torch.equal(lean.logits, ref.logits)
    assert all(torch.equal(k, layer.keys) and torch.equal(v, layer.values) for (k, v), layer in zip(kv, cache.layers))


def test_model_calls_take_it_and_the_rest_go_to_the_modules(gguf):
    """`model(...)` runs a step here and gives the same logits whichever path ran; hidden states, a prompt read
    and a 2-D mask (as `generate` passes) are the module tree's, with the same logits where they are the same
    forward."""
    model = gguf
    cache, past = _prefilled(model)
    ids = torch.tensor([[1234, 567, 89]])
    pos = torch.arange(past, past + 3)[None]
    with torch.inference_mode():
        ref = type(model).forward(model, input_ids=ids, position_ids=pos, **cache_arg(model, cache), use_cache=True)
        _trim(cache, past)
        out = model(input_ids=ids, position_ids=pos, **cache_arg(model, cache), use_cache=True)
        assert torch.equal(out.logits, ref.logits)
        _trim(cache, past)
        hidden = model(input_ids=ids, position_ids=pos, **cache_arg(model, cache), use_cache=True,
                       output_hidden_states=True)
        assert hidden.hidden_states is not None and torch.equal(hidden.logits, ref.logits)
        _trim(cache, past)
        flat = model(input_ids=ids, attention_mask=torch.ones(1, past + 3, dtype=torch.long),
                     **cache_arg(model, cache), use_cache=True)
        assert torch.equal(flat.logits, ref.logits)
        _trim(cache, past)
        with prompt_forward():  # a prompt read: not a step (the prompt copy's weights where the model has one)
            assert step_forward(model, input_ids=ids, position_ids=pos, **cache_arg(model, cache)) is None
    assert cache.get_seq_length() == past


def test_switched_off_and_other_models_keep_the_modules(monkeypatch):
    from ragspec.decoding.backends.transformers import TransformersBackend
    from ragspec.models.generator import load_generator
    from ragspec.runtime.gguf_kernel import source_digest

    monkeypatch.setenv("RAGSPEC_STEP_FORWARD", "0")
    model, _ = load_generator(SMOL, dtype="gguf")
    assert not runtime_of(model).step_forward and "forward" not in vars(model)
    assert TransformersBackend.cost_key(model).endswith(f"-gguf-{source_digest()}")  # costs of the module tree
    monkeypatch.delenv("RAGSPEC_STEP_FORWARD")
    plain, _ = load_generator(SMOL, dtype="float32")  # no GGUF kernels: nothing to route
    assert not getattr(runtime_of(plain), "step_forward", False)
