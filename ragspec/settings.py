"""Settings for building and searching an index (the `index:` and `retriever:` parts of a pipeline spec)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ragspec.models.registry import DEFAULT_EMBEDDER


class Strict(BaseModel):
    """Unknown keys are errors (a typo must not silently fall back to a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class IndexSettings(Strict):
    embedder: str = Field(DEFAULT_EMBEDDER, description="embedded name, HF id (BAAI/bge-m3) or folder")
    embed_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = bfloat16 on CPUs with native bf16 (AMX/AVX512-BF16), else float32"
    )
    embed_batch_size: int = Field(16, ge=1, description="chunks per embedding batch (sorted by length)")
    chunk_tokens: int = Field(256, ge=8, le=8192, description="chunk window, in embedder tokens")
    overlap: int = Field(32, ge=0, description="tokens shared by consecutive chunks")
    index_type: Literal["auto", "flat", "ivfpq"] = Field("auto", description="auto: flat up to 20k chunks")
    faiss_factory: str | None = Field(None, description="exact FAISS factory, e.g. 'IVF4096,PQ64' (the paper)")
    nprobe: int = Field(16, ge=1, description="IVF lists probed per query")
    refine: bool = Field(True, description="re-rank the PQ shortlist exactly (IndexRefineFlat)")
    refine_k_factor: int = Field(8, ge=1, description="shortlist size = k × this")
    bm25: bool = Field(True, description="also build a BM25 index over the same chunks")
    device: Literal["cpu", "cuda"] = Field("cpu", description="embedding and FAISS device")

    @model_validator(mode="after")
    def _overlap_fits(self):
        if self.overlap >= self.chunk_tokens // 2:
            raise ValueError(f"overlap ({self.overlap}) must be less than half of chunk_tokens ({self.chunk_tokens})")
        return self

    def chunker_dict(self) -> dict:
        return {"tokens": self.chunk_tokens, "overlap": self.overlap}


class RetrieverSettings(Strict):
    top_k: int = Field(100, ge=1, description="candidates taken from each first stage (dense, BM25)")
    top_n: int = Field(5, ge=1, description="chunks returned after fusion / reranking")
    mode: Literal["hybrid", "dense", "bm25"] = Field("hybrid", description="first-stage retrieval")
    rrf_k: int = Field(60, ge=1, description="reciprocal-rank-fusion constant")
    reranker: str | None = Field(
        None, description="CrossEncoder name (BAAI/bge-reranker-v2-m3 online); none ships offline"
    )
    nprobe: int | None = Field(None, ge=1, description="override the index's nprobe at search time")
