"""The sections of a pipeline spec: index building, retrieval, prompt, generator, drafting, attribution.

Every field has a default and a description (docs/pipelines.md lists them); unknown keys are errors."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ragspec.errors import RagspecError
from ragspec.models.registry import DEFAULT_EMBEDDER, DEFAULT_GENERATOR


def _cosine(value, name: str, words: str) -> float:
    """`value` as a cosine in [-1, 1], or one line naming the setting and the words it also takes."""
    try:
        cos = float(value)
    except (TypeError, ValueError):
        cos = None
    if cos is None or isinstance(value, bool) or not -1.0 <= cos <= 1.0:
        raise RagspecError(f"{name} must be {words} or a cosine in [-1, 1], not {value!r}")
    return cos


def parse_floor(value) -> str | float:
    """`prompt.relevance_floor` as given in YAML or on the command line: "auto", "off" or a cosine in [-1, 1]."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    return _cosine(value, "relevance_floor", "auto, off")


def parse_doubt(value) -> str | float | None:
    """`prompt.relevance_doubt` as given in YAML or on the command line: "auto", none (null) or a cosine in
    [-1, 1]."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null")):
        return None
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return _cosine(value, "relevance_doubt", "auto, null")


def parse_source_tokens(value) -> str | int:
    """`prompt.source_tokens` as given in YAML or on the command line: "auto", "off" or a token count (≥ 1)."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "off"):
        return value.strip().lower()
    try:
        n = None if isinstance(value, bool) or float(value) != int(float(value)) else int(float(value))
    except (TypeError, ValueError, OverflowError):
        n = None
    if n is None or n < 1:
        raise RagspecError(f"source_tokens must be auto, off or a number of tokens (1 or more), not {value!r}")
    return n


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
    spill: int = Field(1, ge=0, le=3, description="extra IVF lists each vector is stored in (SOAR); needs refine")
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
    index: str | None = Field(None, description="the built index to search (a path; `Pipeline(index=...)` wins)")
    top_k: int = Field(100, ge=1, description="candidates taken from each first stage (dense, BM25)")
    top_n: int = Field(5, ge=1, description="chunks returned after fusion / reranking")
    mode: Literal["hybrid", "dense", "bm25"] = Field("hybrid", description="first-stage retrieval")
    rrf_k: int = Field(60, ge=1, description="reciprocal-rank-fusion constant")
    reranker: str | None = Field(
        None, description="CrossEncoder name (BAAI/bge-reranker-v2-m3 online); none ships offline"
    )
    nprobe: int | None = Field(None, ge=1, description="override the index's nprobe at search time")
    merge: bool = Field(True, description="chunks of one document that overlap or touch become one source")
    containment: float | None = Field(
        0.8, gt=0.0, le=1.0, description="a chunk with this share of its word 5-grams inside a chosen source adds "
                                         "its location to that source instead of taking a place (null: off)")
    diversity: float = Field(0.0, ge=0.0, le=1.0, description="maximal marginal relevance over the stored "
                                                              "embeddings: 0 = off … 1 = most diverse")
    filter: dict | list[str] | str | None = Field(
        None, description="metadata filter on every search: LangChain's dict shape or --where strings")


class PromptSettings(Strict):
    style: Literal["quote", "free", "brief"] = Field(
        "quote", description="quote: ask the model to copy the sources' wording (faster, verifiable); free: no such "
                             "ask; brief: a one-sentence answer, then the supporting sentence copied verbatim"
    )
    system: str | None = Field(None, description="replace the built-in system instruction of the style")
    decline: Literal["auto", "last_resort", "expected"] = Field(
        "auto", description="how the instruction to decline is phrased: last_resort (\"if, and only if, none of "
        "the sources answers\"), expected (the sources usually hold the answer; decline only if none says anything "
        "about it); auto: the model's measured best (registry), else last_resort"
    )
    relevance_floor: Literal["auto", "off"] | float = Field(
        "auto", description="decline without running the model when the sources' relevance to the question (the "
        "mean of the best two-sentence window's and the best whole source's cosine, under the index's embedder) "
        "is under this floor, and otherwise ask for an answer without offering to decline; auto: with "
        "relevance_doubt auto, the floor measured for the generator with the embedder where there is one, else "
        "the one measured for the embedder (registry; none measured: off). Not applied to follow-up turns or to a "
        "task on the sources (\"Summarise the notes.\")"
    )
    relevance_doubt: Literal["auto"] | float | None = Field(
        "auto", description="with the relevance gate on: from its floor up to this score the embedder is unsure, "
        "so the model is offered to decline (phrased by `decline`) and its own judgement decides; from this score "
        "on it is asked to answer. auto: with relevance_floor auto, the floor and band measured for the generator "
        "with the embedder (registry; none measured: no band); null: no band (docs/evaluation.md, *Declining*)"
    )
    source_tokens: Literal["auto", "off"] | int = Field(
        "auto", description="the source budget: tokens of source text sent over all sources, each source cut to "
        "the sentence windows that bear on the question (kept in rank order, gaps shown as …; a code block or "
        "table kept whole or not at all); off: every source whole; auto: the budget measured for the generator "
        "(384 tokens of retrieved sources for the 1.5B, given passages whole; 256 for the 0.5B; none measured: "
        "off). Not applied to a task on the "
        "sources (docs/pipelines.md)"
    )
    source_floor: int = Field(
        0, ge=0, description="with a source budget, the tokens each kept source is given at least (0: its best "
        "window)"
    )
    max_context_tokens: int | None = Field(
        None, ge=64, description="prompt budget; default the model's window minus max_new_tokens"
    )
    max_question_tokens: int = Field(
        2048, ge=1, description="a longer question is refused in one line before any retrieval or prefill "
        "(a 30,000-token question is minutes of prefill on a CPU)"
    )

    @field_validator("source_tokens", mode="before")
    @classmethod
    def _source_tokens_parse(cls, value):
        try:
            return parse_source_tokens(value)
        except RagspecError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _floor_and_doubt_parse(self):
        try:
            parse_floor(self.relevance_floor)
            parse_doubt(self.relevance_doubt)
        except RagspecError as e:
            raise ValueError(str(e)) from None
        return self


