"""The transformers side of the source cache (decoding/source_cache.py): a model's fingerprint, a piece's KV
computed behind the head, keys re-rotated to another position, and a prompt's cache assembled from the store.

Re-rotation is exact in arithmetic: RoPE turns a key at position p by R(p), and R(p + d) = R(d) R(p), so a
key cached at p is moved to p + d by turning it by d (in float32; the tests hold it to 1e-4 of keys computed at
p + d). What is *not* exact is the context: a cached piece saw only the head before it, not the sources ranked
above it. The first `recompute` tokens of every piece, and everything between pieces, are computed in full over
what is assembled before them, which is EPIC's fix for the attention sink each piece start forms.
"""

from __future__ import annotations

import hashlib
import json

import torch

from ragspec.decoding.backends.base import chunks
from ragspec.decoding.backends.transformers import cache_arg, sliding_window
from ragspec.decoding.source_cache import SourcePlan, entry_key
from ragspec.errors import check_cancel
from ragspec.runtime.cache_only import cache_only
from ragspec.runtime.model_runtime import runtime_of
from ragspec.runtime.prompt_mode import prompt_copy


def rotary(model):
    """The model's rotary embedding module (Llama-style models keep it at model.model.rotary_emb)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "rotary_emb", None) or getattr(model, "rotary_emb", None)


def unsupported(model) -> str:
    """Why this model's cached keys cannot be moved to another position ("" when they can)."""
    cfg = model.config
    if sliding_window(cfg):
        return "its sliding-window layers keep keys by position"
    if prompt_copy(model):
        return f"it reads prompts with a second weight copy ({prompt_copy(model)}, RAGSPEC_GGUF_PROMPT)"
    rope = rotary(model)
    if rope is None or not hasattr(rope, "inv_freq"):
        return "it has no rotary position embedding ragspec can re-rotate (model.model.rotary_emb)"
    kind = getattr(rope, "rope_type", "default")
    if kind in ("dynamic", "longrope"):
        return f"its {kind} RoPE changes its frequencies with the sequence length"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if rope.inv_freq.numel() * 2 != head_dim:
        return "its rotary embedding covers only part of each head"
    return ""


