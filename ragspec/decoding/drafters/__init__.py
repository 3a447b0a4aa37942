"""Drafters: where draft tokens come from. All follow `base.Drafter`; `make_drafter` builds one by name."""

from __future__ import annotations

import inspect

from ragspec.decoding.drafters.base import DraftState, Drafter, NoDraft, Segment
from ragspec.decoding.drafters.pld import PromptLookupDrafter
from ragspec.decoding.drafters.pldplus import PLDPlusHiddenDrafter, default_layer
from ragspec.decoding.drafters.trie import NgramTrieDrafter

METHODS = ("none", "pld", "trie", "pldplus-h")


CLASSES = {"pld": PromptLookupDrafter, "trie": NgramTrieDrafter, "pldplus-h": PLDPlusHiddenDrafter}


def check_params(name: str, params: dict) -> None:
    """ValueError naming the first parameter `name`'s drafter does not take."""
    cls = CLASSES.get(name)
    allowed = [] if cls is None else [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in params:
        if key not in allowed:
            raise ValueError(f"unknown parameter '{key}' for drafting method '{name}'"
                             f" (it takes {', '.join(allowed) if allowed else 'none'})")


def make_drafter(name: str, model=None, **params) -> Drafter:
    """A drafter by method name; `params` are its constructor arguments (from the pipeline spec)."""
    if name in METHODS:
        check_params(name, params)
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
           "PromptLookupDrafter", "Segment", "check_params", "make_drafter"]
