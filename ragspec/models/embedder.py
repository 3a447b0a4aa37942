"""Sentence embeddings for chunks and queries, from an embedded model or a hub id (bge-m3, …)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ragspec.errors import RagspecError
from ragspec.models.pooled_encoder import PooledEncoder, plain_pooling
from ragspec.models.registry import hub_error, lookup, part_paths, resolve_hub_or_folder, sha256_file

log = logging.getLogger(__name__)


def best_cpu_dtype() -> str:
    """bfloat16 where the CPU has native bf16 matrix units (AMX / AVX512-BF16), else float32.

    On such CPUs bf16 embeds ~1.7× faster with cosine ≥ 0.996 to float32 (measured on MiniLM).
    """
    import torch

    cpu = torch.cpu
    has_bf16 = getattr(cpu, "_is_amx_tile_supported", lambda: False)() or getattr(
        cpu, "_is_avx512_bf16_supported", lambda: False
    )()
    return "bfloat16" if has_bf16 else "float32"


@dataclass
class Embedder:
    """A loaded sentence-embedding model: normalised vectors, its tokenizer, its limits."""

    name: str
    model: object  # PooledEncoder for the plain kind, else sentence_transformers.SentenceTransformer
    dtype: str

    @property
    def dim(self) -> int:
        get = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        return int(get())

    @property
    def tokenizer(self):
        return self.model.tokenizer

    @property
    def max_tokens(self) -> int:
        """Longest input (in tokens, specials excluded) the model embeds without truncation."""
        return int(self.model.max_seq_length) - 2

    def encode(
        self,
        texts: Sequence[str],
        batch_size: int | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """float32 unit vectors, one row per text, in input order.

        Texts are embedded longest-first in batches (little padding): 8 on a CPU, where that is fastest, and 64
        on a GPU, where each batch's cost is mostly the launches (on an H100, batches of 8 embedded 793 chunks/s:
        docs/benchmarks.md, "On CUDA"); `on_batch(n)` is called after each batch with its size, for progress bars.
        """
        if batch_size is None:
            batch_size = 8 if str(getattr(self.model, "device", "cpu")).startswith("cpu") else 64
        n = len(texts)
        out = np.zeros((n, self.dim), dtype=np.float32)
        if n == 0:
            return out
        order = sorted(range(n), key=lambda i: -len(texts[i]))
        for s in range(0, n, batch_size):
            idx = order[s : s + batch_size]
            vecs = self.model.encode(
                [texts[i] for i in idx],
                batch_size=batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
            out[idx] = vecs.astype(np.float32)
            if on_batch:
                on_batch(len(idx))
        return out

    def encode_query(self, query: str) -> np.ndarray:
        return self.encode([query])[0]

    def encode_windows(
        self,
        texts: Sequence[str],
        batch_size: int | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Each text's vector (as `encode` makes it) and its two-sentence windows' vectors (`corpus.windows`),
        float32, from one forward of the text: the gate's windows cost the index no second pass.

        Each window is the mean of the text's token states inside it (late chunking): on CLAP NQ its gate
        separated answerable from unanswerable as well as embedding each window alone and after its title
        (docs/indexing.md). A text longer than the embedder's limit is read in pieces of whole sentences
        (one sentence shared between neighbours, so each window lies in one piece; the text's vector is its
        first piece's, as truncation gives). An embedder that is not of the plain kind embeds the windows
        alone instead."""
        from ragspec.corpus.windows import window_spans, window_texts

        if batch_size is None:
            batch_size = 8 if str(getattr(self.model, "device", "cpu")).startswith("cpu") else 64
        spans = [window_spans(t) for t in texts]
        if not isinstance(self.model, PooledEncoder):
            vectors = self.encode(texts, batch_size, on_batch)
            return vectors, [self.encode(window_texts(t), batch_size) for t in texts]
        pieces: list[tuple[int, int, int]] = []  # (text, char start, char end)
        owner: list[list[tuple[int, int]]] = []  # per text, per window: (piece, its index among the piece's)
        piece_spans: list[list[tuple[int, int]]] = []
        for i, t in enumerate(texts):
            cuts = self._pieces(t)
            first = len(pieces)
            for a, b in cuts:
                pieces.append((i, a, b))
                piece_spans.append([])
            mine = []
            for a, b in spans[i]:
                k = next((k for k, (x, y) in enumerate(cuts) if x <= a and b <= y), None)
                if k is None:  # a window longer than a piece: where it starts
                    k = max(k for k, (x, _) in enumerate(cuts) if x <= a)
                mine.append((first + k, len(piece_spans[first + k])))
                x = cuts[k][0]
                piece_spans[first + k].append((a - x, b - x))
            owner.append(mine)
        firsts: dict[int, int] = {}  # text → its first piece
        for p, (i, _, _) in enumerate(pieces):
            firsts.setdefault(i, p)
        first_pieces = set(firsts.values())
        tick = (lambda done: on_batch(sum(p in first_pieces for p in done))) if on_batch else None
        done = self.model.encode_spans([texts[i][a:b] for i, a, b in pieces], piece_spans, batch_size, tick)
        vectors = np.zeros((len(texts), self.dim), dtype=np.float32)
        out: list[np.ndarray] = []
        for i in range(len(texts)):
            if i in firsts:
                vectors[i] = done[firsts[i]][0]
            out.append(np.stack([done[p][1][k] for p, k in owner[i]]).astype(np.float32) if owner[i]
                       else np.zeros((0, self.dim), np.float32))
        return vectors, out

    def _pieces(self, text: str) -> list[tuple[int, int]]:
        """`text` as (start, end) pieces of whole sentences within the embedder's limit, neighbours sharing one
        sentence; [(0, len(text))] when it fits (or has under two sentences)."""
        from bisect import bisect_left

        from ragspec.corpus.windows import sentence_spans

        sents = sentence_spans(text)
        ends = [e for _, e in self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                                             verbose=False)["offset_mapping"]]  # no "longer than" warning: cut below
        limit = self.max_tokens
        if len(ends) <= limit or len(sents) < 2:
            return [(0, len(text))]

        def tokens(a: int, b: int) -> int:  # tokens ending inside text[a:b]
            return bisect_left(ends, b + 1) - bisect_left(ends, a + 1)

        cuts, p = [], 0
        while p < len(sents):
            q = p
            while q + 1 < len(sents) and tokens(sents[p][0], sents[q + 1][1]) <= limit:
                q += 1
            cuts.append((0 if p == 0 else sents[p][0], len(text) if q == len(sents) - 1 else sents[q][1]))
            if q == len(sents) - 1:
                break
            p = q if q > p else q + 1
        return cuts