def model_key(model) -> str:
    """Names what a KV depends on: architecture, the model folder's name (ragspec's converted folders carry the
    GGUF's hash), weights (a fingerprint of the embeddings and the norms, which no kernel repacks), dtype, device
    kind and int8 weights. Packed float kernels and attention kernels change
    only rounding, so entries are shared across them (and across processes that chose them differently).
    Kept on the model after the first call."""
    cached = getattr(model, "_ragspec_kv_key", None)
    if cached:
        return cached
    cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
    cfg = json.loads(cfg) if cfg.lstrip().startswith("{") else {"config": cfg}
    cfg.pop("_attn_implementation_autoset", None)
    cfg.pop("_attn_implementation", None)
    folder = str(getattr(model, "name_or_path", "") or cfg.pop("_name_or_path", "")).rstrip("/").split("/")[-1]
    cfg.pop("_name_or_path", None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode() + folder.encode())
    for name, p in model.named_parameters():
        if p.layout == torch.strided and ("embed" in name or "norm" in name):
            h.update(name.encode())
            h.update(p.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    dev = next(model.parameters()).device.type
    dtype = str(next(model.parameters()).dtype).split(".")[-1]
    key = f"transformers|{h.hexdigest()[:24]}|{dev}|{dtype}|int8={getattr(runtime_of(model), 'int8', None) or ''}"
    try:
        model._ragspec_kv_key = key
    except AttributeError:
        pass
    return key


def rotate(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys [..., n, head_dim] turned by `delta` positions (rotate-half RoPE, as Llama, Qwen2 and Mistral)."""
    if delta == 0:
        return keys
    freqs = (float(delta) * inv_freq.double()).to(keys.device)
    emb = torch.cat([freqs, freqs])
    cos, sin = emb.cos(), emb.sin()
    k = keys.double()
    half = k.shape[-1] // 2
    turned = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * cos + turned * sin).to(keys.dtype)


# -- entries: one tensor [layers, 2 (keys, values), kv heads, tokens, head_dim] --------------------------------
def stack(cache, start: int, end: int) -> torch.Tensor:
    """Positions [start, end) of every layer of a DynamicCache, as one entry tensor."""
    return torch.stack([torch.stack([layer.keys[0, :, start:end], layer.values[0, :, start:end]])
                        for layer in cache.layers]).contiguous()


def nbytes(entry: torch.Tensor) -> int:
    return entry.numel() * entry.element_size()


def dump(entry: torch.Tensor) -> bytes:
    head = json.dumps({"shape": list(entry.shape), "dtype": str(entry.dtype).split(".")[-1]}).encode()
    raw = entry.cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return len(head).to_bytes(4, "little") + head + raw


def loader(device):
    def load(payload: bytes) -> torch.Tensor:
        n = int.from_bytes(payload[:4], "little")
        meta = json.loads(payload[4 : 4 + n])
        dtype = getattr(torch, meta["dtype"])
        raw = torch.frombuffer(bytearray(payload[4 + n :]), dtype=torch.uint8)
        entry = raw.view(dtype).reshape(meta["shape"])
        return entry.to(device)

    return load


def append(cache, entry: torch.Tensor) -> None:
    """Append an entry's keys and values to every layer of a DynamicCache."""
    for i, layer in enumerate(cache.layers):
        layer.update(entry[i, 0][None], entry[i, 1][None])


# -- computing and assembling --------------------------------------------------------------------------------
def _forward(model, cache, ids: list[int], start: int, cancel=None, on_chunk=None):
    """Run ids at positions [start, start + len(ids)) over `cache` in PREFILL_CHUNK pieces; the last logits."""
    dev = next(model.parameters()).device
    out = None
    for a, b in chunks(start, start + len(ids)):
        check_cancel(cancel)
        out = model(input_ids=torch.tensor([ids[a - start : b - start]], device=dev),
                    position_ids=torch.arange(a, b, device=dev)[None],
                    **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
        if on_chunk is not None:
            on_chunk(b - a)
    return None if out is None else out.logits[0, -1]


def _new_cache(model):
    from transformers import DynamicCache

    from ragspec.runtime.growing_cache import growing

    return growing(DynamicCache(config=model.config))


def head_entry(model, store, head: list[int], cancel=None) -> tuple[torch.Tensor, bool]:
    """(the head's KV, computed from position 0 so exact; found in the store)."""
    mkey = model_key(model)
    dev = next(model.parameters()).device
    key = entry_key(mkey, head, [])
    entry = store.get(key, loader(dev))
    if entry is not None:
        return entry, True
    cache = _new_cache(model)
    with cache_only():  # its keys and values are all that is kept
        _forward(model, cache, head, 0, cancel)
    entry = stack(cache, 0, len(head))
    store.put(key, entry, nbytes(entry), dump)
    return entry, False


def piece_entry(model, store, head: list[int], piece: list[int], head_kv=None, cancel=None) -> tuple[torch.Tensor, bool]:
    """(the piece's KV computed right behind the head, found in the store)."""
    mkey = model_key(model)
    dev = next(model.parameters()).device
    key = entry_key(mkey, head, piece)
    entry = store.get(key, loader(dev))
    if entry is not None:
        return entry, True
    head_kv = head_entry(model, store, head, cancel)[0] if head_kv is None else head_kv
    cache = _new_cache(model)
    append(cache, head_kv)
    with cache_only():
        _forward(model, cache, piece, len(head), cancel)
    entry = stack(cache, len(head), len(head) + len(piece))
    store.put(key, entry, nbytes(entry), dump)
    return entry, False


def second_layer_kv(model, prompt_ids: list[int]) -> torch.Tensor:
    """[2, kv heads, n, head_dim]: layer 1's keys and values of the whole prompt computed in full (layer 0 over
    every token, then layer 1's projections): where a cached piece's KV first feels the context it missed.
    Costs about one layer of a full prefill."""
    inner = model.model
    dev = next(model.parameters()).device
    n = len(prompt_ids)
    pos = torch.arange(n, device=dev)[None]
    h = inner.embed_tokens(torch.tensor([prompt_ids], device=dev))
    rope = inner.rotary_emb(h, pos)
    lo = torch.finfo(h.dtype).min
    mask = torch.full((n, n), lo, dtype=h.dtype, device=dev).triu_(1)[None, None]
    cache = _new_cache(model)
    out = inner.layers[0](h, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                          position_embeddings=rope)
    h = out[0] if isinstance(out, tuple) else out
    second = inner.layers[1]
    second.self_attn(hidden_states=second.input_layernorm(h), position_embeddings=rope, attention_mask=mask,
                     cache=cache, position_ids=pos)
    return torch.stack([cache.layers[1].keys[0], cache.layers[1].values[0]])


def blend_select(model, prompt_ids: list[int], cached_kv: torch.Tensor, cached_pos: list[int], candidates: list[int],
                 fraction: float) -> list[int]:
    """CacheBlend's selection: of the `candidates` (indices into the cached positions), the `fraction` whose
    layer-1 KV deviates most from the prompt computed in full. `cached_kv`: the assembled entry tensor."""
    if fraction <= 0 or not candidates:
        return []
    full = second_layer_kv(model, prompt_ids)  # [2, H, n, D]
    idx = torch.tensor(candidates, device=full.device)
    at = torch.tensor([cached_pos[i] for i in candidates], device=full.device)
    dev = (full[:, :, at].float() - cached_kv[1][:, :, idx].float()).pow(2).sum(dim=(0, 1, 3))
    k = min(len(candidates), max(1, round(fraction * len(candidates))))
    return sorted(idx[torch.topk(dev, k).indices].tolist())


def _position_mask(rows: torch.Tensor, keys: torch.Tensor, dtype) -> torch.Tensor:
    """Additive mask [rows, keys] for tokens at positions `rows` over keys at positions `keys` (any order):
    every key up to a row's own position visible."""
    mask = torch.full((len(rows), len(keys)), torch.finfo(dtype).min, dtype=dtype, device=rows.device)
    return mask.masked_fill_(keys[None, :] <= rows[:, None], 0)


def attention_select(model, prompt_ids: list[int], cached_kv: torch.Tensor, cached_pos: list[int],
                     query_pos: list[int], candidates: list[int], fraction: float) -> list[int]:
    """ProphetKV / A³'s selection: of the `candidates` (indices into the cached positions), the `fraction` the
    question reads most. The prompt's tail after the last piece (`query_pos`: the question and the template's
    end) runs once over the assembled cache, every layer; a cached token's score is the attention its rows give
    it, averaged over heads and summed over rows and layers. Costs a forward of the tail (a few dozen tokens)."""
    if fraction <= 0 or not candidates or not query_pos:
        return []
    from ragspec.decoding.backends.attention import WEIGHTS_FLAG, _decoder_layers, eager_attention

    dev = next(model.parameters()).device
    n_cached = len(cached_pos)
    score = torch.zeros(n_cached, dtype=torch.float64, device=dev)

    def hook(module, args, output):
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is not None:  # [1, heads, rows, keys]: the cached keys come first
            score.add_(weights[0, :, :, :n_cached].double().mean(dim=0).sum(dim=0))

    attns = [layer.self_attn for layer in _decoder_layers(model)]
    handles = [a.register_forward_hook(hook) for a in attns]
    for a in attns:
        setattr(a, WEIGHTS_FLAG, True)
    try:
        cache = _new_cache(model)
        append(cache, cached_kv)
        rows = torch.tensor(query_pos, device=dev)
        mask = _position_mask(rows, torch.tensor(cached_pos + query_pos, device=dev), cache.layers[0].keys.dtype)
        with eager_attention(model, keep_exact=True):
            model(input_ids=torch.tensor([[prompt_ids[p] for p in query_pos]], device=dev), position_ids=rows[None],
                  attention_mask=mask[None, None], **cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
        for a in attns:
            setattr(a, WEIGHTS_FLAG, False)
    idx = torch.tensor(candidates, device=dev)
    k = min(len(candidates), max(1, round(fraction * len(candidates))))
    return sorted(idx[torch.topk(score[idx], k).indices].tolist())


@torch.inference_mode()
def assemble(model, prompt_ids: list[int], plan: SourcePlan, cancel=None, on_progress=None):
    """(a DynamicCache of the whole prompt in position order, the last token's logits): the head and pieces
    from the store (computed into it where missing), re-positioned; the gaps and each piece's first
    `plan.recompute` tokens computed in full.

    The computed tokens run in one forward (PREFILL_CHUNK at a time), not one per gap: each sees, through a
    position mask, every cached key before it and the computed tokens up to itself, which is what computing
    them gap by gap would give, at one weight read instead of one per piece (on a 2-core CPU a 0.5B forward
    reads 2 GB of float32 weights, ~0.1 s however few its tokens)."""
    inv_freq = rotary(model).inv_freq
    dev = next(model.parameters()).device
    n = len(prompt_ids)
    head = list(prompt_ids[: plan.head])
    store = plan.store
    head_kv, found = head_entry(model, store, head, cancel)
    plan.hits += found
    plan.misses += not found
    if found:
        plan.reused += len(head)
    else:
        plan.stored += len(head)
    parts, cached_pos, computed_pos = [head_kv], list(range(len(head))), []
    stored_at: set[int] = set()  # positions whose entry this ask computed (for the stats)
    cursor = len(head)
    for a, b in plan.pieces:
        b = min(b, n - 1)  # the last token is always computed: its logits start the answer
        k = max(0, plan.recompute)
        if a < cursor or b - a <= k:
            continue  # overlapping or too short to reuse: computed with the gap that follows
        entry, hit = piece_entry(model, store, head, list(prompt_ids[a:b]), head_kv, cancel)
        plan.hits += hit
        plan.misses += not hit
        kv = entry[:, :, :, k:]
        parts.append(torch.stack([rotate(kv[:, 0], a - len(head), inv_freq), kv[:, 1]], dim=1))
        computed_pos += range(cursor, a + k)
        cached_pos += range(a + k, b)
        if hit:
            plan.reused += b - a - k
        else:
            plan.stored += b - a - k
            stored_at.update(range(a + k, b))
        cursor = b
    computed_pos += range(cursor, n)
    assembled = torch.cat(parts, dim=3)
    if plan.blend > 0:  # recompute the piece tokens whose KV deviates most (CacheBlend), not only first-k
        candidates = list(range(len(head), len(cached_pos)))
        if plan.select == "attention":  # or those the question reads most (ProphetKV / A³)
            tail = [p for p in computed_pos if p >= cursor]
            chosen = attention_select(model, list(prompt_ids), assembled, cached_pos, tail, candidates, plan.blend)
        else:
            chosen = blend_select(model, list(prompt_ids), assembled, cached_pos, candidates, plan.blend)
        if chosen:
            keep = torch.ones(len(cached_pos), dtype=torch.bool)
            keep[chosen] = False
            assembled = assembled[:, :, :, keep.to(assembled.device)]
            moved = [cached_pos[i] for i in chosen]
            cached_pos = [p for p, k in zip(cached_pos, keep.tolist()) if k]
            computed_pos = sorted(computed_pos + moved)
            plan.blended += len(moved)
            plan.reused -= sum(1 for p in moved if p not in stored_at)
            plan.stored -= sum(1 for p in moved if p in stored_at)
    if plan.temperature != 1.0 and assembled.shape[3] > len(head):
        # APE's attention temperature: every later query's logits over the reused piece tokens divided by T
        # (keys scaled, RoPE being linear); the head and the recomputed tokens keep theirs
        assembled = assembled.clone()
        assembled[:, 0, :, len(head):] /= plan.temperature
    plan.computed += len(computed_pos)
    cache = _new_cache(model)
    append(cache, assembled)
    if on_progress is not None:
        on_progress(len(cached_pos), n)
    logits = None
    for a, b in chunks(0, len(computed_pos)):
        check_cancel(cancel)
        rows = torch.tensor(computed_pos[a:b], device=dev)
        mask = _position_mask(rows, torch.tensor(cached_pos + computed_pos[a:b], device=dev), cache.layers[0].keys.dtype)
        out = model(input_ids=torch.tensor([[prompt_ids[p] for p in computed_pos[a:b]]], device=dev),
                    position_ids=rows[None], attention_mask=mask[None, None], **cache_arg(model, cache),
                    use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        cached_pos += computed_pos[a:b]
        if on_progress is not None:
            on_progress(len(cached_pos), n)
    order = torch.tensor(sorted(range(n), key=cached_pos.__getitem__), device=dev)
    for layer in cache.layers:  # position order: the decoding loop and the prefix store index by position
        layer.keys, layer.values = layer.keys[:, :, order], layer.values[:, :, order]
    return cache, logits


def fill(model, store, head: list[int], pieces: list[list[int]], cancel=None, k: int = 4) -> int:
    """Compute the pieces missing from the store (ahead of asks); returns how many were computed. An entry
    here serves every first-`k` recompute (the llama.cpp one is per k)."""
    head_kv, _ = head_entry(model, store, head, cancel)
    made = 0
    with torch.inference_mode():
        for piece in pieces:
            if piece and entry_key(model_key(model), head, piece) not in store:
                piece_entry(model, store, head, piece, head_kv, cancel)
                made += 1
    return made
