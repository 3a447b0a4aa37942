"""Drafters: where draft tokens come from. All follow `base.Drafter`; `make_drafter` builds one by name."""

from __future__ import annotations

import inspect

from ragspec.decoding.drafters.auto import AutoDrafter
from ragspec.decoding.drafters.base import Drafter, DraftState, NoDraft, Segment
from ragspec.decoding.drafters.lookahead import LookaheadDrafter
from ragspec.decoding.drafters.ngrammys import NgrammysDrafter
from ragspec.decoding.drafters.oracle import OracleDrafter
from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.decoding.drafters.pldplus import PLDPlusAttentionDrafter, PLDPlusHiddenDrafter, default_layer
from ragspec.decoding.drafters.suffix import SuffixDrafter
from ragspec.decoding.drafters.trie import NgramTrieDrafter

METHODS = ("none", "pld", "trie", "suffix", "pldplus-h", "pldplus-a", "lookahead", "ngrammys", "auto")
AUTO_PARTS = ("suffix", "pld")  # `auto`'s parts unless `parts` is given, best first


CLASSES = {"pld": PromptLookupDrafter, "trie": NgramTrieDrafter, "suffix": SuffixDrafter,
           "pldplus-h": PLDPlusHiddenDrafter, "pldplus-a": PLDPlusAttentionDrafter, "lookahead": LookaheadDrafter,
           "ngrammys": NgrammysDrafter, "auto": AutoDrafter}
EXTRA_PARAMS = {"pldplus-a": ("top",)}  # settings that are not constructor arguments


def check_params(name: str, params: dict) -> None:
    """ValueError naming the first parameter `name`'s drafter does not take."""
    cls = CLASSES.get(name)
    # memory: the pipeline's own object; model_rows / cache_path: ngrammys' model bigram, set from the model
    internal = ("self", "memory", "model_rows", "cache_path")
    allowed = [] if cls is None else [p for p in inspect.signature(cls.__init__).parameters if p not in internal]
    allowed += EXTRA_PARAMS.get(name, ())
    for key in params:
        if key not in allowed:
            raise ValueError(f"unknown parameter '{key}' for drafting method '{name}'"
                             f" (it takes {', '.join(allowed) if allowed else 'none'})")


def make_drafter(name: str, model=None, tokenizer=None, **params) -> Drafter:
    """A drafter by method name; `params` are its constructor arguments (from the pipeline spec).
    `pldplus-a` without `heads` calibrates induction heads once per model (cached), which needs the tokenizer."""
    if name in METHODS:
        check_params(name, {k: v for k, v in params.items() if k != "memory"})
    if name == "none":
        return NoDraft()
    if name == "auto":
        names = params.pop("parts", AUTO_PARTS)
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        memory = params.pop("memory", None)
        # not lookahead: its window advances only when its own tree is verified whole
        bad = [n for n in names if n not in METHODS or n in ("auto", "none", "pldplus-h", "pldplus-a", "lookahead")]
        if bad or not names:
            raise ValueError("auto drafting parts must be drafters that need no hidden states, attention rows or "
                             f"whole-tree verification, not {bad or names}")
        return AutoDrafter([make_drafter(n, model, tokenizer, **({"memory": memory} if n == "suffix" and memory
                                                                  is not None else {})) for n in names])
    if name == "pld":
        return PromptLookupDrafter(**params)
    if name == "trie":
        return NgramTrieDrafter(**params)
    if name == "suffix":
        return SuffixDrafter(**params)
    if name == "lookahead":
        return LookaheadDrafter(**params)
    if name == "ngrammys":
        if model is not None and "model_rows" not in params:
            params["model_rows"], params["cache_path"] = bigram_source(model, params)
        return NgrammysDrafter(**params)
    if name == "oracle":  # benchmarks only: it needs the reference output (set `.reference` per prompt)
        return OracleDrafter(**params)
    if name == "pldplus-h":
        params.setdefault("layer", default_layer(model.config))
        return PLDPlusHiddenDrafter(**params)
    if name == "pldplus-a":
        if "heads" not in params:
            from ragspec.decoding.heads import calibrate_heads

            if model is None or tokenizer is None:
                raise ValueError("pldplus-a needs the model and its tokenizer to calibrate induction heads")
            params["heads"] = calibrate_heads(model, tokenizer, top=int(params.pop("top", 16)))
        params.pop("top", None)
        return PLDPlusAttentionDrafter(**params)
    raise ValueError(f"unknown drafting method '{name}' (one of {', '.join(METHODS)})")


def bigram_source(model, params: dict):
    """ngrammys' model bigram for a loaded model: the backend's batched row computation and the per-model
    cache file ($RAGSPEC_HOME/bigram/<cost key>-<extend>-k<k>-w<w>.sqlite)."""
    import contextlib
    import inspect as _inspect

    from ragspec.decoding.backends import backend_class, is_llama, step_batcher
    from ragspec.paths import ragspec_home

    if is_llama(model):
        raise ValueError("ngrammys needs the model's own bigram table, which only the transformers backend "
                         "computes; use generator.backend transformers (or another drafting method)")
    backend = backend_class(model)
    defaults = {p.name: p.default for p in _inspect.signature(NgrammysDrafter.__init__).parameters.values()}
    k = int(params.get("k", defaults["k"]))
    extend = params.get("extend", defaults["extend"])
    w = int(params.get("w", defaults["w"])) if extend == "greedy" else 1
    path = ragspec_home() / "bigram" / f"{backend.cost_key(model)}-{extend}-k{k}-w{w}.sqlite"

    def rows(tokens, k_, w_):
        batcher = step_batcher(model)  # generations share the model: its forwards take turns
        with batcher.exclusive() if batcher is not None else contextlib.nullcontext():
            return backend.bigram_rows(model, tokens, k_, w_)

    return rows, path


__all__ = [
    "METHODS",
    "AutoDrafter",
    "DraftState",
    "Drafter",
    "LookaheadDrafter",
    "NgramTrieDrafter",
    "NgrammysDrafter",
    "NoDraft",
    "OracleDrafter",
    "PLDPlusAttentionDrafter",
    "PLDPlusHiddenDrafter",
    "PromptLookupDrafter",
    "Segment",
    "SuffixDrafter",
    "check_params",
    "make_drafter",
]
