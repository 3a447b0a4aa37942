"""Load a causal LM and its tokenizer by registry name, local folder or hub id."""

from __future__ import annotations

from ragspec.errors import RagspecError
from ragspec.models.registry import hub_error, lookup, resolve_hub_or_folder


def torch_dtype(name: str, what: str):
    """The torch dtype for a setting's name; a bad name is a one-line error."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise RagspecError(f"{what} dtype '{name}' is not one of {', '.join(dtypes)}")
    return dtypes[name]


def generator_source(name: str) -> str:
    """A path or hub id `from_pretrained` can load; embedded GGUF models are converted once and cached."""
    embedded = lookup(name, "generator")
    if embedded is not None:
        from ragspec.models.gguf_cache import ensure_converted

        return str(ensure_converted(embedded))
    return resolve_hub_or_folder(name, "generator")


def load_generator(name: str, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer), the model in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dt = torch_dtype(dtype, "generator")
    source = generator_source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dt).to(device)
    except RagspecError:
        raise
    except Exception as exc:
        raise hub_error(name, "generator", exc) from exc
    model.eval()
    return model, tokenizer