def load_embedder(name: str, device: str = "cpu", dtype: str = "auto", max_tokens: int | None = None) -> Embedder:
    """Load an embedder by registry name, local folder or hub id.

    `max_tokens` raises the model's truncation length to fit chunks of that many tokens (never past its
    position limit). A local model of the plain kind runs without importing sentence-transformers
    (`pooled_encoder.py`: the same vectors, ~1 s less per process).
    """
    if dtype == "auto":
        dtype = best_cpu_dtype() if device == "cpu" else "float16"
    from ragspec.models.generator import torch_dtype

    dt = torch_dtype(dtype, "embedder")
    embedded = lookup(name, "embedder")
    if embedded is not None:
        folder = part_paths(embedded)[0]
        got = sha256_file(folder / "model.safetensors")
        if got != embedded.sha256:
            raise RagspecError(
                f"embedder '{name}': model.safetensors has sha256 {got[:16]}…, expected {embedded.sha256[:16]}…; "
                f"reinstall with `{embedded.pip_command} --force-reinstall`"
            )
        source = str(folder)
        canonical = embedded.name
    else:
        source = resolve_hub_or_folder(name, "embedder")
        canonical = name
    try:
        plain = plain_pooling(Path(source)) if Path(source).is_dir() else None
        with _no_weight_bars():
            model, config = _load_model(source, plain, device, dt)
    except RagspecError:
        raise
    except Exception as exc:  # transformers / hub errors: one line for the user
        raise hub_error(name, "embedder", exc) from exc
    from ragspec.memory import release_freed

    release_freed()  # the float32 weights read on the way to dtype, and the loader's buffers
    if max_tokens is not None:
        limit = getattr(config, "max_position_embeddings", 512)
        model.max_seq_length = min(max(model.max_seq_length, max_tokens + 2), limit)
    return Embedder(name=canonical, model=model, dtype=dtype)


def _load_model(source: str, plain, device: str, dt):
    """(model, its transformers config): a PooledEncoder for the plain kind, else a SentenceTransformer."""
    if plain is not None:
        model = PooledEncoder(Path(source), *plain, device=device, dtype=dt)
        return model, model.auto_model.config
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(source, device=device, model_kwargs={"dtype": dt}).eval()
    return model, model[0].auto_model.config


@contextlib.contextmanager
def _no_weight_bars():
    """transformers' "Loading weights" bar off while ragspec loads an embedder (a library asked for an answer
    prints no bar of another library's); the caller's setting is back after."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()
