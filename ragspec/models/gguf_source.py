"""A GGUF a spec names: an embedded generator's parts (the registry) or a local `.gguf` (`runtime.gguf_file`)."""

from __future__ import annotations

from ragspec.errors import RagspecError
from ragspec.runtime.gguf_file import GGUFSource, file_source


def gguf_source(name: str) -> GGUFSource:
    """The GGUF `name` stands for: an embedded generator's parts, or a local `.gguf` file. Anything else is one
    clear error."""
    from ragspec.models.registry import lookup, part_paths

    embedded = lookup(name, "generator")
    if embedded is not None:
        if embedded.fmt != "gguf":
            raise RagspecError(f"'{name}' does not ship as a GGUF")
        return GGUFSource(tuple(part_paths(embedded)), f"{embedded.name}-{embedded.sha256[:12]}", embedded.sha256,
                          embedded.sha256, embedded.pip_command)
    return file_source(name)
