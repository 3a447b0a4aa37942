"""Cross-encoder reranking (bge-reranker-v2-m3 by name). No cross-encoder ships offline: off by default."""

from __future__ import annotations

from ragspec.errors import RagspecError
from ragspec.models.registry import resolve_hub_or_folder


class CrossEncoderReranker:
    def __init__(self, name: str, device: str = "cpu"):
        from sentence_transformers import CrossEncoder

        self.name = name
        try:
            source = resolve_hub_or_folder(name, "reranker")
        except RagspecError as exc:
            raise RagspecError(f"{exc}, or set reranker to null (hybrid dense+BM25 without reranking)") from None
        try:
            self._model = CrossEncoder(source, device=device)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
            raise RagspecError(
                f"cannot load reranker '{name}' ({first}); no cross-encoder ships offline — set reranker to "
                "null (hybrid dense+BM25 without reranking) or point it to a local CrossEncoder folder"
            ) from exc

    def scores(self, query: str, texts: list[str]) -> list[float]:
        if not texts:
            return []
        return [float(s) for s in self._model.predict([(query, t) for t in texts], show_progress_bar=False)]
