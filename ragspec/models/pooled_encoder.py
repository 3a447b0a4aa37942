"""A sentence-transformers model of the plain kind (a transformer, then mean or CLS pooling, then optionally
Normalize) run with transformers alone.

Importing sentence-transformers pulls in scikit-learn and SciPy, ~1 s of every process's first retrieval (a
`ragspec ask` is ~7 s in all). For the plain kind, which is what the embedded MiniLM and bge-m3 are, this class does
the same tokenizer call, forward, pooling and normalisation as sentence-transformers 6 in the same order and dtypes,
so the vectors have the same bits (tests/test_pooled_encoder.py). Any other kind (prompts, lower-casing, extra
modules, other pooling) is left to sentence-transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_TRANSFORMER = {"sentence_transformers.models.Transformer",
                "sentence_transformers.sentence_transformer.modules.Transformer",
                "sentence_transformers.base.modules.transformer.Transformer"}
_POOLING = {"sentence_transformers.models.Pooling", "sentence_transformers.sentence_transformer.modules.Pooling",
            "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}
_NORMALIZE = {"sentence_transformers.models.Normalize", "sentence_transformers.sentence_transformer.modules.Normalize",
              "sentence_transformers.base.modules.normalize.Normalize"}


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def plain_pooling(folder: Path) -> tuple[str, int, bool] | None:
    """(pooling mode 'mean' or 'cls', max_seq_length, ends with Normalize) where `folder` holds a plain
    sentence-transformers model, else None."""
    modules = _read(folder / "modules.json")
    if not isinstance(modules, list) or not 2 <= len(modules) <= 3:
        return None
    types = [m.get("type") for m in modules]
    if types[0] not in _TRANSFORMER or modules[0].get("path") not in ("", ".") or types[1] not in _POOLING:
        return None
    if len(types) == 3 and types[2] not in _NORMALIZE:
        return None
    bert = _read(folder / "sentence_bert_config.json")
    st = _read(folder / "config_sentence_transformers.json")
    if bert.get("do_lower_case") or set(bert) - {"max_seq_length", "do_lower_case"}:
        return None
    if st.get("prompts") or st.get("default_prompt_name") or st.get("model_type", "SentenceTransformer") != \
            "SentenceTransformer":
        return None
    if not modules[1].get("path"):  # a pooling without its config: not one we can read as plain
        return None
    pooling = _read(folder / modules[1]["path"] / "config.json")
    on = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v is True]
    mode = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}.get(on[0]) if len(on) == 1 else None
    if mode is None or pooling.get("include_prompt") is False:
        return None
    if not isinstance(bert.get("max_seq_length"), int) or _read(folder / "config.json").get("is_encoder_decoder"):
        return None
    return mode, bert["max_seq_length"], len(types) == 3


class PooledEncoder:
    """Texts → pooled, L2-normalised vectors, with `SentenceTransformer.encode`'s arguments for what we use."""

    def __init__(self, folder: Path, mode: str, max_seq_length: int, normalize: bool, device: str, dtype):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.auto_model = AutoModel.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        self.mode, self.max_seq_length, self.normalize, self.device = mode, max_seq_length, normalize, device

    def get_embedding_dimension(self) -> int:
        return int(self.auto_model.config.hidden_size)

    def encode(self, texts: Sequence[str], batch_size: int = 32, normalize_embeddings: bool = True,
               **_ignored) -> np.ndarray:
        """Longest first in batches of `batch_size` (sentence-transformers' own order), returned in input order."""
        import torch

        order = np.argsort([-len(t) for t in texts])
        rows: list = []
        with torch.inference_mode():
            for s in range(0, len(texts), batch_size):
                batch = [texts[i] for i in order[s : s + batch_size]]
                rows.extend(self._pooled(batch, normalize_embeddings))
        out = [rows[i] for i in np.argsort(order)]
        return torch.stack(out).float().numpy() if out else np.zeros((0, self.get_embedding_dimension()), np.float32)

    def _pooled(self, batch: list[str], normalize_embeddings: bool):
        features = self.tokenizer(batch, padding=True, truncation="longest_first", return_tensors="pt",
                                  max_length=self.max_seq_length).to(self.device)
        tokens = self.auto_model(**features, return_dict=True)[0]
        return self._pool(tokens, features["attention_mask"], normalize_embeddings).cpu()

    def encode_spans(self, texts: Sequence[str], spans: Sequence[Sequence[tuple[int, int]]],
                     batch_size: int = 8, on_batch=None) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per text: its vector (exactly as `encode` makes it) and, from the same forward, one unit vector per
        character span: the mean of the token states that lie inside the span (late chunking, Günther et al.
        2024), zeros for a span the truncation cut off. Longest first in batches, returned in input order;
        `on_batch(indices)` after each batch."""
        import torch
        import torch.nn.functional as F

        order = np.argsort([-len(t) for t in texts], kind="stable")  # `Embedder.encode`'s batches
        out: list = [None] * len(texts)
        with torch.inference_mode():
            for s in range(0, len(texts), batch_size):
                idx = [int(i) for i in order[s : s + batch_size]]
                features = self.tokenizer([texts[i] for i in idx], padding=True, truncation="longest_first",
                                          return_tensors="pt", max_length=self.max_seq_length,
                                          return_offsets_mapping=True)
                offsets = features.pop("offset_mapping")
                features = features.to(self.device)
                tokens = self.auto_model(**features, return_dict=True)[0]
                mask = features["attention_mask"]
                whole = self._pool(tokens, mask, True).float().cpu().numpy()
                states = tokens.float().cpu()
                for row, i in enumerate(idx):
                    start, end = offsets[row, :, 0], offsets[row, :, 1]
                    real = (end > start) & mask[row].bool().cpu()
                    vecs = torch.zeros((len(spans[i]), states.shape[-1]))
                    for k, (a, b) in enumerate(spans[i]):
                        inside = real & (start >= a) & (end <= b)
                        if inside.any():
                            vecs[k] = F.normalize(states[row][inside].mean(0), dim=0)
                    out[i] = (whole[row], vecs.numpy())
                if on_batch:
                    on_batch(idx)
        return out

    def _pool(self, tokens, mask, normalize_embeddings: bool):
        import torch
        import torch.nn.functional as F

        if self.mode == "cls":
            first = mask.to(torch.int).argmax(dim=1)
            pooled = torch.gather(tokens, 1, first.unsqueeze(-1).unsqueeze(1).expand(-1, 1, tokens.shape[-1]))
            pooled = pooled.squeeze(1)
        else:
            acc = torch.float32 if tokens.dtype in (torch.float16, torch.bfloat16) else tokens.dtype
            m = mask.unsqueeze(-1).to(tokens.dtype)
            total = (tokens * m).sum(dim=1, dtype=acc)
            count = torch.clamp(m.sum(dim=1, dtype=acc), min=1e-9)
            pooled = (total / count).to(tokens.dtype)
        if self.normalize:
            pooled = F.normalize(pooled, p=2, dim=-1)
        if normalize_embeddings:
            pooled = F.normalize(pooled, p=2, dim=1)
        return pooled
