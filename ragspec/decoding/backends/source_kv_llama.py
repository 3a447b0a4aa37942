"""The llama.cpp side of the source cache (decoding/source_cache.py): entries are llama.cpp sequence states
(`llama_state_seq_get_data`), re-positioned with `llama_memory_seq_add` (llama.cpp turns the keys of shifted
cells by the RoPE delta before the next decode), and joined to sequence 0 with `llama_memory_seq_cp`.

llama.cpp requires a sequence's new tokens to continue from its last position, so the prompt is built in
order: each gap (with the next piece's first `recompute` tokens) is decoded into sequence 0, then the piece's
cached cells join it, and the tail is decoded last; every computed token sees the cells before it, cached or
computed, as in the transformers assembly (source_kv.py), at one decode per gap. CacheBlend's
selection needs layer 1's keys, which llama.cpp does not expose: `blend` is not applied here (the plan's
`fallback` says so).
"""

from __future__ import annotations

import ctypes
import hashlib

from ragspec.decoding.source_cache import SourcePlan, entry_key
from ragspec.errors import RagspecError, check_cancel

SCRATCH = 255  # the sequence a piece is computed or restored in before it joins sequence 0 (MAX_SEQS - 1)


def model_key(m) -> str:
    """Names what a llama.cpp KV depends on: the GGUF (path, size, a hash of its first MiB) and the context."""
    cached = getattr(m, "_ragspec_kv_key", None)
    if cached:
        return cached
    h = hashlib.sha256()
    with open(m.path, "rb") as f:
        h.update(f.read(1 << 20))
    key = f"llama.cpp|{m.path.name}|{m.path.stat().st_size}|{h.hexdigest()[:24]}|ubatch{m.n_batch}"
    m._ragspec_kv_key = key
    return key


def unsupported(m) -> str:
    """Why this context cannot move cached keys ("" when it can)."""
    if not m.lc.llama_memory_can_shift(m.mem):
        return "this llama.cpp context cannot shift positions (llama_memory_can_shift is false)"
    return ""


def _get(m, seq: int) -> bytes:
    lc = m.lc
    size = lc.llama_state_seq_get_size(m.ctx, seq)
    buf = (ctypes.c_uint8 * size)()
    n = lc.llama_state_seq_get_data(m.ctx, buf, size, seq)
    if n == 0:
        raise RagspecError(f"llama.cpp could not read sequence {seq}'s state")
    return bytes(buf[:n])


def _set(m, seq: int, payload: bytes) -> bool:
    buf = (ctypes.c_uint8 * len(payload)).from_buffer_copy(payload)
    return m.lc.llama_state_seq_set_data(m.ctx, buf, len(payload), seq) > 0


def _feed(m, tokens: list[int], positions: list[int], seq: int, last_logits: bool = False, cancel=None) -> None:
    for a in range(0, len(tokens), m.n_batch):
        check_cancel(cancel)
        part = range(a, min(a + m.n_batch, len(tokens)))
        m.decode([(tokens[i], positions[i], [seq], last_logits and i == len(tokens) - 1) for i in part])


def _compute(m, head: list[int], piece: list[int], k: int, cancel=None) -> bytes:
    """The state of the piece's cells after its first k, computed right behind the head (sequence 0 holds the
    head at positions [0, len(head))), in the scratch sequence, which is left empty."""
    lc, mem, H = m.lc, m.mem, len(head)
    lc.llama_memory_seq_rm(mem, SCRATCH, -1, -1)
    lc.llama_memory_seq_cp(mem, 0, SCRATCH, 0, H)
    _feed(m, piece, list(range(H, H + len(piece))), SCRATCH, cancel=cancel)
    lc.llama_memory_seq_rm(mem, SCRATCH, 0, H + k)  # the head's cells stay sequence 0's alone
    payload = _get(m, SCRATCH)
    lc.llama_memory_seq_rm(mem, SCRATCH, -1, -1)
    return payload


def _identity(payload: bytes) -> bytes:
    return payload


