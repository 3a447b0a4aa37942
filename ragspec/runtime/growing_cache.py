"""KV cache layers that grow into a buffer instead of concatenating the whole cache at every step.

transformers' `DynamicLayer` appends with `torch.cat`: each decode step copies every layer's whole cache (the
0.5B with 1,024 cached tokens: 24 layers × keys and values × 0.5 MB, read and written), a few ms of a ~40 ms
CPU step. A `GrowingLayer` keeps a buffer with room to spare (doubling when full); `keys` and `values` are views
of its filled prefix, so an append writes only the new rows. What the backends do to a layer keeps working:
assigning a prefix view back (a trim) sets the length, in-place writes through the views land in the buffer,
and any other tensor assigned (a reordered copy, a clone) becomes the new buffer.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 256  # rows a buffer starts with beyond its first append


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose appends write into a buffer (see the module)."""

    def __init__(self, *args, **kwargs):
        self._kbuf = self._vbuf = None
        self._klen = self._vlen = None  # rows filled; None: the tensor is held as given (empty, not 4-D)
        super().__init__(*args, **kwargs)

    @property
    def keys(self):
        return _filled(self._kbuf, self._klen)

    @keys.setter
    def keys(self, t):
        self._kbuf, self._klen = _assign(self._kbuf, t)

    @property
    def values(self):
        return _filled(self._vbuf, self._vlen)

    @values.setter
    def values(self, t):
        self._vbuf, self._vlen = _assign(self._vbuf, t)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._kbuf, self._klen = _append(self._kbuf, self._klen, key_states)
        self._vbuf, self._vlen = _append(self._vbuf, self._vlen, value_states)
        return self.keys, self.values


def _filled(buf, n):
    if buf is None or n is None or n == buf.shape[2]:
        return buf
    return buf[:, :, :n]


def _assign(buf, t):
    """(buffer, length) after `layer.keys = t`: a prefix view of the buffer only moves the length."""
    if t is None or t.dim() != 4:
        return t, None
    if (buf is not None and buf.dim() == 4 and t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride()
            and t.shape[:2] == buf.shape[:2] and t.shape[3] == buf.shape[3] and t.shape[2] <= buf.shape[2]):
        return buf, t.shape[2]
    return t, t.shape[2]


def _append(buf, n, new: torch.Tensor):
    if buf is None or n is None or buf.dim() != 4:
        buf, n = None, 0
    need = n + new.shape[2]
    if (buf is None or buf.shape[2] < need or buf.shape[:2] != new.shape[:2] or buf.shape[3] != new.shape[3]
            or buf.dtype != new.dtype or buf.device != new.device):
        room = max(need + MIN_ROOM, 2 * (0 if buf is None else buf.shape[2]))
        grown = new.new_empty((new.shape[0], new.shape[1], room, new.shape[3]))
        if n:
            grown[:, :, :n] = buf[:, :, :n]
        buf = grown
    buf[:, :, n:need] = new
    return buf, need


def growing(cache):
    """`cache` (a DynamicCache) with each plain `DynamicLayer` replaced by a `GrowingLayer` (sliding-window
    and other layer kinds stay as they are). Call it on a fresh cache."""
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def stand_in_context(cache, config, context: int, dtype: torch.dtype, device) -> bool:
    """Fill a fresh `growing` cache with `context` rows of random keys and values, as a t(n) measurement's
    context: a forward's time does not depend on what the cache holds, and reading a real 384-token context
    costs as much as the measuring (about 7 of a Zen 3 1.5B's 16 s). False (nothing filled) where a layer is not a
    plain growing one (sliding windows and other kinds keep their own rules): read a real context there."""
    if not cache.layers or any(type(layer) is not GrowingLayer for layer in cache.layers):
        return False
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        k, v = (torch.randn(1, heads, context, dim, generator=gen).to(device=device, dtype=dtype) for _ in "kv")
        layer.update(k, v)
    return True