class RuntimeSettings(Strict):
    """How the CPU/CUDA runtime runs the generator: for comparisons and for machines that need another choice;
    each default is the measured one. An environment variable, where set, wins (runtime/options.py lists them)."""

    prompt_copy: Literal["auto", "int8", "int8-mlp", "bf16", "off"] = Field(
        "auto", description="dtype gguf: the weight copy prompts are read with. auto: the model's measured one (the "
        "Qwen models: int8 where int8 units run it, 1 byte a weight; the 0.5B's of its MLPs alone, int8-mlp, 0.31 "
        "GB); off: the blocks alone (less memory, slower prompts)")
    q8k: Literal["auto", "on", "off"] = Field(
        "auto", description="dtype gguf: Q4_K linears on llama.cpp's Q8_K activation rule (auto: where AMX runs)")
    amx: bool = Field(True, description="dtype gguf: the kernels' AMX tile path where the CPU has it (one switch "
                                        "per process)")
    int8_kernel: Literal["auto", "int_mm", "fp32"] = Field(
        "auto", description="int8 products: torch._int_mm or float32 (the same numbers); auto: int_mm where the "
        "CPU's int8 units run it")
    step_forward: bool = Field(True, description="dtype gguf: draft steps in one loop over the layers' kernels "
                                                 "(the same bits as the module tree)")
    packed_linear: bool = Field(True, description="float and int8 linears packed for oneDNN on CPU")
    exact_attention: bool = Field(True, description="quantized CPU dtypes: attention whose rows do not depend on "
                                                    "the batch (greedy identity needs it)")
    static_verifier: Literal["auto", "on", "off"] = Field("auto", description="static KV cache and padded row "
                                                                              "buckets (auto: on CUDA)")
    cuda_graphs: bool = Field(True, description="the static verifier's steps as CUDA graphs")