def _head_payload(m, store, mkey: str, head: list[int], cancel=None) -> tuple[bytes, bool]:
    """The head's state (sequence 0 holds it afterwards) and whether it came from the store."""
    key = entry_key(mkey, head, [])
    m.clear()
    payload = store.get(key, _identity)
    if payload is not None and _set(m, 0, payload):
        return payload, True
    m.clear()
    _feed(m, head, list(range(len(head))), 0, cancel=cancel)
    payload = _get(m, 0)
    store.put(key, payload, len(payload), _identity)
    return payload, False


def assemble(m, prompt_ids: list[int], plan: SourcePlan, cancel=None, on_progress=None):
    """Sequence 0 holds the whole prompt: the head and pieces from the store (computed into it where missing),
    re-positioned; the computed tokens decoded last. Returns the last token's logits (a copy).

    Missing entries are computed first; the prompt is then assembled from an empty cache the same way whether
    its entries were found or just computed, so a cold ask and a warm one lay out identical cells (llama.cpp
    sums attention in cell order: another layout changes the rounding, and a near-tie can flip a token)."""
    lc, mem = m.lc, m.mem
    n = len(prompt_ids)
    head = list(prompt_ids[: plan.head])
    H = len(head)
    mkey = model_key(m)
    store = plan.store
    head_state, hit = _head_payload(m, store, mkey, head, cancel)
    plan.hits += hit
    plan.misses += not hit
    if hit:
        plan.reused += H
    else:
        plan.stored += H
    k = max(0, plan.recompute)
    parts, cursor = [], H  # (start, end, payload, found in the store)
    for a, b in plan.pieces:
        b = min(b, n - 1)
        if a < cursor or b - a <= k:
            continue
        piece = list(prompt_ids[a:b])
        # an entry holds the piece's cells after its first k: restored, it takes exactly the cells it needs,
        # right after the gap's, so sequence 0's cells stay in position order as after a plain prefill
        key = entry_key(f"{mkey}|from{k}", head, piece)
        payload = store.get(key, _identity)
        found = payload is not None
        if not found:  # computed behind the head alone, in the scratch sequence
            payload = _compute(m, head, piece, k, cancel)
            store.put(key, payload, len(payload), _identity)
        parts.append((a, b, payload, found))
        cursor = b
    m.clear()
    if not _set(m, 0, head_state):
        raise RagspecError("llama.cpp could not restore the prompt head")
    computed, cursor = [], H
    for a, b, payload, found in parts:
        plan.hits += found
        plan.misses += not found
        gap = list(range(cursor, a + k))
        _feed(m, [prompt_ids[p] for p in gap], gap, 0, cancel=cancel)
        if not _set(m, SCRATCH, payload):
            raise RagspecError("llama.cpp could not restore a cached source piece")
        lc.llama_memory_seq_add(mem, SCRATCH, H + k, H + (b - a), a - H)
        lc.llama_memory_seq_cp(mem, SCRATCH, 0, -1, -1)
        lc.llama_memory_seq_rm(mem, SCRATCH, -1, -1)
        computed += gap
        if found:
            plan.reused += b - a - k
        else:
            plan.stored += b - a - k
        cursor = b
    tail = list(range(cursor, n))
    computed += tail
    plan.computed += len(computed)
    _feed(m, [prompt_ids[p] for p in tail], tail, 0, last_logits=True, cancel=cancel)
    logits = m.row((len(tail) - 1) % m.n_batch).copy()
    if on_progress is not None:
        on_progress(n, n)
    return logits


def fill(m, store, head: list[int], pieces: list[list[int]], cancel=None, k: int = 4) -> int:
    """Compute the pieces missing from the store (ahead of asks) for a first-`k` recompute; returns how many
    were computed."""
    mkey = model_key(m)
    _head_payload(m, store, mkey, head, cancel)
    made = 0
    for piece in pieces:
        key = entry_key(f"{mkey}|from{k}", head, piece)
        if not piece or len(piece) <= k or key in store:
            continue
        payload = _compute(m, head, piece, k, cancel)
        store.put(key, payload, len(payload), _identity)
        made += 1
    return made
