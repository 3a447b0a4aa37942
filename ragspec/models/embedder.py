"""Sentence embeddings for chunks and queries, from an embedded model or a hub id (bge-m3, …)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def load_embedder(name: str, device: str = "cpu", dtype: str = "auto", max_tokens: int | None = None) -> Embedder:
    """Load an embedder by registry name, local folder or hub id.

    `max_tokens` raises the model's truncation length to fit chunks of that many tokens (never past its
    position limit). A local model of the plain kind runs without importing sentence-transformers
    (`pooled_encoder.py`: the same vectors, ~1 s less per process).
    """
    from pathlib import Path

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
        if plain is not None:
            model = PooledEncoder(Path(source), *plain, device=device, dtype=dt)
            config = model.auto_model.config
        else:
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(source, device=device, model_kwargs={"dtype": dt}).eval()
            config = model[0].auto_model.config
    except RagspecError:
        raise
    except Exception as exc:  # transformers / hub errors: one line for the user
        raise hub_error(name, "embedder", exc) from exc
    if max_tokens is not None:
        limit = getattr(config, "max_position_embeddings", 512)
        model.max_seq_length = min(max(model.max_seq_length, max_tokens + 2), limit)
    return Embedder(name=canonical, model=model, dtype=dtype)