class GeneratorSettings(Strict):
    model: str = Field(DEFAULT_GENERATOR, description="embedded name, HF id or folder of a causal LM")
    backend: Literal["auto", "transformers", "llama.cpp"] = Field(
        "transformers", description="what runs the model: transformers (PyTorch), llama.cpp (the GGUF as shipped; "
        "needs llama-cpp-python, built by `make install`; no PLD+ drafting), or auto: on CPU the fastest measured "
        "on this machine for the pipeline's ask shape (`ragspec models --calibrate`), on CUDA transformers"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8", "gguf"] = Field(
        "auto", description="auto: bfloat16 on CUDA; on CPU the fastest measured here of float32, bfloat16 / int8 "
        "where the CPU has them natively, and gguf (with backend auto, a set dtype means transformers); int8 (CPU "
        "only): int8 weights per channel, activations per token, lm_head float32; gguf (CPU only, embedded models): "
        "the GGUF's own 4-8-bit blocks, activations int8 per 32 values, a bf16 copy for prompts where bf16 is native"
    )
    max_new_tokens: int = Field(256, ge=1, description="answer budget, in tokens")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy (output identical to plain greedy decoding)")
    top_k: int = Field(0, ge=0, description="sampling: keep the k most likely tokens (0 = all)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sampling: nucleus mass")
    seed: int | None = Field(None, description="sampling seed (None: random)")
    stop: list[str] = Field(default_factory=list, description="stop strings (never part of the answer)")
    source_cache: Literal["off", "on", "auto"] = Field(
        "auto", description="reuse each source piece's KV across asks, re-positioned (docs/decoding.md, \"The source "
        "cache\"); both backends. auto: on where measured to hold answer quality for the "
        "generator (registry), else off")
    source_cache_recompute: int = Field(
        4, ge=0, description="source cache: the first tokens of each piece computed in full over what precedes it (EPIC)")
    source_cache_blend: float = Field(
        0.5, ge=0.0, le=1.0, description="source cache: also recompute this fraction of each prompt's cached piece "
        "tokens, those whose layer-1 KV deviates most from full prefill (CacheBlend; costs one layer over the prompt). "
        "0.5: the one fraction that kept NQ-open answers within one standard error on tuning records "
        "(docs/decoding.md); 0 is fastest and loses the most")
    source_cache_select: Literal["deviation", "attention"] = Field(
        "deviation", description="source cache: which piece tokens the blend fraction recomputes. deviation: those "
        "whose layer-1 KV deviates most from full prefill (CacheBlend); attention: those the question attends to "
        "most over the assembled cache, every layer (ProphetKV / A3; costs a forward of the prompt's tail)")
    source_cache_temperature: float = Field(
        1.0, gt=0.0, le=2.0, description="source cache: the reused piece tokens' keys divided by this, so that what "
        "reads them sees sharper (below 1) attention logits over them (APE's temperature; transformers backend)")
    prompt_cache_mb: int = Field(
        2048, ge=0, description="memory for the KV of earlier prompts, reused exactly where a new prompt starts the "
        "same way (the system head, then sources sent in the same order); only where rows are computed alike "
        "however batched (CPU dtypes gguf, int8, bfloat16); least recently used go; 0: off")
    source_cache_memory_mb: int = Field(512, ge=0, description="source cache: memory bound (least recently used go)")
    source_cache_disk_mb: int = Field(
        2048, ge=0, description="source cache: disk bound under $RAGSPEC_HOME/kv (0: memory only)")
    parallel: int = Field(
        16, ge=1, description="generations that run at once on one model (ragspec serve, ask_many, batch): their "
        "draft steps share forwards (continuous batching, transformers backends), each answer on a CPU the same as "
        "asked alone; more wait for a place; 1: one at a time (docs/serving.md)")
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings,
                                     description="the runtime's kernels and copies (docs/decoding.md)")


class DraftingSettings(Strict):
    method: Literal["none", "pld", "trie", "suffix", "pldplus-h", "pldplus-a", "lookahead", "ngrammys", "auto"] = Field(
        "suffix", description="where drafts come from (none = plain decoding through the same verifier)"
    )
    budget: int | Literal["auto"] = Field(
        "auto", description="draft tree size: auto = cost-aware (measured forward cost), or a fixed node count"
    )
    params: dict[str, bool | int | float | str | list[str]] = Field(
        default_factory=dict, description="the method's own parameters, e.g. {n: 13, lp: 3, num_draft: 64} for trie, "
                                          "{parts: [suffix, pld]} for auto"
    )
    memory: int = Field(
        64, ge=0, description="suffix (alone or in auto): earlier answers of this pipeline it may draft from (LRU; 0 = off)"
    )


class AttributionSettings(Strict):
    enabled: bool = Field(True, description="cite the answer's spans copied from the sources")
    min_words: int = Field(3, ge=1, description="a copied span needs this many words …")
    min_chars: int = Field(10, ge=1, description="… or this many characters (one rare long word)")
    chars_one_word: bool = Field(False, description="only a one-word span qualifies by min_chars")
    disambiguation: Literal["neighbours", "context", "neighbours-context"] = Field(
        "context", description="words found in several sources: which source (see pipeline/attribution.py)")
    skip_question: bool = Field(False, description="a span the question holds word for word is no citation")


class ServeSettings(Strict):
    queue_size: int = Field(16, ge=0, description="requests admitted beyond the first, generating (up to "
                                                  "generator.parallel) or waiting; more get 503 with Retry-After")
    timeout_s: float = Field(300.0, gt=0, description="per-request limit (waiting included); then 504 / an error event")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="request bodies over this get 413")
    max_messages: int = Field(64, ge=1, description="chat messages per request")
    max_tokens: int = Field(1024, ge=1, description="the most new tokens a request may ask for")
    retry_after_s: int = Field(2, ge=1, description="the Retry-After of a 503")
    prefix_cache: int = Field(4, ge=0, description="KV caches of recent generations kept for prefix reuse (0: off)")
    cors_origins: list[str] = Field(default_factory=list, description="origins allowed by CORS (empty: CORS off; "
                                    "without an API key only the page's own)")
    allowed_hosts: list[str] = Field(default_factory=list, description="Host names a keyless server answers besides "
                                     "its loopback names (`--allow-host`; '*': any)")
    report_reuse: bool = Field(False, description="report prompt tokens reused from earlier requests (cached_tokens, "
                               "stats.*_reused_tokens): they tell one client how much of another's prompt matched")
