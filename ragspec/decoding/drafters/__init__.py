"""Drafters: where draft tokens come from. All follow `base.Drafter`; `make_drafter` builds one by name."""

from __future__ import annotations

from ragspec.decoding.drafters.base import DraftState, Drafter, NoDraft, Segment
from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.decoding.drafters.pldplus import PLDPlusHiddenDrafter, default_layer
from ragspec.decoding.drafters.trie import NgramTrieDrafter

METHODS = ("none", "pld", "trie", "pldplus-h")


def make_drafter(name: str, model=None, **params) -> Drafter:
    """A drafter by method name; `params` are its constructor arguments (from the pipeline spec)."""
    if name == "none":
        return NoDraft()
    if name == "pld":
        return PromptLookupDrafter(**params)
    if name == "trie":
        return NgramTrieDrafter(**params)
    if name == "pldplus-h":
        params.setdefault("layer", default_layer(model.config))
        return PLDPlusHiddenDrafter(**params)
    raise ValueError(f"unknown drafting method '{name}' (one of {', '.join(METHODS)})")


__all__ = ["DraftState", "Drafter", "METHODS", "NoDraft", "NgramTrieDrafter", "PLDPlusHiddenDrafter",
           "PromptLookupDrafter", "Segment", "make_drafter"]
