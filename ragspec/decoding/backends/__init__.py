"""Verifier backends: `transformers` (a Hugging Face model, the default) and `llama.cpp` (a GGUF run by
llama-cpp-python). The loop asks `make_backend` for one per generation; nothing else looks at which."""

from __future__ import annotations

from ragspec.decoding.backends.base import Backend, StepResult

NAMES = ("transformers", "llama.cpp")


def is_llama(model) -> bool:
    return type(model).__name__ == "LlamaCppModel"  # by name: no llama_cpp import to ask


def backend_class(model):
    """The backend class that runs this loaded model."""
    if is_llama(model):
        from ragspec.decoding.backends.llama_cpp import LlamaCppBackend

        return LlamaCppBackend
    from ragspec.decoding.backends.transformers import TransformersBackend

    return TransformersBackend


def make_backend(model, sampling, hidden_layer=None, attention_heads=(), predictions=False) -> Backend:
    """A fresh verifier for one generation on `model`. `predictions`: return every row's argmax per step."""
    if predictions:
        return backend_class(model)(model, sampling, hidden_layer=hidden_layer, attention_heads=attention_heads,
                                    predictions=True)
    return backend_class(model)(model, sampling, hidden_layer=hidden_layer, attention_heads=attention_heads)


__all__ = ["Backend", "NAMES", "StepResult", "backend_class", "is_llama", "make_backend"]
